"""Overlaps between producer tiles and consumer regions: the overlaps of each consumer
region cover its data exactly once, each lies inside both tiles, and consumers with an
empty region get none."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from onnx2soap.ir import Op
from onnx2soap.soap.partition import ParallelConfig, Task, op_tasks, overlaps, rect_shape
from tests.soap.builders import (
    Window,
    concat_op,
    conv_op,
    coverage,
    elementwise_op,
    inside,
    op_configs,
    pool_op,
    windows,
)


def check_overlaps(producers: Sequence[Task], consumers: Sequence[Task], operand: int) -> int:
    """Check the overlap properties; returns how many consumers had an empty region."""
    found = overlaps(producers, consumers, operand)
    rects: dict[int, list] = defaultdict(list)
    pairs = set()
    for ov in found:
        assert ov.operand == operand
        assert (ov.src_task, ov.dst_task) not in pairs, "one overlap per task pair"
        pairs.add((ov.src_task, ov.dst_task))
        src, dst = producers[ov.src_task], consumers[ov.dst_task]
        assert src.index == ov.src_task and dst.index == ov.dst_task
        region = dst.inputs[operand]
        assert not region.empty, "a consumer with an empty region got an overlap"
        assert inside(ov.rect, src.output), (ov.rect, src.output)
        assert inside(ov.rect, region.data), (ov.rect, region.data)
        rects[dst.index].append(ov.rect)
    empty = 0
    for c in consumers:
        region = c.inputs[operand]
        if region.empty:
            empty += 1
            assert not rects[c.index]
            continue
        count = coverage(rect_shape(region.data), rects[c.index], origin=region.data)
        assert (count == 1).all(), f"task {c.index}: data {region.data} covered {count.tolist()}"
    return empty


@st.composite
def producers(draw, batch: int, channels: int) -> tuple[Op, tuple[int, ...], list]:
    """A producer op writing a [batch, channels, L] tensor 't': elementwise or a pool;
    returns the op, the shape of 't' and the op's operand shapes."""
    if draw(st.booleans()):
        shape = (batch, channels, draw(st.integers(1, 10)))
        return elementwise_op("prod", ["s"], "t", shape), shape, [shape]
    win = draw(windows(12))
    op = pool_op("prod", "s", "t", batch, channels, [win])
    return op, (batch, channels, win.out), [(batch, channels, win.size)]


@st.composite
def consumers(draw, shape: tuple[int, ...]) -> tuple[Op, list]:
    """A consumer op reading 't' of ``shape``: a pool, a conv or an elementwise op."""
    batch, channels, length = shape
    kind = draw(st.sampled_from(["pool", "conv", "elementwise"]))
    if kind == "elementwise":
        return elementwise_op("cons", ["t", "t"], "u", shape), [shape, shape]
    win = draw(windows(size=length))
    if kind == "pool":
        return pool_op("cons", "t", "u", batch, channels, [win]), [shape]
    op = conv_op("cons", "t", "w", None, "u", batch, channels, 2, [win])
    return op, [shape, (2, channels, win.kernel)]


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_overlaps_cover_each_consumer_region_once(data: st.DataObject) -> None:
    batch, channels = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    prod, shape, prod_shapes = data.draw(producers(batch, channels))
    cons, cons_shapes = data.draw(consumers(shape))
    ptasks = op_tasks(prod, data.draw(op_configs(prod, max_degree=4)), prod_shapes)
    ctasks = op_tasks(cons, data.draw(op_configs(cons, max_degree=4)), cons_shapes)
    check_overlaps(ptasks, ctasks, 0)
    if cons.type == "Add":
        check_overlaps(ptasks, ctasks, 1)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_concat_consumers(data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 3))
    widths = data.draw(st.lists(st.integers(1, 5), min_size=2, max_size=3))
    parts = [(f"in{i}", (batch, wd)) for i, wd in enumerate(widths)]
    cat = concat_op("cat", parts, "y", 1)
    ctasks = op_tasks(cat, data.draw(op_configs(cat, max_degree=6)), [s for _, s in parts])
    for operand, (name, shape) in enumerate(parts):
        prod = elementwise_op(f"p{operand}", [f"s{operand}"], name, shape)
        ptasks = op_tasks(prod, data.draw(op_configs(prod, max_degree=4)), [shape])
        check_overlaps(ptasks, ctasks, operand)


def test_concat_tasks_off_an_input_get_no_overlaps() -> None:
    # inputs of width 2 and 4, the concat split 3 ways on the feature axis: (0,2) (2,4)
    # (4,6). Task 0 reads only input 0; tasks 1 and 2 only input 1.
    parts = [("a", (1, 2)), ("b", (1, 4))]
    cat = concat_op("cat", parts, "y", 1)
    ctasks = op_tasks(cat, ParallelConfig((1, 3), (0, 1, 2)), [(1, 2), (1, 4)])
    pa = op_tasks(
        elementwise_op("pa", ["s"], "a", (1, 2)), ParallelConfig((1, 2), (0, 1)), [(1, 2)]
    )
    pb = op_tasks(elementwise_op("pb", ["s"], "b", (1, 4)), ParallelConfig((1, 1), (0,)), [(1, 4)])
    assert check_overlaps(pa, ctasks, 0) == 2
    assert check_overlaps(pb, ctasks, 1) == 1
    assert [(o.src_task, o.dst_task, o.rect) for o in overlaps(pa, ctasks, 0)] == [
        (0, 0, ((0, 1), (0, 1))),
        (1, 0, ((0, 1), (1, 2))),
    ]
    assert [(o.src_task, o.dst_task, o.rect) for o in overlaps(pb, ctasks, 1)] == [
        (0, 1, ((0, 1), (0, 2))),
        (0, 2, ((0, 1), (2, 4))),
    ]


def test_halo_overlaps_known_case() -> None:
    # a producer of length 6 split in 2 (0..3, 3..6); a kernel-3 pad-1 pool split in 2
    # reads 0..4 and 2..6 (clipped): each consumer gets a halo column from the other tile
    win = Window(6, 3, pad_begin=1, pad_end=1)
    prod = elementwise_op("p", ["s"], "t", (1, 1, 6))
    cons = pool_op("c", "t", "u", 1, 1, [win])
    ptasks = op_tasks(prod, ParallelConfig((1, 1, 2), (0, 1)), [(1, 1, 6)])
    ctasks = op_tasks(cons, ParallelConfig((1, 1, 2, 1), (0, 1)), [(1, 1, 6)])
    got = [(o.src_task, o.dst_task, o.rect[2]) for o in overlaps(ptasks, ctasks, 0)]
    assert got == [(0, 0, (0, 3)), (1, 0, (3, 4)), (0, 1, (2, 3)), (1, 1, (3, 6))]
