"""Strategies measured on this host's CPU ranks: each rank's peak RSS next to the
simulator's peak, and the step next to its prediction, for data parallelism, ZeRO-1/2,
GPipe and 1F1B pipelines, each with and without full recomputation, Megatron and the
searched plan (the measured side of ``benchmarks/strategies.py``'s predicted table).

A GPT-2-shaped decoder (``gpt_onnx.py``: weights on a sparse file) planned by ``plan``
for ``cpu:2`` (two ranks; a pipeline is two stages of one rank) with Adam, whose state
ZeRO shards, then trained by the executor under mpiexec. Under GPipe a stage holds every
microbatch's activations before its first backward; under 1F1B stage ``s`` of ``S``
holds at most ``S - s`` (``soap.pipeline.held_at_most``); recomputation (``--recompute
all``) keeps each layer's output as a checkpoint and remakes the layer's inside during
that layer's backward. Each rank's peak is Linux's ``VmHWM`` from the
executor's summary (``--json``), printed as it is and less an idle executor's (rank 1 of
a single-device plan on two ranks: the interpreter, libraries, graph and plan), which is
what the memory model counts; the step time is the summary's mean after the first, next
to the simulator's (``cpu:2`` preset, roofline costs: its order, not its scale, is the
point on a host it was not profiled on).

    python benchmarks/strategies_measured.py [--tokens 256] [--microbatches 8] ...
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import datetime
import json
import platform
import subprocess
import tempfile
from dataclasses import dataclass

from benchmarks.gpt_onnx import GptShape, write_gpt
from onnx2soap.cli.machine_cmd import find_mpiexec
from onnx2soap.soap.pipeline import Schedule, held_at_most

STAGES = 2
MB = 2**20


@dataclass(frozen=True)
class Case:
    """A plan made by ``plan`` with ``rule`` (its options), trained as it is."""

    label: str
    rule: tuple[str, ...]
    schedule: Schedule | None = None  # a pipeline's, for the microbatches it holds


def cases(microbatches: int) -> list[Case]:
    def piped(schedule: Schedule, recompute: str) -> Case:
        rule = ("--strategy", "pipeline", "--stages", str(STAGES))
        rule += ("--microbatches", str(microbatches), "--schedule", schedule.value)
        label = schedule.value + (" + recompute" if recompute == "all" else "")
        return Case(label, (*rule, "--recompute", recompute), schedule)

    return [
        Case("data parallel", ("--strategy", "data-parallel")),
        Case("data parallel + recompute", ("--strategy", "data-parallel", "--recompute", "all")),
        Case("ZeRO-1", ("--strategy", "zero", "--zero-stage", "1")),
        Case("ZeRO-2", ("--strategy", "zero", "--zero-stage", "2")),
        *(piped(s, r) for s in Schedule for r in ("none", "all")),
        Case("Megatron", ("--strategy", "megatron")),
        Case("searched", ("--max-evals", "300", "--seed", "0")),
    ]


IDLE = Case("single device", ("--strategy", "single-device"))


@dataclass(frozen=True)
class Row:
    case: Case
    rank: int
    held: int  # microbatches' activations the stage holds at most
    predicted_mb: float
    peak_mb: float
    step_ms: float
    predicted_step_ms: float


def _plan(model: Path, folder: Path, case: Case, args) -> tuple[Path, dict]:
    plan = folder / f"{case.label.replace(' ', '_')}.json"
    command = [sys.executable, "-m", "onnx2soap", "plan", str(model), "--batch", str(args.batch)]
    command += ["--machine", f"cpu:{STAGES}", "--optimizer", "adam", *case.rule]
    done = subprocess.run(
        [*command, "--quiet", "-o", str(plan)], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise SystemExit(f"{case.label}: planning failed:\n{done.stderr[-2000:]}")
    return plan, json.loads(plan.read_text())["predicted"]


def _run(plan: Path, steps: int) -> dict:
    command = [str(find_mpiexec()), "-n", str(STAGES), sys.executable, "-m", "executor", "run"]
    options = ["--steps", str(steps), "--json", "--device", "cpu", "--lr", "0.001"]
    options += ["--optimizer", "adam"]
    done = subprocess.run(
        [*command, str(plan), *options], capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        raise SystemExit(f"{plan.stem}: the run failed:\n{done.stderr[-2000:]}")
    return next(
        json.loads(line)["summary"] for line in done.stdout.splitlines() if '"summary"' in line
    )


def run_case(model: Path, folder: Path, case: Case, args) -> list[Row]:
    plan, predicted = _plan(model, folder, case, args)
    summary = _run(plan, args.steps)
    rows = []
    for rank, peak in enumerate(summary["peak_rss_bytes"]):
        held = 1
        if case.schedule is not None:
            held = held_at_most(case.schedule, rank, STAGES, args.microbatches)
        rows.append(
            Row(
                case,
                rank,
                held,
                predicted["peak_memory_bytes"][rank] / MB,
                peak / MB,
                summary["mean_step_time_s"] * 1e3,
                predicted["step_time_s"] * 1e3,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocabulary", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    shape = GptShape(args.layers, args.width, args.heads, args.vocabulary, args.tokens)
    began = datetime.datetime.now(datetime.UTC)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = write_gpt(folder, shape)
        idle = run_case(model, folder, IDLE, args)[1].peak_mb
        rows = [
            row for case in cases(args.microbatches) for row in run_case(model, folder, case, args)
        ]
    print(
        f"{began:%Y-%m-%d %H:%MZ}, {platform.node()}: GPT ({args.layers} layers, width "
        f"{args.width}, {args.tokens} tokens, vocabulary {args.vocabulary}), batch "
        f"{args.batch} (pipelines: {args.microbatches} microbatches, {STAGES} stages of one "
        f"rank), Adam, float32, {STAGES} CPU ranks; an idle executor's peak RSS {idle:.0f} MB"
    )
    print(
        "| plan | rank | microbatches held | simulated peak MB | measured peak "
        "RSS MB | measured less idle MB | step ms (simulated) |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.case.label} | {r.rank} | {r.held} | {r.predicted_mb:.0f} | {r.peak_mb:.0f} "
            f"| {r.peak_mb - idle:.0f} | {r.step_ms:.0f} ({r.predicted_step_ms:.0f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
