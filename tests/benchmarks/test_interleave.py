"""benchmarks/interleave.py: several plans measured side by side in one mpiexec.

What it rests on: the executor's ``train`` run again and again in one process is each
time the run a fresh process makes (the same losses); and the harness times, in every
round, the steps it says it times."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from benchmarks.interleave import WARM_STEPS, round_order
from executor.train import RunOptions, train
from tests.executor.mpi import MPIEXEC, make_plan

ROOT = Path(__file__).resolve().parents[2]


def test_train_again_in_one_process_is_a_fresh_run(example_onnx: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    make_plan(example_onnx, plan, 1, 8, "single-device")
    runs = [train(MPI.COMM_SELF, RunOptions(plan=plan, steps=3)) for _ in range(2)]
    first, second = ([s.loss for s in r.steps] for r in runs)
    assert first == second
    assert len(set(first)) == 3  # it trains: every step's loss differs


@pytest.mark.mpi
def test_plans_side_by_side_time_every_round(example_onnx: Path, tmp_path: Path) -> None:
    plans = [tmp_path / "dp.json", tmp_path / "random.json"]
    make_plan(example_onnx, plans[0], 2, 8, "data-parallel")
    make_plan(example_onnx, plans[1], 2, 8, "random", seed=1)
    out, rounds, steps = tmp_path / "interleaved.json", 3, 4
    command = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "benchmarks.interleave"]
    command += [*map(str, plans), "--rounds", str(rounds), "--steps", str(steps)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [*command, "--json", str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert sorted(doc) == sorted(map(str, plans))
    timed = steps - WARM_STEPS
    for result in doc.values():
        assert len(result["times"]) == rounds * timed and min(result["times"]) > 0
        assert result["round_medians"] == [
            statistics.median(result["times"][r * timed : (r + 1) * timed]) for r in range(rounds)
        ]


def test_bad_arguments_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.interleave", "p.json", "--steps", "2", "--json", "o"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert "--steps must be more than 2" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.interleave", "p.json", "--json", "no/such/o.json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert "no such folder no/such" in done.stderr


def test_each_round_has_an_order_of_its_own() -> None:
    plans = [Path(f"plan-{i}.json") for i in range(12)]
    orders = [round_order(plans, r) for r in range(8)]
    assert all(sorted(o) == sorted(plans) for o in orders)  # every plan once a round
    assert orders == [round_order(plans, r) for r in range(8)]  # the same on every rank
    assert len({tuple(o) for o in orders}) == 8
    assert len({o[0] for o in orders}) > 1 and len({o[-1] for o in orders}) > 1
    # The plan before each plan: not one and the same in every round.
    before = {p: {o[o.index(p) - 1] for o in orders if o.index(p)} for p in plans}
    assert all(len(b) > 1 for b in before.values())
