"""One training step (forward, backward, SGD update), the executor next to PyTorch eager.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python -m benchmarks.step_time --device cpu
    python -m benchmarks.step_time --device cuda          # on a machine with a GPU

The same PyTorch module is exported to ONNX (legacy exporter, training mode) and run by
the executor on one rank (a one-device plan, float32, synthetic data), and by PyTorch
eager (``torch.optim.SGD``, cross-entropy), alternating in one run so that both see the
same machine; the table gives the median step of ``--steps`` after two warm-ups and the
ratio executor / PyTorch. Models: the example CNN (examples/cnn.py), the reduced
resnet18 of the torchvision family tests, and ``gpt2``: transformers' GPT-2 at width 512,
4 layers, 8 heads, 512 tokens, its own vocabulary (50,257), no dropout, eager attention,
exported by dynamo (its attention fused by the importer), a token-level cross-entropy
(issue 46's step: batch 2, one thread). Needs torch (a dev extra), transformers for gpt2.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from benchmarks.models import BUILD
from executor.data import SyntheticData, rows_needed
from executor.device import CpuDevice, CudaDevice, cupy_module
from executor.host_memory import keep_freed_memory
from executor.program import compile_program
from executor.runtime import Runtime
from executor.transport import MpiTransport
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import Partitioner, analyze

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BATCH = {("cnn", "cpu"): 32, ("cnn", "cuda"): 256, ("resnet18", "cpu"): 32}
DEFAULT_BATCH.update({("resnet18", "cuda"): 128, ("gpt2", "cpu"): 2, ("gpt2", "cuda"): 8})
GPT2_TOKENS, GPT2_VOCABULARY = 512, 50257


def _gpt2():
    """transformers' GPT-2 at issue 46's size, returning the logits [B, T, V]."""
    import torch

    from tests.sequence_models import _import_transformers, _logits_only

    _import_transformers()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=GPT2_VOCABULARY,
        n_positions=GPT2_TOKENS,
        n_embd=512,
        n_layer=4,
        n_head=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return _logits_only(GPT2LMHeadModel(config), ("input_ids",)).train()


def _module(name: str):
    """The PyTorch module (train mode) and one sample's shape."""
    if name == "gpt2":
        return _gpt2(), (GPT2_TOKENS,)
    if name == "cnn":
        sys.path.insert(0, str(ROOT / "examples"))
        import torch
        from cnn import INPUT_SHAPE, SmallCNN

        torch.manual_seed(0)
        return SmallCNN().train(), INPUT_SHAPE
    from tests.torchvision_models import FAMILIES, build_family

    model, _ = build_family(name)
    return model, FAMILIES[name].sample_shape


def _export(name: str, module, sample_shape) -> Path:
    import torch

    from tests.models import export

    path = BUILD / f"step_{name}.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    if name == "gpt2":  # ids, by dynamo (HF decoders' legacy export fails on aten::diff)
        ids = torch.randint(0, GPT2_VOCABULARY, (2, *sample_shape))
        return export(module, (ids,), path, "dynamo", optimize=False)
    return export(module, torch.randn(2, *sample_shape), path, "legacy")


def _device(kind: str):
    if kind == "cpu":
        return CpuDevice()
    cp = cupy_module()
    if cp is None:
        raise SystemExit("--device cuda: cupy sees no GPU")
    return CudaDevice(cp, 0)


class _Ours:
    """The executor's step on one rank, on a fixed synthetic batch."""

    def __init__(self, path: Path, batch: int, device) -> None:
        model = load_model(path, batch)
        graph = model.graph
        pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))
        self.rt = Runtime(
            pg,
            compile_program(pg, 0),
            MpiTransport(MPI.COMM_SELF, device),
            {**model.weights, **model.state},
            np.float32,
            model.constants,
            device=device,
        )
        self.batch = SyntheticData(graph, 0, np.dtype(np.float32)).batch(0, rows_needed(pg, 0))

    def __call__(self) -> None:
        self.rt.step(self.batch, 0.01)  # returns the loss: the host waits for the step


class _Torch:
    def __init__(self, module, sample_shape, batch: int, device: str, tokens: bool) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda" if device == "cuda" else "cpu")
        self.model = module.to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        if tokens:  # ids in, a label a position
            shape = (batch, *sample_shape)
            self.x = torch.randint(0, GPT2_VOCABULARY, shape, device=self.device)
            self.y = torch.randint(0, GPT2_VOCABULARY, shape, device=self.device)
        else:
            self.x = torch.randn(batch, *sample_shape, device=self.device)
            self.y = torch.randint(0, 10, (batch,), device=self.device)

    def __call__(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        out = self.model(self.x)
        loss = self.torch.nn.functional.cross_entropy(out.flatten(0, -2), self.y.flatten())
        loss.backward()
        self.optimizer.step()
        loss.item()  # the host waits for the step, as ours does when it reads the loss


def _median_ms(runs, steps: int) -> list[float]:
    """Median step of each runner, alternating between them step by step."""
    for run in runs:
        run()
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(steps):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet18", "gpt2"])
    parser.add_argument("--batch", type=int, help="default: 32 on cpu; 256 (cnn), 128 on cuda")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)
    keep_freed_memory()  # as the executor's ranks run (PyTorch shares the process)
    device = _device(args.device)
    print(
        f"{'model':10} {'device':8} {'batch':>5} {'executor ms':>12} {'torch ms':>10} {'ratio':>6}"
    )
    for name in args.models:
        batch = args.batch or DEFAULT_BATCH[(name, args.device)]
        module, shape = _module(name)
        path = _export(name, module, shape)
        reference = _Torch(module, shape, batch, args.device, tokens=name == "gpt2")
        runs = [_Ours(path, batch, device), reference]
        ours, eager = _median_ms(runs, args.steps)
        print(
            f"{name:10} {args.device:8} {batch:5d} {ours:12.2f} {eager:10.2f} {ours / eager:6.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
