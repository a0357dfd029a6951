"""The papers' models at their papers' sizes, exported shape-only (no weight is ever made).

FlexFlow (SysML 2019) §8: AlexNet, Inception-v3, ResNet-101 (torchvision's own classes),
RNNTC, RNNLM and NMT (LSTMs of 40 unrolled steps). Alpa (OSDI 2022) Table 4: GPT-3
(1.3B and 2.6B shapes: Hugging Face's GPT-2 classes at those widths), GShard MoE (2.4B)
and Wide-ResNet (its 2B row's widths). And a LLaMA-3-8B shape (transformers' Llama).

Each model is built on torch's meta device (shapes without storage), exported by the
dynamo exporter (``optimize=False``: weights stay as the model has them) with a symbolic
batch, its parameters and buffers saved as graph inputs; those then become initializers
whose external data point into a sparse file (``os.truncate``: no disk, no time). The
graph is the full-size one; its weights are zeros nobody reads.

Where a paper does not give a figure the value chosen is said in the model's ``note``.
Batches scale with the devices (both papers measure weak scaling): ``per_device`` samples
a device, and for Alpa's models one microbatch (Alpa accumulates gradients over
microbatches to a global batch of 1,024 sequences / 1,536 images; we plan the step of one).

    python -m benchmarks.suite_models --models alexnet,rnnlm -o DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import math
import time
import types
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx

from benchmarks.llama_shape import CONFIGS as LLAMA_CONFIGS
from benchmarks.llama_shape import parameters_to_external_data
from onnx2soap.precision import Precision

if TYPE_CHECKING:
    from torch import nn

OPSET = 18  # the dynamo exporter's own: no version conversion


@dataclass(frozen=True)
class Input:
    name: str
    shape: tuple[int, ...]  # without the batch
    integer: bool = False  # token ids (int64) rather than float32 values


@dataclass(frozen=True)
class SuiteModel:
    name: str
    paper: str
    build: Callable[[], nn.Module]
    inputs: tuple[Input, ...]
    per_device: int  # samples a device: the batch is per_device x devices
    precision: Precision
    note: str
    # written without torch (onnx.helper): the folder -> the model's path
    writer: Callable[[Path], Path] | None = None
    # devices a sample takes where one is too big for a device: the batch is then
    # per_device x devices / devices_per_sample (at least one sample)
    devices_per_sample: int = 1

    def batch(self, devices: int) -> int:
        """The cell's batch on ``devices`` (weak scaling)."""
        return max(self.per_device * devices // self.devices_per_sample, 1)


# --- FlexFlow: CNNs -----------------------------------------------------------------------


def _torchvision():
    sys.modules.setdefault(  # torchvision 0.28's CUDA wheel fails beside the CPU torch
        "torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")
    )
    import torchvision

    return torchvision


def build_alexnet() -> nn.Module:
    return _torchvision().models.alexnet(num_classes=1000)


def build_inception_v3() -> nn.Module:
    _torchvision()
    from torchvision.models.inception import Inception3

    return Inception3(num_classes=1000, aux_logits=False, init_weights=False)


def build_resnet101() -> nn.Module:
    return _torchvision().models.resnet101(num_classes=1000)


# --- FlexFlow: RNNs -----------------------------------------------------------------------

RNN_STEPS = 40  # "all RNN models use 40 unrolling steps per recurrent layer"
RNN_HIDDEN = 1024  # hidden and embedding width (FlexFlow's RNN apps: not in the summary)


def build_rnntc(vocabulary: int = 20_000, classes: int = 2) -> nn.Module:
    """Text classification: embedding, 4 LSTM layers, the last step's state -> classes."""
    from torch import nn

    class RnnTc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocabulary, RNN_HIDDEN)
            self.lstm = nn.LSTM(RNN_HIDDEN, RNN_HIDDEN, num_layers=4, batch_first=True)
            self.head = nn.Linear(RNN_HIDDEN, classes)

        def forward(self, ids):
            out, _ = self.lstm(self.embed(ids))
            return self.head(out[:, -1])

    return RnnTc()


