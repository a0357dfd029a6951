"""The simulator sums independent BatchNorms' statistics in one ring, as the executor does
(``soap/stats_batches.py``), and the step is shorter by the rings it no longer runs.

The model (``tests/models.py::build_branches``): two conv -> BatchNorm -> ReLU branches,
added, then conv -> BatchNorm. The importer puts the branches' BatchNorms side by side;
the same graph in torch's order (branch after branch) keeps a ring per BatchNorm.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from executor.program import ReduceStats, compile_program
from executor.trace import task_name
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.compare import rings_of
from onnx2soap.sim.presets import resolve_machine
from onnx2soap.sim.taskgraph import TaskKind
from onnx2soap.soap import Partitioner, analyze

BN1, BN2, BN3 = (f"/bn{k}/BatchNormalization" for k in (1, 2, 3))
LATENCY = 1e-3  # a ring step's: far above the tiny model's compute


@pytest.fixture(scope="module")
def graphs(export_model):
    """(the imported graph, the same graph in torch's order)."""
    graph = load_model(export_model("branches"), batch=8).graph
    ops = {op.name: op for op in graph.ops}
    torch = ["/conv1/Conv", BN1, "/Relu", "/conv2/Conv", BN2, "/Relu_1"]
    rest = [op.name for op in graph.ops if op.name not in torch]
    return graph, replace(graph, ops=tuple(ops[name] for name in (*torch, *rest)))


def _priced(graph):
    machine = replace(resolve_machine("cpu:2"), ring_step_latency=LATENCY)
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 2))
    sim = Simulator(machine, RooflineCost())
    tg = sim.task_graph(pg, names=True)
    rings = [
        tg.names[i]
        for i in range(tg.size)
        if tg.kind[i] == TaskKind.ALLREDUCE and tg.names[i].startswith("stats ")
    ]
    return pg, rings, sim.evaluate(pg).step_time_s


def test_the_imported_order_puts_independent_batchnorms_side_by_side(graphs) -> None:
    graph, _ = graphs
    names = [op.name for op in graph.ops]
    assert names[:4] == ["/conv1/Conv", "/conv2/Conv", BN1, BN2]


def test_one_ring_for_the_pair_in_each_phase_and_a_shorter_step(graphs) -> None:
    """Data parallel on 2 ranks, each statistics ring is 2(k - 1) = 2 lock-step steps of
    LATENCY, on the critical path (every op after a BatchNorm waits for its ring).
    Separate: 3 rings a phase, 12 steps; shared: 2 a phase, 8 steps: 4 LATENCY less.
    The dependent BatchNorm (after the Add) keeps its own ring."""
    graph, apart = graphs
    _, shared_rings, shared = _priced(graph)
    _, apart_rings, separate = _priced(apart)
    assert shared_rings == [
        f"stats {BN1}+{BN2} fwd",
        f"stats {BN3} fwd",
        f"stats {BN3} bwd",
        f"stats {BN2}+{BN1} bwd",
    ]
    assert apart_rings == [
        f"stats {BN1} fwd",
        f"stats {BN2} fwd",
        f"stats {BN3} fwd",
        f"stats {BN3} bwd",
        f"stats {BN2} bwd",
        f"stats {BN1} bwd",
    ]
    assert separate - shared == pytest.approx(4 * LATENCY, rel=1e-3)


def test_the_simulator_names_the_executors_rings(graphs) -> None:
    """Each rank's program has the simulator's rings, by the names its trace gives."""
    graph, _ = graphs
    pg, rings, _ = _priced(graph)
    for rank in range(2):
        program = compile_program(pg, rank).instructions
        traced = [task_name(pg, ins)[0] for ins in program if isinstance(ins, ReduceStats)]
        assert traced == rings


def test_compare_splits_the_shared_rings_by_their_traced_names(graphs) -> None:
    """``simulate --compare`` reads each traced ring's members by its name."""
    graph, _ = graphs
    pg, rings, _ = _priced(graph)
    found = rings_of(pg)
    assert {name for name, _ in found} == set(rings)
    assert set(found.values()) == {(0, 1)}
