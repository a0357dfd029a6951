"""The memory model against measured peaks, rank by rank, and the fit of its two constants.

    python -m benchmarks.memory_fit                      # lstm_lm, gpt2, cnn; resnet18 held out
    python -m benchmarks.memory_fit --fit cnn --check resnet18
    python -m benchmarks.memory_fit --ranks 4            # 4 ranks (they share 2 cores here)

Per model (the fidelity benchmark's exports and batches) seven plans on ``--ranks`` ranks
(2 unless told): data parallel, model parallel, expert and four random seeds. Each runs 3
steps under mpiexec with ``--trace``, which measures every rank's peak in a steady step
(tracemalloc, numpy's allocations and the runtime's Python objects). The model's peak
is linear in ``memory.PER_INSTRUCTION`` and ``memory.PER_PIECE`` (bytes per instruction
of a rank's program and per piece a task assembles), so three evaluations per plan give
it for any pair. The pair that minimises the squared relative error over the working
ranks of the ``--fit`` models is printed, then every model's mean and worst error with
it and with the constants in the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass

import numpy as np

from benchmarks.fidelity import BATCH, BIN, export, onnx2soap

PLANS = ("data-parallel", "model-parallel", "expert", *(f"random-{s}" for s in (1, 2, 3, 4)))


@dataclass(frozen=True)
class Rank:
    """One working rank: the model's peak at zero constants, what one byte of each adds,
    and the measured peak."""

    model: str
    plan: str
    rank: int
    base: int
    per_instruction: int
    per_piece: int
    measured: int

    def predicted(self, instruction: float, piece: float) -> float:
        return self.base + instruction * self.per_instruction + piece * self.per_piece


def _predicted(plan: Path, instruction: int, piece: int) -> tuple[int, ...]:
    from onnx2soap.importer import load_model
    from onnx2soap.sim import RooflineCost, Simulator, memory
    from onnx2soap.sim.presets import cpu
    from onnx2soap.soap import Partitioner, analyze, import_loss, load_plan

    loaded = load_plan(plan)
    graph = load_model(loaded.model_path, loaded.batch, import_loss(loaded)).graph
    pg = Partitioner(graph).partition(loaded.strategy(graph, analyze(graph)))
    code = memory.PER_INSTRUCTION, memory.PER_PIECE
    memory.PER_INSTRUCTION, memory.PER_PIECE = instruction, piece  # read at each call
    try:
        return Simulator(cpu(loaded.devices), RooflineCost()).evaluate(pg).peak_memory_bytes
    finally:
        memory.PER_INSTRUCTION, memory.PER_PIECE = code


def _measured(plan: Path, ranks: int, folder: Path) -> tuple[int, ...]:
    trace = folder / "trace.json"
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", OMP_NUM_THREADS="1")
    command = [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, "-m", "executor", "run"]
    command += [str(plan), "--steps", "3", "--trace", str(trace)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"{plan}: the executor failed:\n{done.stderr[-2000:]}")
    return tuple(json.loads(trace.read_text())["otherData"]["peak_memory_bytes"])


def ranks_of(name: str, ranks: int, folder: Path) -> list[Rank]:
    model, rows = export(name, folder), []
    for label in PLANS:
        strategy = ["--strategy", "random", "--seed", label[-1]] if "random" in label else [
            "--strategy", label
        ]  # fmt: skip
        plan = folder / f"{name}-{label}.json"
        common = ["--batch", BATCH[name], "--machine", f"cpu:{ranks}", "--costs", "roofline"]
        onnx2soap("plan", model, *common, "--quiet", *strategy, "-o", plan)
        measured = _measured(plan, ranks, folder)
        base, one_instruction, one_piece = (
            _predicted(plan, *pair) for pair in ((0, 0), (1, 0), (0, 1))
        )
        working = sorted({d for op in json.loads(plan.read_text())["ops"] for d in op["devices"]})
        for d in working:
            rows.append(
                Rank(name, label, d, base[d], one_instruction[d] - base[d],
                     one_piece[d] - base[d], measured[d])
            )  # fmt: skip
    return rows


def fit(rows: list[Rank]) -> tuple[float, float]:
    """Least squares of the relative error."""
    a = np.array([[r.per_instruction / r.measured, r.per_piece / r.measured] for r in rows])
    b = np.array([(r.measured - r.base) / r.measured for r in rows])
    (instruction, piece), *_ = np.linalg.lstsq(a, b, rcond=None)
    return float(instruction), float(piece)


def report(rows: list[Rank], models: list[str], instruction: float, piece: float) -> None:
    for name in models:
        errors = [
            (r.predicted(instruction, piece) - r.measured) / r.measured
            for r in rows
            if r.model == name
        ]
        worst = max(errors, key=abs)
        print(
            f"| {name} | {len(errors)} | {np.mean(np.abs(errors)) * 100:.1f} % | "
            f"{worst * 100:+.1f} % |"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fit", default="lstm_lm,gpt2,cnn", help="models the constants fit")
    p.add_argument("--check", default="resnet18", help="models checked, not fitted")
    p.add_argument("--ranks", type=int, default=2, help="ranks per plan (default 2)")
    args = p.parse_args(argv)
    from onnx2soap.sim import memory

    fitted, checked = args.fit.split(","), [m for m in args.check.split(",") if m]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for name in fitted + checked for r in ranks_of(name, args.ranks, Path(tmp))]
    for r in rows:
        print(
            f"  {r.model:9} {r.plan:15} rank {r.rank}: predicted "
            f"{r.predicted(memory.PER_INSTRUCTION, memory.PER_PIECE) / 1e6:.3f} MB, "
            f"measured {r.measured / 1e6:.3f} MB"
        )
    instruction, piece = fit([r for r in rows if r.model in fitted])
    code = (memory.PER_INSTRUCTION, memory.PER_PIECE)
    for label, pair in (
        (f"fitted to {', '.join(fitted)}: {instruction:.0f} and {piece:.0f}", (instruction, piece)),
        (f"in the code: {code[0]} and {code[1]}", code),
    ):
        print(f"\nPER_INSTRUCTION and PER_PIECE (bytes) {label}\n")
        print("| model | working ranks | mean error | worst |\n|---|---|---|---|")
        report(rows, fitted + checked, *pair)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
