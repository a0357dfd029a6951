"""The whole-graph Partitioner equals the un-memoized partition functions, lists edges in
consumer order, and reuses its memoized results for configs it has seen."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from onnx2soap.ir import Graph, TensorRole
from onnx2soap.soap.dims import analyze
from onnx2soap.soap.partition import ParallelConfig, op_tasks, overlaps, replica_groups
from onnx2soap.soap.partitioned import Partitioner
from onnx2soap.soap.strategy import Strategy, validate
from tests.soap.builders import configs, shapes_of, small_cnn

GRAPH = small_cnn()
SPACE = analyze(GRAPH)
DEVICES = 4


@st.composite
def strategies(draw, graph: Graph = GRAPH, devices: int = DEVICES) -> Strategy:
    result = {}
    for op in graph.ops:
        dims = SPACE[op.name]
        result[op.name] = draw(
            configs([d.size for d in dims], [d.splittable for d in dims], devices, 3)
        )
    return Strategy(devices, result)


def expected_edges(graph: Graph) -> list[tuple[str, str, str, int]]:
    """(tensor, producer, consumer, operand), consumers in graph order, then operands."""
    out = []
    for op in graph.ops:
        for operand, t in enumerate(op.inputs):
            producer = graph.producer(t)
            if producer is not None:
                out.append((t, producer.name, op.name, operand))
    return out


def test_expected_edges_of_the_test_graph() -> None:
    assert expected_edges(GRAPH) == [
        ("y", "conv", "concat", 0),
        ("p", "pool", "concat", 1),
        ("cat", "concat", "relu", 0),
        ("r", "relu", "flatten", 0),
        ("f", "flatten", "gemm", 0),
        ("logits", "gemm", "loss_op", 0),
    ]


@settings(max_examples=60, deadline=None)
@given(strategies())
def test_partition_equals_the_unmemoized_functions(strategy: Strategy) -> None:
    validate(GRAPH, SPACE, strategy)
    pg = Partitioner(GRAPH).partition(strategy)
    assert pg.graph is GRAPH and pg.strategy == strategy
    assert list(pg.tasks) == [op.name for op in GRAPH.ops]
    fresh = {}
    for op in GRAPH.ops:
        fresh[op.name] = op_tasks(op, strategy[op.name], shapes_of(GRAPH, op))
        assert pg.tasks[op.name] == fresh[op.name]
        weights = [i for i, t in enumerate(op.inputs) if GRAPH.tensors[t].role is TensorRole.WEIGHT]
        assert pg.groups[op.name] == replica_groups(op, fresh[op.name], weights)
    assert [(e.tensor, e.producer, e.consumer, e.operand) for e in pg.edges] == (
        expected_edges(GRAPH)
    )
    for e in pg.edges:
        assert e.overlaps == overlaps(fresh[e.producer], fresh[e.consumer], e.operand)
    moves = [(e.tensor, o, p.index, c.index) for e, o, p, c in pg.moves()]
    assert moves == [(e.tensor, o, o.src_task, o.dst_task) for e in pg.edges for o in e.overlaps]


@settings(max_examples=25, deadline=None)
@given(strategies(), st.data())
def test_memoized_results_are_reused(strategy: Strategy, data: st.DataObject) -> None:
    partitioner = Partitioner(GRAPH)
    first = partitioner.partition(strategy)
    again = partitioner.partition(Strategy(strategy.devices, dict(strategy.configs)))
    for op in GRAPH.ops:
        assert again.tasks[op.name] is first.tasks[op.name]
        assert again.groups[op.name] is first.groups[op.name]
    for a, b in zip(first.edges, again.edges, strict=True):
        assert a.overlaps is b.overlaps

    # change one op: everything not touching it is reused, the rest is recomputed
    changed = data.draw(st.sampled_from([op.name for op in GRAPH.ops]))
    dims = SPACE[changed]
    config: ParallelConfig = data.draw(
        configs([d.size for d in dims], [d.splittable for d in dims], DEVICES, 3)
    )
    moved = strategy.replace(changed, config)
    after = partitioner.partition(moved)
    reference = Partitioner(GRAPH).partition(moved)
    assert after.tasks == reference.tasks
    assert after.groups == reference.groups
    assert after.edges == reference.edges
    for op in GRAPH.ops:
        if op.name != changed:
            assert after.tasks[op.name] is first.tasks[op.name]
    for a, b in zip(first.edges, after.edges, strict=True):
        if changed not in (a.producer, a.consumer):
            assert b.overlaps is a.overlaps


def test_known_partition() -> None:
    # data parallel in 2 everywhere (loss included), relu also split on its channels
    ones = {op.name: (1,) * len(SPACE[op.name]) for op in GRAPH.ops}
    degrees = {name: (2, *d[1:]) for name, d in ones.items()}
    degrees["relu"] = (2, 2, 1)
    strategy = Strategy(
        2,
        {
            name: ParallelConfig(deg, (0, 1) if name != "relu" else (0, 0, 1, 1))
            for name, deg in degrees.items()
        },
    )
    validate(GRAPH, SPACE, strategy)
    pg = Partitioner(GRAPH).partition(strategy)
    (into_relu,) = [e for e in pg.edges if e.consumer == "relu"]
    # concat task k (batch half k, all 7 channels) feeds relu tasks 2k and 2k+1
    assert [(o.src_task, o.dst_task, o.rect) for o in into_relu.overlaps] == [
        (0, 0, ((0, 2), (0, 4), (0, 10))),
        (0, 1, ((0, 2), (4, 7), (0, 10))),
        (1, 2, ((2, 4), (0, 4), (0, 10))),
        (1, 3, ((2, 4), (4, 7), (0, 10))),
    ]
    (w_group,) = (g for g in pg.groups["conv"] if g.weight == "W")
    assert w_group.tasks == (0, 1) and w_group.devices == (0, 1)
    assert pg.tasks["loss_op"][1].inputs[1].data == ((2, 4),)
