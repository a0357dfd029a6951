"""The simulator's task graph moves exactly the bytes the executor counts sending."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx2soap.importer import load_model
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.presets import cpu
from onnx2soap.soap import Partitioner, analyze, load_plan
from tests.executor.mpi import make_plan, mpirun

pytestmark = pytest.mark.mpi
STEPS, BATCH = 2, 4


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ranks=st.integers(2, 4), seed=st.integers(0, 10_000))
def test_random_plan_bytes(example_onnx: Path, tmp_path: Path, ranks: int, seed: int) -> None:
    _check_bytes(example_onnx, tmp_path, ranks, seed)


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ranks=st.integers(2, 4), seed=st.integers(0, 10_000))
def test_random_plan_bytes_with_synchronized_statistics(
    export_model, tmp_path: Path, ranks: int, seed: int
) -> None:
    """BatchNorm in training mode: the statistics' all-reduces count too; and a tied
    embedding whose vocabulary splits: the partial sums' rings and the shared weight's
    moves count too (int64 ids at their own width)."""
    _check_bytes(export_model("bnnet"), tmp_path, ranks, seed)
    _check_bytes(export_model("tied"), tmp_path, ranks, seed)


def _check_bytes(model: Path, tmp_path: Path, ranks: int, seed: int) -> None:
    plan_path = tmp_path / f"plan-{ranks}-{seed}.json"
    make_plan(model, plan_path, ranks, BATCH, "random", seed)
    graph = load_model(model, BATCH).graph
    strategy = load_plan(plan_path).strategy(graph, analyze(graph))
    simulator = Simulator(cpu(ranks), RooflineCost(), itemsize=4)
    predicted = simulator.evaluate(Partitioner(graph).partition(strategy)).bytes_moved
    run = mpirun(plan_path, ranks, tmp_path, "--steps", str(STEPS), "--dtype", "float32")
    assert run.returncode == 0, run.stderr[-2000:]
    assert sum(run.bytes_sent) == STEPS * predicted
