"""Operand regions of window ops against brute force: the buffer spans exactly the input
indices the task's windows touch, ``data`` is that span clipped to the tensor, ``valid``
locates ``data`` inside the buffer, and padding (or ceil_mode overflow) lies only outside
``data``."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from onnx2soap.soap.partition import (
    Interval,
    ParallelConfig,
    Region,
    Task,
    input_region,
    op_tasks,
)
from tests.soap.builders import (
    Window,
    concat_op,
    conv_op,
    conv_shapes,
    op_configs,
    pool_op,
    windows,
)

BATCH, CHANNELS = 2, 3


def expected_axis(win: Window, outs: Interval) -> tuple[Interval, Interval, list[int]]:
    """(buffer, data, touched) of one spatial axis for the output range ``outs``."""
    touched = win.touched(range(*outs))
    buffer = (min(touched), max(touched) + 1)
    lo = min(max(buffer[0], 0), win.size)
    data = (lo, max(lo, min(buffer[1], win.size)))
    return buffer, data, touched


def check_valid(region: Region, *, empty_too: bool = False) -> None:
    """``valid`` is ``data`` in buffer-local coordinates and lies inside the buffer.

    Regions with empty data are only held to the last rule with ``empty_too`` (see
    test_empty_data_is_located_inside_the_buffer)."""
    for (blo, bhi), (dlo, dhi), (vlo, vhi) in zip(
        region.buffer, region.data, region.valid, strict=True
    ):
        assert (vlo, vhi) == (dlo - blo, dhi - blo)
        assert vhi - vlo == dhi - dlo
        if region.empty and not empty_too:
            continue
        assert 0 <= vlo <= vhi <= bhi - blo, (
            f"valid {(vlo, vhi)} is outside a buffer of extent {bhi - blo} "
            f"(buffer {(blo, bhi)}, data {(dlo, dhi)})"
        )


def check_window_task(task: Task, wins: list[Window]) -> None:
    """Spatial axis ``2 + i`` of operand 0 is read by window ``i`` over output dim ``2 + i``."""
    region = task.inputs[0]
    for axis, win in enumerate(wins, start=2):
        buffer, data, touched = expected_axis(win, task.box[axis])
        assert region.buffer[axis] == buffer
        assert region.data[axis] == data
        lo, hi = region.data[axis]
        for i in touched:
            # every touched index inside the tensor is in data; padding and ceil_mode
            # overflow (indices outside the tensor) only outside it
            assert (lo <= i < hi) == (0 <= i < win.size), (i, region.data[axis])
    check_valid(region)


@st.composite
def pool_cases(draw) -> tuple[list[Window], ParallelConfig]:
    wins = draw(st.lists(windows(), min_size=1, max_size=2))
    op = pool_op("p", "x", "y", BATCH, CHANNELS, wins)
    return wins, draw(op_configs(op, max_degree=5))


def pool_tasks(wins: list[Window], config: ParallelConfig, pad: float = float("-inf")):
    op = pool_op("p", "x", "y", BATCH, CHANNELS, wins, pad_value=pad)
    return op_tasks(op, config, [(BATCH, CHANNELS, *(w.size for w in wins))])


@settings(max_examples=500, deadline=None)
@given(pool_cases())
@example(([Window(7, 2, stride=4)], ParallelConfig((1, 1, 2, 1), (0, 1))))  # stride > kernel
@example(([Window(9, 3, dilation=3, pad_begin=2, pad_end=1)], ParallelConfig((2, 1, 1, 1), (0, 1))))
@example(([Window(5, 2, stride=2, ceil_mode=True)], ParallelConfig((1, 1, 3, 1), (0, 1, 2))))
@example(
    (
        [Window(6, 3, 2, 1, 0, 2), Window(4, 2, 3, 2, 1, 0)],
        ParallelConfig((1, 1, 2, 1, 1, 1), (0, 1)),
    )
)
def test_pool_regions_match_brute_force(case: tuple[list[Window], ParallelConfig]) -> None:
    wins, config = case
    for task in pool_tasks(wins, config):
        region = task.inputs[0]
        assert region.pad_value == float("-inf")
        # n and c are read one-to-one
        assert region.buffer[:2] == region.data[:2] == task.box[:2]
        check_window_task(task, wins)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_conv_regions_match_brute_force(data: st.DataObject) -> None:
    wins = data.draw(st.lists(windows(9), min_size=1, max_size=2))
    c_in, c_out = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    op = conv_op("c", "x", "w", "b", "y", BATCH, c_in, c_out, wins)
    config = data.draw(op_configs(op, max_degree=4))
    s = conv_shapes(BATCH, c_in, c_out, wins)
    r = len(wins)
    ci = 2 + r
    for task in op_tasks(op, config, [s["x"], s["weight"], s["bias"]]):
        x, w, b = task.inputs
        assert x.pad_value == 0.0
        assert x.buffer[:2] == x.data[:2] == (task.box[0], task.box[ci])
        check_window_task(task, wins)
        # the weight and bias are read one-to-one, no padding: buffer == data
        assert w.pad_value is None and b.pad_value is None
        assert w.buffer == w.data == (task.box[1], task.box[ci], *task.box[ci + 1 :])
        assert b.buffer == b.data == (task.box[1],)
        check_valid(w)


@pytest.mark.parametrize(
    ("win", "outs", "buffer", "data"),
    [
        # stride 3 > kernel 2: outputs 1..2 read {3, 4, 6, 7}
        (Window(8, 2, stride=3), (1, 3), (3, 8), (3, 8)),
        # dilation 2, pads 2/1: output 0 reads {-2, 0, 2}
        (Window(6, 3, dilation=2, pad_begin=2, pad_end=1), (0, 1), (-2, 3), (0, 3)),
        # asymmetric pads: last output of 6 reads {4, 5, 6}; 6 is pad_end
        (Window(6, 3, pad_begin=1, pad_end=2), (5, 6), (4, 7), (4, 6)),
        # ceil_mode: size 5, kernel 2, stride 2 -> 3 outputs; the last reads {4, 5}
        (Window(5, 2, stride=2, ceil_mode=True), (2, 3), (4, 6), (4, 5)),
        # ceil_mode with pads 1/1: 3 outputs (a 4th would start in pad_end); last {3, 4}
        (Window(5, 2, 2, 1, 1, 1, ceil_mode=True), (2, 3), (3, 5), (3, 5)),
    ],
)
def test_known_window_regions(win: Window, outs: Interval, buffer: Interval, data: Interval):
    op = pool_op("p", "x", "y", BATCH, CHANNELS, [win])
    box = ((0, BATCH), (0, CHANNELS), outs, (0, win.kernel))
    region = input_region(op.nest, 0, box, (BATCH, CHANNELS, win.size))
    assert region.buffer == ((0, BATCH), (0, CHANNELS), buffer)
    assert region.data == ((0, BATCH), (0, CHANNELS), data)
    assert region.valid[2] == (data[0] - buffer[0], data[1] - buffer[0])


def test_ceil_mode_output_sizes() -> None:
    # the ONNX/PyTorch formula, including the "last window starts inside" rule
    assert Window(5, 2, stride=2).out == 2
    assert Window(5, 2, stride=2, ceil_mode=True).out == 3
    assert Window(4, 2, stride=2, pad_begin=1, pad_end=1, ceil_mode=True).out == 3
    assert Window(6, 3, stride=2, pad_begin=1, pad_end=1, ceil_mode=True).out == 4
    assert Window(5, 2, stride=2, pad_begin=1, pad_end=1, ceil_mode=True).out == 3
    assert Window(5, 2, stride=2, pad_begin=1, pad_end=1).out == 3


def _all_padding_tasks() -> tuple[Region, Region]:
    """kernel 1, pads 2/2, size 3: 7 outputs; output 0 reads only index -2, output 6 only
    index 4: the first and last tasks (one output each) have no data."""
    win = Window(3, 1, pad_begin=2, pad_end=2)
    assert win.out == 7
    tasks = pool_tasks([win], ParallelConfig((1, 1, 7, 1), tuple(range(7))))
    first, last = tasks[0].inputs[0], tasks[-1].inputs[0]
    assert first.buffer[2] == (-2, -1) and first.empty
    assert last.buffer[2] == (4, 5) and last.empty
    return first, last


def test_empty_data_keeps_the_tensor_boundary_in_buffer_coordinates() -> None:
    # What the code does (and executor/kernels/pool.py's count_include_pad relies on):
    # valid is data - buffer.lo even when data is empty, i.e. where the tensor's edge lies
    # relative to the buffer, which can be outside the buffer.
    first, last = _all_padding_tasks()
    assert first.data[2] == (0, 0) and first.valid[2] == (2, 2)
    assert last.data[2] == (3, 3) and last.valid[2] == (-1, -1)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_concat_regions(data: st.DataObject) -> None:
    widths = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    parts = [(f"in{i}", (BATCH, wd)) for i, wd in enumerate(widths)]
    op = concat_op("cat", parts, "y", 1)
    config = data.draw(op_configs(op, max_degree=6))
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    for task in op_tasks(op, config, [s for _, s in parts]):
        lo, hi = task.box[1]
        for region, off, wd in zip(task.inputs, offsets, widths, strict=True):
            assert region.pad_value is None
            assert region.buffer == region.data
            a, b = max(lo, off), min(hi, off + wd)
            if a >= b:
                assert region.empty
                assert region.data[1][0] == region.data[1][1]
            else:
                assert not region.empty
                assert region.data == (task.box[0], (a - off, b - off))
            check_valid(region)
