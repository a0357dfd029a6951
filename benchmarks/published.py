"""Published training runs next to the simulator's prediction of the same configuration.

    python -m benchmarks.published --llama-8k DIR/llama.onnx [--llama-8k-256 DIR256/llama.onnx]
        [--search-budget S]

For each published row this script can express, it writes the plan of the published
configuration (``onnx2soap plan --strategy ...``: no search), prices it with ``onnx2soap
simulate --optimizer adam --json`` and prints the predicted throughput (tokens a second a
GPU: the step's tokens over the step time over the GPUs) and peak memory a GPU next to
the published ones. The model is a shape-only export (``benchmarks/llama_shape.py
--config llama3-8b --batch B --seq 8192``: weights on a sparse file), whose batch is the
graph's per-step batch. The GPUs are priced by their published kernel rates
(``--costs auto``: ``sim/achieved.py``). With ``--search-budget``, a second table: the
plan ``plan`` finds with nothing but the model, the row's machine and batch (bf16, Adam,
``--budget S``), next to the published configuration priced the same way (the issue
asks >= 1.10x); its words are the search's own ("chosen: ...").

Rows (each with its source), torchtitan's Llama 3.1 8B on Meta's Grand Teton hosts
(``grand-teton:N``), FSDP (``--strategy zero --zero-stage 3``), local batch 2 a GPU,
8,192 tokens, bf16, no torch.compile, no Float8, and torchtitan's per-op selective
activation checkpointing (``--recompute selective-op``: its default policy, which keeps
every product's output but every second one of each block; pytorch/torchtitan
``benchmarks/llama3_h100_202412_torchtitan.md``):

- Table 1, 8 GPUs (16 sequences a step): 5,762 tokens/s a GPU, 82.4 GiB peak;
- Table 3, 128 GPUs (256 sequences a step): 5,605 tokens/s a GPU, 67.0 GiB.

Left out, and why: those tables' torch.compile and Float8 rows (fused kernels and FP8
GEMMs the simulator's cost model does not have); Table 2's context-parallel rows (Float8
and torch.compile as well); Megatron-LM's GPT rows (Narayanan et al. 2021, A100s:
``dgx-a100:N``): no text copy of their table was found to cite figure by figure. The
issue "Reproduce published runs" sets the target: within 15 % in time and memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import resource
import subprocess
import tempfile
import time
from dataclasses import dataclass

GiB = 1 << 30
PLAN_MEMORY = 12 * GiB  # of this 23 GiB host; the issue asks planning to stay within 2


@dataclass(frozen=True)
class Published:
    name: str
    machine: str
    gpus: int
    batch: int  # sequences a step
    tokens: int  # a sequence
    rule: tuple[str, ...]  # onnx2soap plan's options for the published configuration
    tokens_per_gpu_s: float
    memory_gib: float
    source: str


FSDP_SELECTIVE_OP = (
    "--strategy",
    "zero",
    "--zero-stage",
    "3",
    "--recompute",
    "selective-op",
    "--precision",
    "bf16",
)
SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TORCHTITAN = Published(
    "torchtitan Llama 3.1 8B, FSDP, selective AC (op), bf16, 8 GPUs",
    "grand-teton:1",
    8,
    16,
    8192,
    FSDP_SELECTIVE_OP,
    5762.0,
    82.4,
    f"{SOURCE}, Table 1",
)
TORCHTITAN_128 = Published(
    "torchtitan Llama 3.1 8B, FSDP, selective AC (op), bf16, 128 GPUs",
    "grand-teton:16",
    128,
    256,
    8192,
    FSDP_SELECTIVE_OP,
    5605.0,
    67.0,
    f"{SOURCE}, Table 3",
)


def _memory_cap() -> None:
    """Planning is held to ``PLAN_MEMORY`` of address space: past it, an allocation
    fails in one line instead of the kernel killing whatever it picks."""
    resource.setrlimit(resource.RLIMIT_AS, (PLAN_MEMORY, PLAN_MEMORY))


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "onnx2soap", *args]


def predicted(row: Published, model: Path, work: Path) -> tuple[float, float]:
    """(tokens a second a GPU, peak GiB a GPU) of the row's configuration, as priced."""
    plan = work / "plan.json"
    argv = _cli("plan", str(model), "--machine", row.machine, "--batch", str(row.batch))
    done = subprocess.run(
        [*argv, *row.rule, "--quiet", "-o", str(plan)],
        capture_output=True,
        text=True,
        preexec_fn=_memory_cap,
    )
    if done.returncode != 0:
        errors = [x for x in done.stderr.splitlines() if "error" in x] or ["killed"]
        raise RuntimeError(errors[-1])
    argv = _cli("simulate", str(plan), "--machine", row.machine, "--optimizer", "adam", "--json")
    doc = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    step = float(doc["step_time_s"])
    peak = max(int(v) for v in doc["peak_memory_bytes"])
    return row.batch * row.tokens / step / row.gpus, peak / GiB


