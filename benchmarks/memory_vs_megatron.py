"""The memory a plan is priced at, next to Megatron-LM's own count of the same setup.

    python -m benchmarks.memory_vs_megatron [--models-dir DIR] [--models gpt_1.3b,...]

For GPT-1.3B and GPT-2.6B at Alpa's sizes (1,024 tokens, fp16, 16 GiB V100s and 80 GB
H100s) and LLaMA-3-8B (2,048 tokens, bf16, H100s), batch 8, Adam: Megatron-LM's plan
(``search/megatron.py``) at tensor-parallel degree t in {1, 2, 4, 8} on t devices, its
peak a device as ``simulate`` prices it, next to Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", eq. 2 and §4.1): activations
s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes a layer (16-bit activations, 1-byte dropout
masks, no sequence parallelism), plus 18 bytes a parameter / t (16-bit weights and
gradients, float32 master weights and gradients' sums, Adam's two float32 moments).
Where the importer fused the attention (``onnx2soap/importer/attention.py``), the count is
the one for FlashAttention, which keeps no [s, s] tensor: the 5·a·s/(h·t) term is gone
(the paper's count under selective recomputation, sbh(10 + 24/t)).

LLaMA has no dropout, RMSNorm, a SwiGLU MLP of width f and grouped-query attention with
k key-value heads of a; counted the same way, 2 bytes an element, a layer holds: the two
norms' inputs and outputs read by the next product (8sbh, not split), Q, K and V after
their rotations (2sbh(1 + 2k/a)/t), the softmax's output (2as²b/t; none when fused), the attention's
output (2sbh/t), and the MLP's gate and up products, SiLU's output and the product read
by the down projection (8sbf/t). The sources' own accounting is the reference; a row
within 1.25x of it is what the memory model aims at (issue "Memory as the big runs hold
it").

And ZeRO-3 data parallelism over the machine's 8 devices (a sequence each; weights,
gradients and Adam's state sharded 8 ways, each weight gathered for its op), next to
the same count at one sequence and t = 1 with the 18 bytes a parameter over 8.

Models are exported shape-only by ``benchmarks/suite_models.py`` (torch, transformers),
or read from ``--models-dir`` where that wrote them (``NAME.onnx``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import tempfile
from dataclasses import dataclass

from onnx2soap.importer import load_model
from onnx2soap.precision import Precision
from onnx2soap.search.baselines import data_parallel
from onnx2soap.search.megatron import megatron_at
from onnx2soap.sim import RooflineCost, make_simulator, resolve_machine
from onnx2soap.sim.memory import OPTIMIZER_SLOTS
from onnx2soap.soap import Partitioner, analyze
from onnx2soap.soap.zero import ZeroStage

GB = 1e9
DEGREES = (1, 2, 4, 8)
BATCH = 8


@dataclass(frozen=True)
class Shape:
    """What the formula needs of a model: layers, width, heads, tokens; LLaMA's MLP width
    and key-value heads (None: GPT's 4h MLP with Gelu and dropout)."""

    layers: int
    hidden: int
    heads: int
    tokens: int
    ffn: int | None = None
    kv_heads: int | None = None

    def activations(self, batch: int, t: int, fused: bool) -> float:
        """Bytes of one device's activations for the whole model (Korthikanti et al.).
        ``fused``: attention as FlashAttention runs it, which keeps none of the [s, s]
        tensors (the softmax's output, the dropout's mask and output): the paper's
        5as/(ht) term goes, as under its selective recomputation."""
        s, b, h, a = self.tokens, batch, self.hidden, self.heads
        scores = 0 if fused else 1
        if self.ffn is None:
            layer = s * b * h * (10 + 24 / t + scores * 5 * a * s / (h * t))
        else:
            k, f = self.kv_heads, self.ffn
            norms = 8 * s * b * h
            kept = 2 * s * b * h * (1 + 2 * k / a) + scores * 2 * a * s * s * b + 2 * s * b * h
            layer = norms + kept / t + 8 * s * b * f / t
        return self.layers * layer


@dataclass(frozen=True)
class Row:
    model: str
    machine: str
    precision: Precision
    shape: Shape


ROWS = (
    Row("gpt_1.3b", "alpa-v100:1", Precision.FP16, Shape(24, 2048, 32, 1024)),
    Row("gpt_2.6b", "dgx-h100:1", Precision.FP16, Shape(32, 2560, 32, 1024)),
    Row("llama3_8b", "dgx-h100:1", Precision.BF16, Shape(32, 4096, 32, 2048, 14336, 8)),
)


def _model(name: str, models_dir: Path | None, scratch: Path) -> Path:
    if models_dir is not None:
        return models_dir / f"{name}.onnx"
    from benchmarks.suite_models import MODELS, export_model

    return export_model(MODELS[name], scratch).model


def _row(row: Row, path: Path) -> list[str]:
    graph = load_model(path, BATCH).graph
    fused = any(op.type == "Attention" for op in graph.ops)
    space = analyze(graph)
    machine = resolve_machine(row.machine)
    params = sum(t.numel for t in graph.weights)
    partitioner = Partitioner(graph)

    def cell(strategy, zero: ZeroStage, formula: float) -> str:
        sim = make_simulator(machine, RooflineCost(), OPTIMIZER_SLOTS["adam"], row.precision, zero)
        priced = max(sim.evaluate(partitioner.partition(strategy)).peak_memory_bytes)
        fits = "fits" if priced <= machine.devices[0].memory else "over"
        return f"{priced / GB:7.1f} / {formula / GB:5.1f} = {priced / formula:4.2f}x {fits}"

    cells = [
        cell(
            megatron_at(graph, space, t, t),
            ZeroStage.NONE,
            _count(row, params, BATCH, t, fused=fused),
        )
        for t in DEGREES
    ]
    # ZeRO-3 over the machine's devices: a sequence each, every state / devices
    n = machine.size
    zero3 = data_parallel(graph, space, n)
    count = _count(row, params, BATCH // n, 1, n, fused=fused)
    cells.append(cell(zero3, ZeroStage.PARAMETERS, count))
    return cells


def _count(
    row: Row, params: int, batch: int, t: int, shards: int | None = None, *, fused: bool
) -> float:
    """Megatron-LM's count for one device: activations at tensor-parallel degree ``t``,
    18 bytes a parameter over ``t`` (or, under ZeRO-3, over the ``shards`` replicas)."""
    return row.shape.activations(batch, t, fused) + 18 * params / (shards or t)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, help="where suite_models wrote NAME.onnx")
    names = ",".join(r.model for r in ROWS)
    parser.add_argument("--models", default=names, help=f"comma-separated, of {names}")
    args = parser.parse_args(argv)
    wanted = set(args.models.split(","))
    print(f"batch {BATCH}, Adam; per device: priced GB / Megatron-LM's count GB = ratio")
    header = " | ".join(f"{label:^28}" for label in (*(f"t = {t}" for t in DEGREES), "ZeRO-3"))
    print(f"{'model':10} {'machine':12} {'precision':9} | {header}")
    with tempfile.TemporaryDirectory() as scratch:
        for row in ROWS:
            if row.model not in wanted:
                continue
            cells = _row(row, _model(row.model, args.models_dir, Path(scratch)))
            line = f"{row.model:10} {row.machine:12} {row.precision.value:9} | "
            print(line + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
