"""Independent BatchNorms side by side sum their statistics in one ring, in the forward
and in the backward (``soap/stats_batches.py``), and N ranks still train as one device.

The model (``tests/models.py::build_branches``): two conv -> BatchNorm -> ReLU branches
from one input, torch writing them one after the other, added, then a conv -> BatchNorm
that depends on both. Data parallel on 2 ranks, the branches' BatchNorms share one ring
a phase and the last keeps its own: 2 rings a phase where there were 3.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from executor.program import Phase, ReduceStats, compile_program
from executor.trace import task_name
from onnx2soap.importer import file_sha256, load_model
from onnx2soap.ir import DType
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import (
    ParallelConfig,
    Partitioner,
    Plan,
    analyze,
    load_plan,
    plan_ops,
    save_plan,
)
from onnx2soap.soap.zero import ZeroStage
from tests.executor.mpi import assert_same_training, make_plan, mpirun, reference
from tests.executor.pipeline_plans import pipeline_plan
from tests.executor.test_recompute import with_recompute

STEPS, LR, BATCH, RANKS = 3, 0.05, 4, 2
BRANCHES = ("/bn1/BatchNormalization", "/bn2/BatchNormalization")
LAST = "/bn3/BatchNormalization"


@pytest.fixture(scope="module")
def plans(export_model, tmp_path_factory):
    """(model, one-device plan, data-parallel plan on 2 ranks)."""
    folder = tmp_path_factory.mktemp("branches")
    model = export_model("branches")
    one, two = folder / "one.json", folder / "two.json"
    make_plan(model, one, 1, BATCH, "data-parallel")
    make_plan(model, two, RANKS, BATCH, "data-parallel")
    return model, one, two


def _partitioned(model: Path, plan: Path):
    graph = load_model(model, BATCH).graph
    return Partitioner(graph).partition(load_plan(plan).strategy(graph, analyze(graph)))


def _rings(pg, rank: int) -> list[tuple[Phase, tuple[str, ...], tuple[int, ...]]]:
    """The rank's statistics all-reduces: (phase, the ops they sum, their devices)."""
    ops = pg.graph.ops
    return [
        (ins.phase, tuple(ops[i].name for i, _ in ins.members), ins.devices)
        for ins in compile_program(pg, rank).instructions
        if isinstance(ins, ReduceStats)
    ]


def test_independent_batchnorms_share_one_ring_a_phase(plans) -> None:
    model, _, two = plans
    pg = _partitioned(model, two)
    for rank in range(RANKS):
        assert _rings(pg, rank) == [
            (Phase.FORWARD, BRANCHES, (0, 1)),
            (Phase.FORWARD, (LAST,), (0, 1)),
            (Phase.BACKWARD, (LAST,), (0, 1)),
            (Phase.BACKWARD, BRANCHES[::-1], (0, 1)),
        ]
    names = [
        task_name(pg, ins)[0]
        for ins in compile_program(pg, 0).instructions
        if isinstance(ins, ReduceStats)
    ]
    assert names[0] == f"stats {BRANCHES[0]}+{BRANCHES[1]} fwd"
    assert names[-1] == f"stats {BRANCHES[1]}+{BRANCHES[0]} bwd"


def test_one_device_sums_nothing_and_keeps_a_ring_an_op(plans) -> None:
    """On one device a ring adds nothing: each op keeps its own (the calibration's
    per-op names, ``sim/calibration_plan.py``)."""
    model, one, _ = plans
    pg = _partitioned(model, one)
    assert [len(ops) for _, ops, _ in _rings(pg, 0)] == [1] * 6


@pytest.mark.mpi
def test_shared_rings_train_like_one_device(plans, tmp_path: Path) -> None:
    """2 ranks over a real mpiexec, float64: the one-device run's losses and weights
    (its statistics summed per op, on one device, by no ring), running statistics
    included; the trace shows the shared rings by their simulated names."""
    _, one, two = plans
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    trace = tmp_path / "trace.json"
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--trace", str(trace))
    run = mpirun(two, RANKS, tmp_path, *args)
    assert_same_training(run, losses, weights, rtol=1e-10)
    events = json.loads(trace.read_text())["traceEvents"]
    stats = {e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("stats ")}
    assert stats == {
        f"stats {BRANCHES[0]}+{BRANCHES[1]} fwd",
        f"stats {BRANCHES[1]}+{BRANCHES[0]} bwd",
        f"stats {LAST} fwd",
        f"stats {LAST} bwd",
    }


