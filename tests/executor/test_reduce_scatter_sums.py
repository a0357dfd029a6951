"""Partial sums whose readers each need a disjoint part of the tile are reduce-scattered
(soap/sum_scatter.py): N ranks still train exactly as one device (float64, SGD and Adam,
3 steps), the simulator predicts the bytes the run sends, and its memory the run's peak.

Plans are built by hand on the MLP (fc1 columns, fc2 rows, fc3 rows): readers split by
samples (the chunks are row blocks: runs of the tile), by features (the ring works on the
tile with that axis first), a group with two tasks on one device and a reader off the
group (it gets its rows from the chunk's holder); and GPT-2's Megatron plan, whose
residual adds are split by samples over each node's devices.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi4py import MPI

from executor.kinds import DeviceKind
from executor.optim import OptimizerConfig, OptimizerKind
from executor.train import RunOptions, train
from onnx2soap.importer import load_model
from onnx2soap.ir import DType, Graph
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.memory import OPTIMIZER_SLOTS
from onnx2soap.sim.presets import cpu
from onnx2soap.soap import Partitioner, Strategy, analyze, load_plan
from tests.executor.mpi import assert_same_training, make_plan, mpirun
from tests.executor.test_reduction_splits import MEMORY_TOLERANCE, config, save
from tests.optional import cupy_or_skip

pytestmark = pytest.mark.mpi
STEPS, LR, BATCH = 3, 0.05, 512


def one_device(model: Path, batch: int, tmp_path: Path, adam: bool):
    plan = tmp_path / "one.json"
    make_plan(model, plan, 1, batch, "data-parallel")
    optimizer = OptimizerConfig(OptimizerKind.ADAM) if adam else OptimizerConfig()
    options = RunOptions(
        plan=plan,
        steps=STEPS,
        lr=LR,
        dtype=DType.FLOAT64,
        device=DeviceKind.CPU,
        optimizer=optimizer,
    )
    result = train(MPI.COMM_SELF, options, gather=True)
    return tuple(r.loss for r in result.steps), result.weights


def args(adam: bool, *extra: str) -> tuple[str, ...]:
    base = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")
    return (*base, *(("--optimizer", "adam") if adam else ()), *extra)


def mlp(graph: Graph, reader: str, ranks: int = 2) -> Strategy:
    """fc1 by columns, fc2 and fc3 by rows over ``ranks`` devices; relu2 (fc2's reader)
    split by ``reader`` ('n' samples, 'f' features), the loss (fc3's) by samples."""
    fc1, relu1, fc2, relu2, fc3, loss = (op.name for op in graph.ops)
    every = tuple(range(ranks))
    return Strategy(
        ranks,
        {
            fc1: config(graph, fc1, every, co=ranks),
            relu1: config(graph, relu1, every, f=ranks),
            fc2: config(graph, fc2, every, ci=ranks),
            relu2: config(graph, relu2, every, **{reader: ranks}),
            fc3: config(graph, fc3, every, ci=ranks),
            loss: config(graph, loss, every, n=ranks),
        },
    )


def uneven(graph: Graph) -> Strategy:
    """fc2 in 3 row tasks, two on device 0: its group is over devices 0 and 1; relu2 by
    samples over 3 devices, device 2's rows read from device 1's chunk."""
    strategy = mlp(graph, "n", 3)
    fc2 = graph.ops[2].name
    configs = dict(strategy.configs)
    configs[fc2] = config(graph, fc2, (0, 0, 1), ci=3)
    return Strategy(3, configs)


def scatters(graph: Graph, strategy: Strategy) -> dict[str, list[int | None]]:
    pg = Partitioner(graph).partition(strategy)
    return {
        op.name: [None if g.scatter is None else g.scatter.axis for g in pg.sums[op.name]]
        for op in graph.ops
        if pg.sums[op.name]
    }


def predicted(graph: Graph, strategy: Strategy, ranks: int, adam: bool = False):
    slots = OPTIMIZER_SLOTS["adam" if adam else "sgd"]
    simulator = Simulator(cpu(ranks), RooflineCost(), itemsize=8, optimizer_slots=slots)
    return simulator.evaluate(Partitioner(graph).partition(strategy))


@pytest.mark.parametrize(
    ("reader", "adam", "axes"),
    [("n", False, [0, 0]), ("f", True, [1, 0])],
)
def test_mlp_reduce_scatter_trains_like_one_device(
    export_model, tmp_path: Path, reader: str, adam: bool, axes: list[int]
) -> None:
    model = export_model("mlp")
    graph = load_model(model, BATCH).graph
    strategy = mlp(graph, reader)
    assert [a for found in scatters(graph, strategy).values() for a in found] == axes
    plan = save(graph, model, BATCH, strategy, tmp_path / "p.json")
    trace = tmp_path / "trace.json"
    run = mpirun(plan, 2, tmp_path, *args(adam, "--trace", str(trace)))
    assert_same_training(run, *one_device(model, BATCH, tmp_path, adam), rtol=1e-10)
    evaluation = predicted(graph, strategy, 2, adam)
    assert sum(run.bytes_sent) == STEPS * evaluation.bytes_moved
    measured = json.loads(trace.read_text())["otherData"]["peak_memory_bytes"]
    for rank, (p, m) in enumerate(zip(evaluation.peak_memory_bytes, measured, strict=True)):
        assert abs(p - m) <= MEMORY_TOLERANCE * m, f"rank {rank}: predicted {p}, measured {m}"


def test_group_with_two_tasks_on_a_device_and_a_reader_off_it(export_model, tmp_path: Path) -> None:
    model = export_model("mlp")
    graph = load_model(model, BATCH).graph
    strategy = uneven(graph)
    pg = Partitioner(graph).partition(strategy)
    (group,) = pg.sums[graph.ops[2].name]
    assert group.devices == (0, 1) and group.scatter is not None
    # relu2's rows [0, 171) on device 0, [171, 342) on 1, [342, 512) on 2 (off the group)
    assert [c[0] for c in group.scatter.chunks] == [(0, 171), (171, 512)]
    fc2 = graph.ops[2].name
    moves = [(p.device, c.device) for e, _, p, c in pg.moves() if e.producer == fc2]
    assert sorted(moves) == [(0, 0), (1, 1), (1, 2)]
    plan = save(graph, model, BATCH, strategy, tmp_path / "p.json")
    run = mpirun(plan, 3, tmp_path, *args(False))
    assert_same_training(run, *one_device(model, BATCH, tmp_path, False), rtol=1e-10)
    assert sum(run.bytes_sent) == STEPS * predicted(graph, strategy, 3).bytes_moved


def test_megatron_gpt2_reduce_scatters_and_trains_like_one_device_with_adam(
    tmp_path: Path,
) -> None:
    """4 ranks: tensor parallel over pairs, data parallel over the pairs; the residual
    adds by samples over all four, so each pair's row-parallel sums reduce-scatter."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.sequence_models import export_sequence

    (tmp_path / "gpt2").mkdir()
    model = export_sequence("gpt2", tmp_path / "gpt2", "dynamo")
    batch = 4
    plan = tmp_path / "megatron.json"
    make_plan(model, plan, 4, batch, "megatron")
    graph = load_model(model, batch).graph
    strategy = load_plan(plan).strategy(graph, analyze(graph))
    axes = [a for found in scatters(graph, strategy).values() for a in found]
    assert axes.count(0) >= 4, axes  # the rows' sums (2 layers x 2 linears), by samples
    run = mpirun(plan, 4, tmp_path, *args(True))
    assert_same_training(run, *one_device(model, batch, tmp_path, True), rtol=1e-10)
    assert sum(run.bytes_sent) == STEPS * predicted(graph, strategy, 4).bytes_moved


@pytest.mark.gpu
@pytest.mark.parametrize(("reader", "transport"), [("n", "nccl"), ("f", "mpi-host")])
def test_reduce_scatter_on_gpus_trains_like_one_device(
    export_model, tmp_path: Path, reader: str, transport: str
) -> None:
    """NCCL (one ncclReduce and one ncclBroadcast per chunk) and host staging: the same
    sums and gathers over device arrays, 2 ranks with a GPU each or sharing one."""
    cp = cupy_or_skip()
    if transport == "nccl" and cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs (NCCL takes one per rank)")
    model = export_model("mlp")
    graph = load_model(model, BATCH).graph
    strategy = mlp(graph, reader)
    assert all(axis is not None for found in scatters(graph, strategy).values() for axis in found)
    plan = save(graph, model, BATCH, strategy, tmp_path / "p.json")
    run = mpirun(plan, 2, tmp_path, *args(True, "--device", "cuda", "--transport", transport))
    assert_same_training(run, *one_device(model, BATCH, tmp_path, True), rtol=1e-10)
