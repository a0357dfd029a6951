"""Balanced chunks and task boxes: chunks are numpy.array_split's pieces, and the tasks of
any config tile the op's output exactly once."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx2soap.ir import Op
from onnx2soap.soap.partition import (
    ParallelConfig,
    chunk,
    op_tasks,
    output_rect,
    rect_volume,
    task_box,
    task_coords,
)
from tests.soap.builders import (
    Window,
    concat_op,
    conv_op,
    conv_shapes,
    coverage,
    elementwise_op,
    gemm_op,
    op_configs,
    pool_op,
    windows,
)


@given(st.integers(0, 60), st.integers(1, 70))
def test_chunks_are_array_split_pieces(size: int, degree: int) -> None:
    pieces = np.array_split(np.arange(size), degree)
    bounds = [chunk(size, degree, i) for i in range(degree)]
    assert bounds[0][0] == 0
    assert bounds[-1][1] == size
    for (lo, hi), piece in zip(bounds, pieces, strict=True):
        assert hi - lo == len(piece)
        assert list(range(lo, hi)) == piece.tolist()
    for (_, hi), (lo, _) in pairwise(bounds):
        assert hi == lo  # contiguous, in order


def test_chunk_known_values() -> None:
    assert [chunk(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [chunk(5, 5, i) for i in range(5)] == [(i, i + 1) for i in range(5)]
    assert [chunk(7, 2, i) for i in range(2)] == [(0, 4), (4, 7)]


def test_task_coords_are_row_major() -> None:
    assert list(task_coords((2, 1, 3))) == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 0, 2),
        (1, 0, 0),
        (1, 0, 1),
        (1, 0, 2),
    ]


# --- ops to split ---------------------------------------------------------------------------


@st.composite
def ops_with_shapes(draw) -> tuple[Op, list[tuple[int, ...]], tuple[int, ...]]:
    """A random op of one of the families, its operand shapes and its output shape."""
    kind = draw(st.sampled_from(["elementwise", "gemm", "pool", "conv", "concat"]))
    n = draw(st.integers(1, 6))
    c = draw(st.integers(1, 5))
    if kind == "elementwise":
        shape = (n, c, draw(st.integers(1, 7)))
        return elementwise_op("e", ["a", "b"], "o", shape), [shape, shape], shape
    if kind == "gemm":
        ci, co = draw(st.integers(1, 5)), draw(st.integers(1, 6))
        op = gemm_op("g", "x", "w", "b", "o", n, ci, co)
        return op, [(n, ci), (ci, co), (co,)], (n, co)
    if kind == "pool":
        wins = draw(st.lists(windows(8), min_size=1, max_size=2))
        op = pool_op("p", "x", "o", n, c, wins)
        return op, [(n, c, *(w.size for w in wins))], (n, c, *(w.out for w in wins))
    if kind == "conv":
        wins = [draw(windows(8))]
        co = draw(st.integers(1, 4))
        s = conv_shapes(n, c, co, wins)
        op = conv_op("cv", "x", "w", "b", "o", n, c, co, wins)
        return op, [s["x"], s["weight"], s["bias"]], s["out"]
    widths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    parts = [(f"in{i}", (n, wd)) for i, wd in enumerate(widths)]
    op = concat_op("cat", parts, "o", 1)
    return op, [s for _, s in parts], (n, sum(widths))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_tasks_tile_the_output_exactly_once(data: st.DataObject) -> None:
    op, shapes, out_shape = data.draw(ops_with_shapes())
    config: ParallelConfig = data.draw(op_configs(op, max_degree=4))
    tasks = op_tasks(op, config, shapes)

    assert len(tasks) == config.tasks
    assert (coverage(out_shape, [t.output for t in tasks]) == 1).all()
    assert sum(rect_volume(t.output) for t in tasks) == int(np.prod(out_shape))
    # the boxes also tile the whole iteration space: total points are conserved
    assert sum(t.points for t in tasks) == op.nest.points


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_task_index_device_and_box_follow_the_degree_grid(data: st.DataObject) -> None:
    op, shapes, _ = data.draw(ops_with_shapes())
    config: ParallelConfig = data.draw(op_configs(op, max_degree=4))
    tasks = op_tasks(op, config, shapes)
    for index, task in enumerate(tasks):
        coord = np.unravel_index(index, config.degrees) if config.degrees else ()
        expected_box = tuple(
            chunk(dim.size, deg, int(c))
            for dim, deg, c in zip(op.nest.dims, config.degrees, coord, strict=True)
        )
        assert task.index == index
        assert task.op == op.name
        assert task.device == config.devices[index]
        assert task.box == expected_box == task_box(op.nest, config.degrees, coord)
        assert task.output == output_rect(op.nest, task.box)
        assert len(task.inputs) == len(shapes)


def test_size_one_output_axes_are_whole() -> None:
    # a GlobalAveragePool-like nest: output [n, c, 1] for input [n, c, l]
    import onnx2soap.ir as ir

    nest = ir.LoopNest(
        (ir.IterDim("n", 4), ir.IterDim("c", 3), ir.IterDim("l", 5)),
        (ir.Operand("x", tuple(ir.identity(i) for i in range(3))),),
        (0, 1, None),
    )
    box = ((1, 2), (0, 3), (2, 4))
    assert output_rect(nest, box) == ((1, 2), (0, 3), (0, 1))


def test_known_conv_tasks() -> None:
    win = Window(size=6, kernel=3, stride=1, pad_begin=1, pad_end=1)
    op = conv_op("c", "x", "w", None, "y", 2, 3, 4, [win])
    s = conv_shapes(2, 3, 4, [win])
    # degrees: n=2, co=2, l=3, ci=1, kl=1
    config = ParallelConfig((2, 2, 3, 1, 1), tuple(range(12)))
    tasks = op_tasks(op, config, [s["x"], s["weight"]])
    last = tasks[-1]
    assert last.box == ((1, 2), (2, 4), (4, 6), (0, 3), (0, 3))
    assert last.output == ((1, 2), (2, 4), (4, 6))
    # outputs 4..5 read inputs 3..6 (index 6 is the pad_end column)
    assert last.inputs[0].buffer == ((1, 2), (0, 3), (3, 7))
    assert last.inputs[0].data == ((1, 2), (0, 3), (3, 6))
    assert last.inputs[1].data == ((2, 4), (0, 3), (0, 3))
