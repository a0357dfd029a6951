"""Any valid plan trains on N MPI ranks exactly like one device (the executor's contract).

Random plans (``onnx2soap plan --strategy random``: mixed degrees, several tasks of an op
on one device, any devices) for 1..4 ranks under a real mpiexec; K SGD steps must give
the one-device losses and final weights within 1e-10 (float64) or 1e-5 (float32).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx2soap.importer import file_sha256, load_model
from onnx2soap.ir import DType
from onnx2soap.soap import ParallelConfig, Plan, Strategy, analyze, plan_ops, save_plan
from tests.executor.mpi import assert_same_training, make_plan, mpirun, reference

STEPS, LR = 3, 0.05
MODELS = {"mlp": 8, "cnn": 4, "spatial": 4, "bnnet": 4, "tokens": 4, "tied": 4}  # -> batch

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def references(export_model, tmp_path_factory):
    """One-device losses and weights per (model, dtype), computed once."""
    directory = tmp_path_factory.mktemp("references")
    cache = {}

    def get(name: str, dtype: DType):
        if (name, dtype) not in cache:
            model = export_model(name)
            plan = directory / f"{name}-1.json"
            make_plan(model, plan, 1, MODELS[name], "data-parallel")
            cache[(name, dtype)] = (model, reference(plan, STEPS, dtype, LR))
        return cache[(name, dtype)]

    return get


@pytest.mark.parametrize("name", sorted(MODELS))
# Three random plans a model a run, each on 2-4 ranks: one rank would only retrace the
# one-device reference, and 30 mpiexec runs a suite were more than CI's 20 minutes allow;
# hypothesis draws other plans every run.
@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ranks=st.integers(2, 4), seed=st.integers(0, 10_000))
def test_random_plans_train_like_one_device_float64(references, tmp_path: Path, name, ranks, seed):
    model, (losses, weights) = references(name, DType.FLOAT64)
    plan = tmp_path / f"{name}-{ranks}-{seed}.json"
    make_plan(model, plan, ranks, MODELS[name], "random", seed)
    run = mpirun(
        plan, ranks, tmp_path, "--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64"
    )
    assert_same_training(run, losses, weights, rtol=1e-10)


@pytest.mark.parametrize("ranks", [2, 3])
def test_random_plan_float32(references, tmp_path: Path, ranks):
    model, (losses, weights) = references("cnn", DType.FLOAT32)
    plan = tmp_path / "cnn32.json"
    make_plan(model, plan, ranks, MODELS["cnn"], "random", seed=ranks)
    run = mpirun(plan, ranks, tmp_path, "--steps", str(STEPS), "--lr", str(LR))
    assert_same_training(run, losses, weights, rtol=1e-5)


@pytest.mark.parametrize("ranks", [3, 4])
def test_spatial_splits_with_halos_train_like_one_device(references, tmp_path: Path, ranks):
    """Every windowed op split over height (and width on 4 ranks) with uneven chunks,
    each op's tiles rotated to other devices than its producer's, so every halo moves."""
    model, (losses, weights) = references("spatial", DType.FLOAT64)
    graph = load_model(model, MODELS["spatial"]).graph
    space = analyze(graph)
    configs = {}
    for k, op in enumerate(graph.ops):
        want = {"h": 2, "w": 2} if ranks == 4 else {"h": 3}
        names = {d.name for d in space[op.name] if d.splittable}
        if not {"h", "w"} <= names:
            want = {"n": 2} if "n" in names else {}
        degrees = tuple(want.get(d.name, 1) for d in space[op.name])
        tasks = math.prod(degrees)
        configs[op.name] = ParallelConfig(degrees, tuple((i + k) % ranks for i in range(tasks)))
    strategy = Strategy(ranks, configs)
    plan = tmp_path / f"spatial-{ranks}.json"
    save_plan(
        Plan(
            model,
            file_sha256(model),
            MODELS["spatial"],
            graph.loss,
            ranks,
            plan_ops(strategy, graph, space),
        ),
        plan,
    )
    run = mpirun(
        plan, ranks, tmp_path, "--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64"
    )
    assert_same_training(run, losses, weights, rtol=1e-10)
