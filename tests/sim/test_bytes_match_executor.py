"""The simulator's task graph moves exactly the bytes the executor counts sending."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx2soap.importer import load_model
from onnx2soap.precision import Precision
from onnx2soap.sim import RooflineCost, make_simulator
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


@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ranks=st.integers(2, 4), seed=st.integers(0, 10_000))
def test_random_plan_bytes_in_bf16(example_onnx: Path, tmp_path: Path, ranks, seed) -> None:
    """Mixed precision: activations and their gradients go as 2-byte pieces, partial
    sums and weight gradients' rings in float32."""
    _check_bytes(example_onnx, tmp_path, ranks, seed, Precision.BF16)


def _check_bytes(
    model: Path, tmp_path: Path, ranks: int, seed: int, precision: Precision = Precision.FP32
) -> None:
    plan_path = tmp_path / f"plan-{ranks}-{seed}.json"
    make_plan(model, plan_path, ranks, BATCH, "random", seed)
    graph = load_model(model, BATCH).graph
    strategy = load_plan(plan_path).strategy(graph, analyze(graph))
    simulator = make_simulator(cpu(ranks), RooflineCost(), precision=precision)
    predicted = simulator.evaluate(Partitioner(graph).partition(strategy)).bytes_moved
    argv = ("--steps", str(STEPS), "--dtype", "float32", "--precision", precision.value)
    run = mpirun(plan_path, ranks, tmp_path, *argv)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sum(run.bytes_sent) == STEPS * predicted