def build_rnnlm(vocabulary: int = 10_000) -> nn.Module:
    """Language model (Penn Treebank's 10k words): embedding, 2 LSTM layers, softmax."""
    from torch import nn

    class RnnLm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocabulary, RNN_HIDDEN)
            self.lstm = nn.LSTM(RNN_HIDDEN, RNN_HIDDEN, num_layers=2, batch_first=True)
            self.head = nn.Linear(RNN_HIDDEN, vocabulary)

        def forward(self, ids):
            out, _ = self.lstm(self.embed(ids))
            return self.head(out)

    return RnnLm()


def build_nmt(vocabulary: int = 32_000) -> nn.Module:
    """Encoder-decoder (Wu et al.'s GNMT layout, FlexFlow's NMT): 2 LSTM layers each side,
    dot-product attention over the encoder's steps, attentional layer, softmax."""
    import torch
    from torch import nn

    class Nmt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.src_embed = nn.Embedding(vocabulary, RNN_HIDDEN)
            self.tgt_embed = nn.Embedding(vocabulary, RNN_HIDDEN)
            self.encoder = nn.LSTM(RNN_HIDDEN, RNN_HIDDEN, num_layers=2, batch_first=True)
            self.decoder = nn.LSTM(RNN_HIDDEN, RNN_HIDDEN, num_layers=2, batch_first=True)
            self.attend = nn.Linear(2 * RNN_HIDDEN, RNN_HIDDEN)
            self.head = nn.Linear(RNN_HIDDEN, vocabulary)

        def forward(self, src, tgt):
            memory, state = self.encoder(self.src_embed(src))
            out, _ = self.decoder(self.tgt_embed(tgt), state)
            weights = torch.softmax(out @ memory.transpose(1, 2), dim=-1)
            context = weights @ memory
            hidden = torch.tanh(self.attend(torch.cat([out, context], dim=-1)))
            return self.head(hidden)

    return Nmt()


# --- Alpa --------------------------------------------------------------------------------

SEQ = 1024  # Alpa's GPT and MoE: 1,024 tokens


def _gpt(hidden: int, layers: int, heads: int, vocabulary: int = 51_200) -> nn.Module:
    """Hugging Face's GPT-2 at Alpa's GPT-3 widths (its LM head tied to the embedding, as
    Megatron's), eager attention, no cache: ids [B, T] -> logits [B, T, V]."""
    _torchvision()  # first: transformers imports torchvision when it is installed
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocabulary,
        n_positions=SEQ,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        use_cache=False,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    return _logits_only(GPT2LMHeadModel(config))


def _logits_only(model: nn.Module) -> nn.Module:
    """A Hugging Face LM behind a forward that takes the ids and returns the logits only."""
    from torch import nn

    class LogitsOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False, return_dict=True).logits

    return LogitsOnly()


def build_gpt_1_3b() -> nn.Module:
    return _gpt(2048, 24, 32)


def build_gpt_2_6b() -> nn.Module:
    return _gpt(2560, 32, 32)


