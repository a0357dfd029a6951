"""The importer's order puts independent ops with statistics side by side
(``importer/stats_order.py``), so that their statistics share a ring
(``soap/stats_batches.py``), and keeps dependent ones where they were."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from onnx2soap.importer.stats_order import side_by_side
from onnx2soap.soap.stats_batches import stats_runs


@dataclass(frozen=True)
class Nest:
    sync_dims: tuple[int, ...] = ()
    partial_dims: tuple[int, ...] = ()


@dataclass(frozen=True)
class FakeOp:
    """What the order reads of an op: its name (= its output), inputs and nest."""

    name: str
    inputs: tuple[str, ...]
    nest: Nest

    @property
    def output(self) -> str:
        return self.name


@dataclass(frozen=True)
class FakeGraph:
    ops: tuple[FakeOp, ...]


def ops_of(edges: str) -> list[FakeOp]:
    """``"c1<x b1<c1 ..."``: each op and what it reads; names starting with ``b`` have
    statistics (BatchNorm)."""
    ops = []
    for spec in edges.split():
        name, _, inputs = spec.partition("<")
        nest = Nest((0,)) if name.startswith("b") else Nest()
        ops.append(FakeOp(name, tuple(filter(None, inputs.split(","))), nest))
    return ops


def names(ops) -> str:
    return " ".join(op.name for op in ops)


def test_a_resnet_blocks_downsample_batchnorm_joins_the_last_main_one() -> None:
    block = ops_of("c1<x b1<c1 r1<b1 c2<r1 b2<c2 r2<b2 c3<r2 b3<c3 cd<x bd<cd add<b3,bd")
    order = side_by_side(block)
    assert names(order) == "c1 b1 r1 c2 b2 r2 c3 cd b3 bd add"
    assert [tuple(order[i].name for i in run) for run in stats_runs(FakeGraph(tuple(order)))] == [
        ("b1",),
        ("b2",),
        ("b3", "bd"),
    ]


def test_inception_branches_one_after_another_come_side_by_side() -> None:
    branches = ops_of("c1<x b1<c1 r1<b1 c2<x b2<c2 r2<b2 c3<x b3<c3 r3<b3 cat<r1,r2,r3")
    order = side_by_side(branches)
    assert names(order) == "c1 c2 c3 b1 b2 b3 r1 r2 r3 cat"
    assert stats_runs(FakeGraph(tuple(order))) == ((3, 4, 5),)


def test_dependent_batchnorms_stay_apart() -> None:
    chain = ops_of("c1<x b1<c1 c2<b1 b2<c2 r<b2")
    assert side_by_side(chain) == chain
    assert stats_runs(FakeGraph(tuple(chain))) == ((1,), (3,))
    # side by side but one reads the other: two runs
    direct = ops_of("c1<x b1<c1 b2<b1")
    assert stats_runs(FakeGraph(tuple(direct))) == ((1,), (2,))


@st.composite
def dags(draw) -> list[FakeOp]:
    n = draw(st.integers(1, 14))
    ops = []
    for k in range(n):
        earlier = [op.name for op in ops]
        reads = draw(st.lists(st.sampled_from(earlier), max_size=2, unique=True)) if k else []
        stats = draw(st.booleans())
        name = f"{'b' if stats else 'o'}{k}"
        ops.append(FakeOp(name, tuple(reads) or ("x",), Nest((0,)) if stats else Nest()))
    return ops


@given(dags())
def test_the_order_is_a_topological_permutation_and_runs_are_independent(ops) -> None:
    order = side_by_side(ops)
    assert sorted(op.name for op in order) == sorted(op.name for op in ops)
    seen = {"x"}
    for op in order:
        assert set(op.inputs) <= seen
        seen.add(op.output)
    below: dict[str, set[str]] = {}  # every op's ancestors
    for op in ops:
        below[op.name] = {a for t in op.inputs if t != "x" for a in (t, *below[t])}
    for run in stats_runs(FakeGraph(tuple(order))):
        members = [order[i].name for i in run]
        assert run == tuple(range(run[0], run[0] + len(run)))
        assert all(a not in below[b] for a in members for b in members)
