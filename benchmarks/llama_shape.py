"""A LLaMA-shaped decoder at full size, exported from torch without weights.

The model is built on torch's meta device (shapes, no storage), exported with the
dynamo exporter (``optimize=False``, ``use_cache=False``, eager attention: the settings
the README gives for Hugging Face decoders) with its parameters as graph inputs, and
those inputs then become initializers whose external data point into a sparse file
(``os.truncate``: no disk). The graph is the real one, full size; the weights are zeros
nobody reads. Needs the dev extras (torch, transformers).

    python -m benchmarks.llama_shape [--config llama3-8b|llama3-70b] [--batch 8] [--seq 2048] -o DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import math
import types
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

# Hugging Face LlamaConfig fields of the shapes people train.
CONFIGS = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "llama3-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
}


@dataclass(frozen=True)
class Exported:
    model: Path
    data: Path
    weight_bytes: int


def _llama(config: str, seq: int):
    sys.modules.setdefault(  # torchvision's meta registrations fail beside the CPU torch
        "torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")
    )
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**CONFIGS[config], max_position_embeddings=max(seq, 128))
    cfg.tie_word_embeddings = False
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def export_llama_shape(folder: Path, config: str = "llama3-8b", batch: int = 8, seq: int = 2048):
    """``folder/llama.onnx`` with every parameter an initializer of zeros on a sparse
    ``folder/llama.onnx.data``; returns where they are."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    model_path, data_path = folder / "llama.onnx", folder / "llama.onnx.data"
    model = _llama(config, seq)
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    # The batch symbolic: the importer binds it, a pipeline's microbatch included (with
    # a fixed one, Expand's shapes hold the batch and no microbatch loads).
    sample = torch.export.Dim("batch", min=1, max=1 << 20)
    program = torch.onnx.export(
        model,
        (ids,),
        dynamo=True,
        optimize=False,
        kwargs={"use_cache": False},
        dynamic_shapes={"input_ids": {0: sample}, "use_cache": None},
        verbose=False,
    )
    program.save(str(model_path), include_initializers=False, keep_initializers_as_inputs=True)
    proto = onnx.load(str(model_path), load_external_data=False)
    size = parameters_to_external_data(proto, data_path.name, data_inputs={"input_ids"})
    with open(data_path, "wb") as f:
        f.truncate(size)
    onnx.save(proto, str(model_path))
    return Exported(model_path, data_path, size)


def parameters_to_external_data(proto: onnx.ModelProto, location: str, data_inputs) -> int:
    """Graph inputs other than ``data_inputs`` become initializers stored at 64-byte
    aligned offsets of ``location``; the bytes they need in all."""
    offset, kept = 0, []
    for value in proto.graph.input:
        if value.name in data_inputs:
            kept.append(value)
            continue
        tensor_type = value.type.tensor_type
        dims = [d.dim_value for d in tensor_type.shape.dim]
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)).itemsize
        length = math.prod(dims) * itemsize
        offset = -(-offset // 64) * 64
        init = TensorProto(name=value.name, data_type=tensor_type.elem_type, dims=dims)
        init.data_location = TensorProto.EXTERNAL
        for key, entry in (("location", location), ("offset", offset), ("length", length)):
            init.external_data.add(key=key, value=str(entry))
        proto.graph.initializer.append(init)
        offset += length
    del proto.graph.input[:]
    proto.graph.input.extend(kept)
    return offset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="llama3-8b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("-o", "--output", type=Path, required=True, help="folder to write")
    args = parser.parse_args(argv)
    exported = export_llama_shape(args.output, args.config, args.batch, args.seq)
    print(f"{exported.model}: {exported.weight_bytes / 1e9:.1f} GB of weights (sparse)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
