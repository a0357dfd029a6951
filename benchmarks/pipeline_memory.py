"""Peak memory of GPipe and 1F1B: each rank's peak RSS and step time, measured.

A GPT-2-shaped decoder (``gpt_onnx.py``: weights on a sparse file, so the weights are
small next to a long sequence's activations) cut into two pipeline stages (equal op
counts, one rank each), trained by the executor under mpiexec with each schedule. Under
GPipe a stage holds every microbatch's activations before its first backward; under 1F1B
stage ``s`` of ``S`` holds at most ``S - s`` (``soap.pipeline.held_at_most``), so the
first stage's peak is the lower one. Each rank's peak is Linux's ``VmHWM`` from the
executor's summary (``--json``); the step time is the summary's mean after the first.

    python benchmarks/pipeline_memory.py [--tokens 512] [--microbatches 8] ...
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import subprocess
import tempfile
from dataclasses import dataclass

from benchmarks.gpt_onnx import GptShape, write_gpt
from onnx2soap.soap.pipeline import Schedule, held_at_most
from tests.executor.mpi import MPIEXEC
from tests.executor.pipeline_driver import pipeline_plan

STAGES = 2


@dataclass(frozen=True)
class Row:
    schedule: Schedule
    rank: int
    held: int  # microbatches' activations the stage holds at most
    peak_mb: float
    step_ms: float


def run_schedule(model: Path, folder: Path, schedule: Schedule, args) -> list[Row]:
    plan = pipeline_plan(
        model,
        folder / f"{schedule.value}.json",
        args.batch,
        STAGES,
        args.microbatches,
        schedule,
    )
    command = [str(MPIEXEC), "-n", str(STAGES), sys.executable, "-m", "executor", "run"]
    options = ["--steps", str(args.steps), "--json", "--device", "cpu", "--lr", "0.001"]
    done = subprocess.run(
        [*command, str(plan), *options], capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        raise SystemExit(f"{schedule.value}: the run failed:\n{done.stderr[-2000:]}")
    summary = next(
        json.loads(line)["summary"] for line in done.stdout.splitlines() if '"summary"' in line
    )
    step_ms = summary["mean_step_time_s"] * 1e3
    return [
        Row(
            schedule,
            rank,
            held_at_most(schedule, rank, STAGES, args.microbatches),
            b / 2**20,
            step_ms,
        )
        for rank, b in enumerate(summary["peak_rss_bytes"])
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocabulary", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    shape = GptShape(args.layers, args.width, args.heads, args.vocabulary, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = write_gpt(folder, shape)
        rows = [row for s in Schedule for row in run_schedule(model, folder, s, args)]
    print(
        f"GPT ({args.layers} layers, width {args.width}, {args.tokens} tokens, vocabulary "
        f"{args.vocabulary}), batch {args.batch} in {args.microbatches} microbatches, "
        f"{STAGES} stages of one rank, float32, CPU"
    )
    print("| schedule | rank (stage) | microbatches held | peak RSS MB | step ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.schedule.value} | {r.rank} | {r.held} | {r.peak_mb:.0f} | {r.step_ms:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