@dataclass(frozen=True)
class Searched:
    """The plan ``plan`` finds on a row's machine and batch with nothing but the model."""

    tokens_per_gpu_s: float
    memory_gib: float
    fits: bool
    chosen: str  # the search's own words for it
    seconds: float  # planning's wall time


def searched(row: Published, model: Path, work: Path, budget: float) -> Searched:
    """The search's plan for the row's model, machine and batch (bf16, Adam), priced as
    the published configuration is."""
    plan = work / "searched.json"
    argv = _cli("plan", str(model), "--machine", row.machine, "--batch", str(row.batch))
    argv += ["--precision", "bf16", "--optimizer", "adam", "--budget", str(budget)]
    began = time.perf_counter()
    done = subprocess.run(
        [*argv, "-o", str(plan)], capture_output=True, text=True, preexec_fn=_memory_cap
    )
    took = time.perf_counter() - began
    if done.returncode != 0:
        errors = [x for x in done.stderr.splitlines() if "error" in x] or ["killed"]
        raise RuntimeError(errors[-1])
    chosen = [x.strip() for x in done.stdout.splitlines() if "chosen:" in x]
    words = chosen[-1].split("chosen: ", 1)[1] if chosen else "the walk's plan"
    argv = _cli("simulate", str(plan), "--machine", row.machine, "--optimizer", "adam", "--json")
    doc = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    speed = row.batch * row.tokens / float(doc["step_time_s"]) / row.gpus
    peak = max(int(v) for v in doc["peak_memory_bytes"]) / GiB
    return Searched(speed, peak, bool(doc["fits"]), words, took)


def _search_table(rows, budget: float) -> None:
    """The search's plan next to the published configuration, both as priced here."""
    print()
    print(
        "| run | published configuration, predicted tokens/s a GPU | the search's plan "
        "| predicted tokens/s a GPU | ratio | GiB a GPU | fits | planning s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row, model in rows:
        with tempfile.TemporaryDirectory() as scratch:
            try:
                speed, _ = predicted(row, model, Path(scratch))
                found = searched(row, model, Path(scratch), budget)
            except RuntimeError as e:
                print(f"| {row.name} | refused: {e} |")
                continue
        print(
            f"| {row.name} | {speed:,.0f} | {found.chosen} | {found.tokens_per_gpu_s:,.0f} "
            f"| {found.tokens_per_gpu_s / speed:.3f} | {found.memory_gib:.1f} "
            f"| {'yes' if found.fits else 'no'} | {found.seconds:.0f} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llama-8k", type=Path, required=True, help="LLaMA-3-8B at 8,192 tokens, batch 16"
    )
    parser.add_argument(
        "--llama-8k-256", type=Path, help="the same at batch 256 (Table 3's row; else left out)"
    )
    parser.add_argument(
        "--search-budget",
        type=float,
        help="also run the search (plan --budget S) on each row's machine and batch and "
        "print its plan next to the published configuration",
    )
    args = parser.parse_args(argv)
    print(
        "| run | machine | published tokens/s a GPU | predicted | predicted / published "
        "| published GiB a GPU | predicted | source |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = [(TORCHTITAN, args.llama_8k)]
    if args.llama_8k_256:
        rows.append((TORCHTITAN_128, args.llama_8k_256))
    for row, model in rows:
        with tempfile.TemporaryDirectory() as scratch:
            try:
                speed, memory = predicted(row, model, Path(scratch))
            except RuntimeError as e:
                print(
                    f"| {row.name} | {row.machine} | {row.tokens_per_gpu_s:,.0f} | refused: {e} |"
                )
                continue
        print(
            f"| {row.name} | {row.machine} | {row.tokens_per_gpu_s:,.0f} | {speed:,.0f} "
            f"| {speed / row.tokens_per_gpu_s:.2f} | {row.memory_gib:.1f} | {memory:,.1f} "
            f"| {row.source} |",
            flush=True,
        )
    if args.search_budget:
        _search_table(rows, args.search_budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