# Mixed plans on 3 ranks, the rest data parallel. "shared": bn1 split over n and c (two
# groups over ranks 0, 1), bn2 over n and h (one group over 0, 1, two tasks a rank): one
# ring of three groups a phase. "apart": bn2 over ranks 1, 2: a ring each.
MIXED = {
    "shared": (
        ParallelConfig((2, 2, 1, 1), (0, 1, 1, 0)),
        ParallelConfig((2, 1, 2, 1), (0, 0, 1, 1)),
        [((0, 0), (0, 1), (1, 0))],
    ),
    "apart": (
        ParallelConfig((2, 1, 1, 1), (0, 1)),
        ParallelConfig((2, 1, 1, 1), (1, 2)),
        [((0, 0),), ((1, 0),)],
    ),
}


def _mixed_plan(model: Path, path: Path, case: str):
    graph = load_model(model, BATCH).graph
    space = analyze(graph)
    bn1, bn2, rings = MIXED[case]
    strategy = data_parallel(graph, space, 3).replace(BRANCHES[0], bn1).replace(BRANCHES[1], bn2)
    ops = plan_ops(strategy, graph, space)
    save_plan(Plan(model, file_sha256(model), BATCH, graph.loss, 3, ops), path)
    return Partitioner(graph).partition(strategy), rings


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(MIXED))
def test_mixed_plans_share_rings_where_devices_match(plans, tmp_path: Path, case: str) -> None:
    """Groups of the branches' BatchNorms on the same devices share a ring (several of
    one op too), groups on other devices keep their own; 3 ranks train as one device."""
    model, one, _ = plans
    plan = tmp_path / f"{case}.json"
    pg, rings = _mixed_plan(model, plan, case)
    index = {op.name: i for i, op in enumerate(pg.graph.ops)}
    b1, b2 = index[BRANCHES[0]], index[BRANCHES[1]]
    forward = [tuple((b1 if k == 0 else b2, g) for k, g in ring) for ring in rings]
    found = set()
    for rank in range(3):
        program = compile_program(pg, rank).instructions
        found |= {
            ins.members
            for ins in program
            if isinstance(ins, ReduceStats)
            and ins.phase is Phase.FORWARD
            and ins.members[0][0] in (b1, b2)
        }
    assert found == set(forward)
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")
    assert_same_training(mpirun(plan, 3, tmp_path, *args), losses, weights, rtol=1e-10)


@pytest.mark.mpi
@pytest.mark.parametrize(("stages", "ranks"), [(1, 2), (2, 4)])
def test_microbatches_share_rings_and_train_like_one_device(
    export_model, tmp_path: Path, stages: int, ranks: int
) -> None:
    """2 microbatches (each with its own statistics, as torch accumulating gradients),
    each stage data parallel over 2 ranks; 2 stages: the branches' BatchNorms are in the
    first. Every microbatch's shared ring, and the one-device run of the same
    microbatches' losses and weights."""
    model = export_model("branches")
    batch, microbatches = 8, 2
    one = pipeline_plan(model, tmp_path / "one.json", batch, 1, microbatches)
    plan = pipeline_plan(model, tmp_path / "plan.json", batch, stages, microbatches, width=2)
    graph = load_model(model, batch // microbatches).graph
    doc = load_plan(plan)
    pg = Partitioner(graph).partition(doc.strategy(graph, analyze(graph)))
    shared = [
        (ins.phase, ins.microbatch)
        for ins in compile_program(pg, 0, pipeline=doc.pipeline).instructions
        if isinstance(ins, ReduceStats) and len(ins.members) == 2
    ]
    assert sorted(shared, key=str) == sorted(
        ((p, m) for p in Phase for m in range(microbatches)), key=str
    )
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")
    assert_same_training(mpirun(plan, ranks, tmp_path, *args), losses, weights, rtol=1e-10)


@pytest.mark.mpi
def test_recomputed_batchnorms_share_rings_and_train_like_one_device(plans, tmp_path: Path) -> None:
    """Every op recomputed: a BatchNorm's forward runs again in its backward's partial
    half, with the statistics its forward's shared ring summed."""
    _, one, two = plans
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    recomputed = with_recompute(two, tmp_path / "recomputed.json")
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")
    assert_same_training(mpirun(recomputed, RANKS, tmp_path, *args), losses, weights, rtol=1e-10)


@pytest.mark.mpi
def test_zero3_gathers_a_runs_weights_and_trains_like_one_device(plans, tmp_path: Path) -> None:
    """ZeRO-3: the BatchNorms' scales and biases sharded over the 2 ranks, every
    member's gathered before the run's partial halves."""
    _, one, two = plans
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    sharded = tmp_path / "zero3.json"
    save_plan(replace(load_plan(two), zero_stage=ZeroStage.PARAMETERS), sharded)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")
    assert_same_training(mpirun(sharded, RANKS, tmp_path, *args), losses, weights, rtol=1e-10)