def build_moe(
    hidden: int = 1024,
    layers: int = 16,
    heads: int = 16,
    experts: int = 32,
    vocabulary: int = 32_000,
    seq: int = SEQ,
) -> nn.Module:
    """GShard's MoE transformer: every other layer's MLP is ``experts`` experts, top-2
    gating. Written as GShard writes it, with dense dispatch and combine tensors (its
    einsums as batched MatMuls): a group is one sequence of ``seq`` tokens, each expert
    takes ``capacity = 2 * seq / experts`` tokens of a group. The routing (top-2,
    positions in the expert's buffer) is data-dependent and does no FLOPs worth planning;
    here the dispatch mask is the gate's softmax times a fixed slot mask, so the shapes,
    FLOPs and bytes are GShard's."""
    import torch
    from torch import nn

    capacity = 2 * seq // experts
    ffn = 4 * hidden

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.out = nn.Linear(hidden, hidden)
            self.register_buffer("mask", torch.zeros(seq, seq))  # causal: -inf above

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).split(hidden, dim=-1)
            q, k, v = (y.reshape(b, t, heads, hidden // heads).transpose(1, 2) for y in (q, k, v))
            scores = q @ k.transpose(2, 3) / math.sqrt(hidden // heads) + self.mask
            y = torch.softmax(scores, dim=-1) @ v
            return self.out(y.transpose(1, 2).reshape(b, t, hidden))

    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(hidden, experts, bias=False)
            self.up = nn.Parameter(torch.empty(experts, hidden, ffn))
            self.down = nn.Parameter(torch.empty(experts, ffn, hidden))
            self.register_buffer("slots", torch.zeros(seq, 1, capacity))

        def forward(self, x):  # x [G, S, M]: a group a sequence
            g = x.shape[0]
            gates = torch.softmax(self.gate(x), dim=-1)  # [G, S, E]
            dispatch = gates.unsqueeze(-1) * self.slots  # [G, S, E, C]
            dispatch = dispatch.reshape(g, seq, experts * capacity)
            routed = dispatch.transpose(1, 2) @ x  # 'gsec,gsm->gecm'
            routed = routed.reshape(g, experts, capacity, hidden).transpose(0, 1)
            routed = routed.reshape(experts, g * capacity, hidden)  # [E, G*C, M]
            y = torch.relu(routed @ self.up) @ self.down  # each expert its own tokens
            y = y.reshape(experts, g, capacity, hidden).transpose(0, 1)
            return dispatch @ y.reshape(g, experts * capacity, hidden)  # 'gsec,gecm->gsm'

    class Layer(nn.Module):
        def __init__(self, moe: bool) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.attention = Attention()
            self.mlp = Experts() if moe else Dense()

        def forward(self, x):
            x = x + self.attention(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class Moe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocabulary, hidden)
            self.positions = nn.Parameter(torch.empty(seq, hidden))
            self.layers = nn.ModuleList(Layer(i % 2 == 1) for i in range(layers))
            self.ln = nn.LayerNorm(hidden)
            self.head = nn.Linear(hidden, vocabulary, bias=False)

        def forward(self, ids):
            x = self.embed(ids) + self.positions
            for layer in self.layers:
                x = layer(x)
            return self.head(self.ln(x))

    return Moe()


def build_wide_resnet(base: int = 448, width: int = 2, classes: int = 1000) -> nn.Module:
    """Alpa's Wide-ResNet: ResNet-50's bottleneck layout (3, 4, 6, 3) with ``base``
    channels where ResNet has 64 and a bottleneck ``width`` times as wide (Table 4's 2B
    row: 448 and 2), torchvision's Bottleneck blocks."""
    from torch import nn

    _torchvision()
    from torchvision.models.resnet import Bottleneck

    def stage(inplanes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
        out = planes * Bottleneck.expansion
        down = nn.Sequential(
            nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
        )
        first = Bottleneck(inplanes, planes, stride, down, base_width=64 * width)
        rest = [Bottleneck(out, planes, base_width=64 * width) for _ in range(blocks - 1)]
        return nn.Sequential(first, *rest)

    stem = [
        nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(base),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    stages, inplanes = [], base
    for i, blocks in enumerate((3, 4, 6, 3)):
        planes = base * 2**i
        stages.append(stage(inplanes, planes, blocks, 1 if i == 0 else 2))
        inplanes = planes * Bottleneck.expansion
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, classes)]
    return nn.Sequential(*stem, *stages, *head)


# --- LLaMA --------------------------------------------------------------------------------

LLAMA_SEQ = 2048


def build_llama3_8b() -> nn.Module:
    _torchvision()  # before transformers, as above
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**LLAMA_CONFIGS["llama3-8b"], max_position_embeddings=LLAMA_SEQ)
    cfg.tie_word_embeddings = False
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    return _logits_only(LlamaForCausalLM(cfg))


# --- the suite ----------------------------------------------------------------------------

_IMAGE = (Input("input", (3, 224, 224)),)
_FF, _ALPA = "FlexFlow", "Alpa"
MODELS: dict[str, SuiteModel] = {
    m.name: m
    for m in (
        SuiteModel("alexnet", _FF, build_alexnet, _IMAGE, 256, Precision.FP32, "256 a GPU (§8)"),
        SuiteModel(
            "inception_v3",
            _FF,
            build_inception_v3,
            (Input("input", (3, 299, 299)),),
            32,
            Precision.FP32,
            "299x299, no aux head; 32 a GPU (at FlexFlow's 64 no plan fits 16 GiB)",
        ),
        SuiteModel(
            "resnet101",
            _FF,
            build_resnet101,
            _IMAGE,
            16,
            Precision.FP32,
            "16 a GPU (data parallel at FlexFlow's 64 needs 34 GiB a GPU, at 32 17 GiB)",
        ),
        SuiteModel(
            "rnntc",
            _FF,
            build_rnntc,
            (Input("ids", (RNN_STEPS,), True),),
            64,
            Precision.FP32,
            "4 LSTM layers, 1024 wide, 40 steps; 20k words, 2 classes (assumed)",
        ),
        SuiteModel(
            "rnnlm",
            _FF,
            build_rnnlm,
            (Input("ids", (RNN_STEPS,), True),),
            64,
            Precision.FP32,
            "2 LSTM layers, 1024 wide, 40 steps, 10k words (PTB)",
        ),
        SuiteModel(
            "nmt",
            _FF,
            build_nmt,
            (Input("src", (RNN_STEPS,), True), Input("tgt", (RNN_STEPS,), True)),
            64,
            Precision.FP32,
            "2+2 LSTM layers, 1024 wide, 40 steps, attention; 32k words (assumed)",
        ),
        SuiteModel(
            "gpt_1.3b",
            _ALPA,
            build_gpt_1_3b,
            (Input("ids", (SEQ,), True),),
            1,
            Precision.FP16,
            "h 2048, 24 layers, 32 heads, 1024 tokens; 1 sequence a GPU",
        ),
        SuiteModel(
            "gpt_2.6b",
            _ALPA,
            build_gpt_2_6b,
            (Input("ids", (SEQ,), True),),
            1,
            Precision.FP16,
            "h 2560, 32 layers, 32 heads, 1024 tokens; 1 sequence a GPU",
        ),
        SuiteModel(
            "moe_2.4b",
            _ALPA,
            build_moe,
            (Input("ids", (SEQ,), True),),
            1,
            Precision.FP16,
            "h 1024, 16 layers (8 MoE), 32 experts, top-2, 1024 tokens; 1 sequence a GPU",
        ),
        SuiteModel(
            "wide_resnet",
            _ALPA,
            build_wide_resnet,
            _IMAGE,
            8,
            Precision.FP16,
            "Table 4's 2B row's widths (448 base, width 2) on torchvision's bottlenecks: "
            "3.3 G parameters as built; 8 images a GPU",
        ),
        SuiteModel(
            "llama3_8b",
            "LLaMA-3",
            build_llama3_8b,
            (Input("ids", (LLAMA_SEQ,), True),),
            1,
            Precision.BF16,
            "LLaMA-3-8B's config, 2048 tokens; 1 sequence a node of 8 GPUs (a sequence's "
            "activations, 330 GiB as built, fit no fewer than 5 H100s)",
            devices_per_sample=8,
        ),
    )
}


def write_small_mlp(folder: Path) -> Path:
    """Not a paper's model: a 3-layer 256-wide MLP written with onnx.helper (no torch),
    for the suite's own test."""
    from benchmarks.sparse_mlp import write_sparse_mlp

    return write_sparse_mlp(folder, 3, 256, name="small_mlp").model


# Selectable by name, never in the suite by default.
EXTRA: dict[str, SuiteModel] = {
    "small_mlp": SuiteModel(
        "small_mlp",
        "-",
        lambda: None,
        (Input("x", (256,)),),
        16,
        Precision.FP32,
        "3 MatMul layers 256 wide (a test's model)",
        writer=write_small_mlp,
    )
}


def suite_model(name: str) -> SuiteModel:
    return MODELS[name] if name in MODELS else EXTRA[name]


@dataclass(frozen=True)
class Exported:
    model: Path
    parameters: int  # float elements of the weights (buffers included)
    weight_bytes: int  # of the sparse data file
    export_s: float


def export_model(spec: SuiteModel, folder: Path) -> Exported:
    """``folder/NAME.onnx`` (a symbolic batch) with every parameter and buffer an
    initializer of zeros on the sparse ``folder/NAME.onnx.data``."""
    began = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    if spec.writer is not None:
        path = spec.writer(folder)
        size = Path(f"{path}.data").stat().st_size
        return Exported(path, size // 4, size, time.perf_counter() - began)
    import torch

    path, data = folder / f"{spec.name}.onnx", folder / f"{spec.name}.onnx.data"
    with torch.device("meta"):
        model = spec.build().train()
    args = tuple(
        torch.zeros((2, *i.shape), dtype=torch.long if i.integer else torch.float32, device="meta")
        for i in spec.inputs
    )
    batch = torch.export.Dim("batch")  # one Dim: every input shares the batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on training mode, deprecations
        program = torch.onnx.export(
            model,
            args,
            dynamo=True,
            optimize=False,
            dynamic_shapes=tuple({0: batch} for _ in args),
            input_names=[i.name for i in spec.inputs],
            output_names=["logits"],
            opset_version=OPSET,
            verbose=False,
        )
    program.save(str(path), include_initializers=False, keep_initializers_as_inputs=True)
    proto = onnx.load(str(path), load_external_data=False)
    size = parameters_to_external_data(proto, data.name, {i.name for i in spec.inputs})
    size = fold_weight_shapes(proto, data.name, size)
    with open(data, "wb") as f:
        f.truncate(size)
    onnx.save(proto, str(path))
    parameters = sum(p.numel() for p in model.parameters())
    return Exported(path, parameters, stored_bytes(proto), time.perf_counter() - began)


def stored_bytes(proto: onnx.ModelProto) -> int:
    """The bytes of external data the initializers point at."""
    return sum(
        int(next(e.value for e in i.external_data if e.key == "length"))
        for i in proto.graph.initializer
        if i.external_data
    )


# Ops that only rearrange their input: over weights alone they are a different layout of
# the same parameters.
SHAPE_OPS = frozenset({"Transpose", "Concat", "Unsqueeze", "Squeeze", "Reshape"})


def fold_weight_shapes(proto: onnx.ModelProto, location: str, size: int) -> int:
    """Store the weights in the layout the graph reads them: an op of ``SHAPE_OPS``
    computed from initializers alone (and constants) becomes an initializer of its
    output's shape, on new bytes of ``location`` after ``size``; the data's new size.

    The dynamo exporter writes ``nn.Linear`` as ``Transpose(W)`` then ``MatMul`` and an
    LSTM's weights as a ``Concat``; computed from weights alone those ops have no sample
    dim, so data parallelism runs each once, on one device, and sends every replica
    its weights each step (a LLaMA-3-8B shape's data parallel plan needed 2.2 TiB on that
    device). Stored as read (as the legacy exporter's Gemm ``transB`` or GPT-2's Conv1D
    do), the model is the same and data parallelism is what DDP does."""
    from onnx import TensorProto

    inferred = onnx.shape_inference.infer_shapes(proto)
    shapes = {v.name: v.type.tensor_type for v in inferred.graph.value_info}
    constant = {n.output[0] for n in proto.graph.node if n.op_type == "Constant"}
    stored = {i.name for i in proto.graph.initializer}
    # A weight read elsewhere too (GPT-2's embedding, tied to its LM head's Transpose)
    # stays as it is: a copy in another layout would untie it.
    readers = Counter(x for n in proto.graph.node for x in set(n.input))
    folded, kept = [], []
    for node in proto.graph.node:
        inputs = [x for x in node.input if x]
        weight_only = inputs and all(x in stored or x in constant for x in inputs)
        weight_only = weight_only and all(readers[x] == 1 for x in inputs if x in stored)
        out = shapes.get(node.output[0]) if node.output else None
        if (
            node.op_type in SHAPE_OPS
            and weight_only
            and any(x in stored for x in inputs)
            and (out is not None and all(d.HasField("dim_value") for d in out.shape.dim))
        ):
            dims = [d.dim_value for d in out.shape.dim]
            itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(out.elem_type)).itemsize
            offset = -(-size // 64) * 64
            init = TensorProto(name=node.output[0], data_type=out.elem_type, dims=dims)
            init.data_location = TensorProto.EXTERNAL
            length = math.prod(dims) * itemsize
            for key, entry in (("location", location), ("offset", offset), ("length", length)):
                init.external_data.add(key=key, value=str(entry))
            folded.append(init)
            stored.add(node.output[0])
            size = offset + length
        else:
            kept.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(kept)
    proto.graph.initializer.extend(folded)
    read = {x for n in proto.graph.node for x in n.input} | {o.name for o in proto.graph.output}
    unread = [i for i in proto.graph.initializer if i.name not in read]
    for init in unread:  # the layouts no op reads any more
        proto.graph.initializer.remove(init)
    return size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    parser.add_argument("-o", "--output", type=Path, required=True, help="folder to write")
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        got = export_model(suite_model(name), args.output)
        print(
            f"{got.model}: {got.parameters / 1e9:.3f} G parameters, "
            f"{got.weight_bytes / 1e9:.1f} GB of data (sparse), exported in {got.export_s:.1f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
