"""The simulator's reduce-scattered partial sums against costs and bytes worked by hand.

The tiny model (x [8, 8] @ W [8, 4] -> Relu -> loss) with its Gemm split 4 ways over the
contraction: read by a Relu split by samples over the same 4 devices, each device reads
2 of the 8 rows, so the sum reduce-scatters (each member ends with its 2 rows) and the
backward all-gathers the rows' gradients; read by a whole Relu on device 0, the sum is
all-reduced as before. Round machine: a ring step is 2 us of latency (two links) plus
1 us a byte.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from onnx2soap.ir import Graph
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.delta import DeltaSimulator
from onnx2soap.sim.memory import _edge_bytes, _op_bytes, readers
from onnx2soap.soap import ParallelConfig, PartitionedGraph, Partitioner, Strategy, analyze
from onnx2soap.soap.partition import sum_groups
from tests.sim.tiny import round_machine, tiny_graph

K, ROWS, HIDDEN, ITEM = 4, 8, 4, 4
TILE = ROWS * HIDDEN * ITEM  # the summed tile: 128 bytes
STEP = 2e-6 + (TILE // K) * 1e-6  # one ring step: latency and a chunk of 32 bytes


def configs(graph: Graph, relu_split: bool) -> Strategy:
    space = analyze(graph)
    gemm, relu, loss = (op.name for op in graph.ops)
    every = tuple(range(K))

    def split(op: str, dim: str) -> ParallelConfig:
        return ParallelConfig(tuple(K if d.name == dim else 1 for d in space[op]), every)

    whole = ParallelConfig((1,) * len(space[relu]), (0,))
    sample = next(d.name for d in space[relu] if d.kind.value == "sample")
    reduction = next(d.name for d in space[gemm] if d.kind.value == "reduction")
    loss_dim = next(d.name for d in space[loss] if d.kind.value == "sample")
    return Strategy(
        K,
        {
            gemm: split(gemm, reduction),
            relu: split(relu, sample) if relu_split else whole,
            loss: split(loss, loss_dim)
            if relu_split
            else ParallelConfig((1,) * len(space[loss]), (0,)),
        },
    )


@pytest.fixture
def graph(tmp_path: Path) -> Graph:
    return tiny_graph(tmp_path, batch=ROWS, relu=True)


def rings(graph: Graph, strategy: Strategy) -> dict[str, tuple[float, int]]:
    simulator = Simulator(round_machine(K), RooflineCost())
    tg = simulator.task_graph(Partitioner(graph).partition(strategy), names=True)
    return {
        name: (float(tg.duration[i]), int(tg.nbytes[i]))
        for i, name in enumerate(tg.names)
        if name.startswith("partial sums")
    }


def test_a_sum_read_by_rows_is_reduce_scattered_and_its_gradient_all_gathered(graph) -> None:
    strategy = configs(graph, relu_split=True)
    (group,) = Partitioner(graph).partition(strategy).sums[graph.ops[0].name]
    assert group.scatter is not None and group.scatter.axis == 0
    assert [c[0] for c in group.scatter.chunks] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # k - 1 steps, each member sending (k-1)/k of the tile once: 3 x 4 x 32 bytes
    once = ((K - 1) * STEP, (K - 1) * K * (TILE // K))
    found = rings(graph, strategy)
    name = graph.ops[0].name
    assert found[f"partial sums {name} fwd"] == pytest.approx(once)
    assert found[f"partial sums {name} bwd"] == pytest.approx(once)


def test_a_sum_read_whole_is_still_all_reduced(graph) -> None:
    strategy = configs(graph, relu_split=False)
    (group,) = Partitioner(graph).partition(strategy).sums[graph.ops[0].name]
    assert group.scatter is None
    # 2(k - 1) steps: the tile's (k-1)/k twice per member
    twice = (2 * (K - 1) * STEP, 2 * (K - 1) * K * (TILE // K))
    found = rings(graph, strategy)
    name = graph.ops[0].name
    assert found[f"partial sums {name} fwd"] == pytest.approx(twice)
    assert found[f"partial sums {name} bwd"] == pytest.approx(twice)


def all_reduced(graph: Graph, pg: PartitionedGraph) -> PartitionedGraph:
    """``pg`` with every sum all-reduced, as before reduce-scatters were decided."""
    p, ops = Partitioner(graph), {op.name: op for op in graph.ops}
    sums = {n: sum_groups(ops[n], pg.tasks[n]) for n in pg.sums}
    edges = tuple(
        p.edge(
            ops[e.producer],
            pg.strategy[e.producer],
            ops[e.consumer],
            pg.strategy[e.consumer],
            e.operand,
        )
        for e in pg.edges
    )
    return replace(pg, sums=sums, edges=edges)


def held(pg: PartitionedGraph) -> list[int]:
    """Bytes each device holds for the Gemm and its edge: through the step, and its sum
    kept as the op's output (a tile like any other)."""
    graph, gemm = pg.graph, pg.graph.ops[0]
    total = [0] * K
    memory = _op_bytes(
        graph, gemm, pg.tasks[gemm.name], pg.groups[gemm.name], ITEM, sums=pg.sums[gemm.name]
    )
    count = readers(pg.edges)
    pieces = [*memory.held, *memory.kept_tiles, *memory.read_tiles]
    for e in pg.edges:
        if e.producer == gemm.name:
            ptasks, ctasks = pg.tasks[e.producer], pg.tasks[e.consumer]
            pieces += _edge_bytes(graph, e, ptasks, ctasks, ITEM, count[e.tensor] == 1).held
    for d, n in pieces:
        total[d] += n
    return total


def test_each_member_holds_its_chunk_of_the_sum_and_of_its_gradient(graph) -> None:
    """All-reduced, a member keeps the summed tile as the op's output; reduce-scattered,
    its chunk (a quarter of the tile): 96 bytes fewer per member. (Its reader reads the
    chunk in place, which needs no buffer of the reader's own: ``OpMemory.read_inputs``,
    while its forward runs; the shared gradient lives only while the backward runs.)"""
    pg = Partitioner(graph).partition(configs(graph, relu_split=True))
    before, after = held(all_reduced(graph, pg)), held(pg)
    assert [b - a for b, a in zip(before, after, strict=True)] == [TILE - TILE // K] * K
    simulator = Simulator(round_machine(K), RooflineCost())
    old = simulator.evaluate(all_reduced(graph, pg)).peak_memory_bytes
    new = Simulator(round_machine(K), RooflineCost()).evaluate(pg).peak_memory_bytes
    assert all(n < o for n, o in zip(new, old, strict=True)), (new, old)


def test_delta_follows_a_reader_that_turns_the_sum_into_a_reduce_scatter(graph) -> None:
    """A reader's change decides its producer's collective: delta simulation rebuilds the
    producer's slots and edges, and matches a full simulation both ways."""
    partitioner = Partitioner(graph)
    whole, split = configs(graph, relu_split=False), configs(graph, relu_split=True)
    delta = DeltaSimulator(Simulator(round_machine(K), RooflineCost()), partitioner)
    full = Simulator(round_machine(K), RooflineCost())
    _, state = delta.evaluate(whole)
    for strategy in (split, whole, split):
        got, state = delta.evaluate(strategy, state)
        assert got == full.evaluate(partitioner.partition(strategy))
