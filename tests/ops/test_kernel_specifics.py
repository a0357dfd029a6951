"""Kernel behaviours a generic op test cannot see: tie-breaking, empty Concat inputs,
aliasing, subgradients, and windows with nothing to count."""

from __future__ import annotations

import numpy as np

from onnx2soap.ops import TaskArgs, definition
from onnx2soap.ops.defs.concat import ConcatAttrs
from onnx2soap.ops.defs.pool import PoolAttrs, PoolKind
from tests.ops.harness import CaseLoader, config_of, forward_full, tasks_of


def _pool_attrs(kind: PoolKind, kernel: int, stride: int) -> PoolAttrs:
    return PoolAttrs(kind, (kernel,), (stride,), (1,), (0,), (0,))


def test_maxpool_ties_go_to_the_first_maximum() -> None:
    x = np.array([[[1.0, 3.0, 3.0, 2.0, 3.0]]])
    attrs = _pool_attrs(PoolKind.MAX, 2, 1)
    args = TaskArgs(out_shape=(1, 1, 4), valid=(((0, 1), (0, 1), (0, 5)),))
    kernel = definition("MaxPool")
    y = kernel.forward(np, attrs, [x], args)
    np.testing.assert_array_equal(y, [[[3.0, 3.0, 3.0, 3.0]]])
    (grad,) = kernel.backward(np, attrs, [x], y, np.array([[[1.0, 10.0, 100.0, 1000.0]]]), args)
    # windows (1,3) (3,3) (3,2) (2,3): the first maximum of each
    np.testing.assert_array_equal(grad, [[[0.0, 11.0, 100.0, 0.0, 1000.0]]])


def test_concat_task_with_empty_inputs() -> None:
    parts = [np.zeros((2, 0, 3)), np.arange(12.0).reshape(2, 2, 3), np.zeros((2, 0, 3))]
    args = TaskArgs(out_shape=(2, 2, 3), valid=())
    kernel = definition("Concat")
    y = kernel.forward(np, ConcatAttrs(axis=1), parts, args)
    np.testing.assert_array_equal(y, parts[1])
    grads = kernel.backward(np, ConcatAttrs(axis=1), parts, y, y + 1, args)
    assert [g.shape for g in grads] == [(2, 0, 3), (2, 2, 3), (2, 0, 3)]
    np.testing.assert_array_equal(grads[1], parts[1] + 1)


def test_outputs_and_gradients_do_not_alias_inputs() -> None:
    """The executor may accumulate into what a kernel returns."""
    x = np.arange(6.0).reshape(2, 3)
    args = TaskArgs(out_shape=(2, 3), valid=())
    for op_type in ("Identity", "Relu", "Flatten", "Add"):
        kernel = definition(op_type)
        inputs = [x, x] if op_type == "Add" else [x]
        y = kernel.forward(np, None, inputs, args)
        g = np.ones_like(y)
        grads = kernel.backward(np, None, inputs, y, g, args)
        assert not np.shares_memory(y, x)
        for grad in grads:
            assert not np.shares_memory(grad, g) and not np.shares_memory(grad, x)
        if op_type == "Add":
            assert not np.shares_memory(grads[0], grads[1])


def test_concat_split_along_the_axis_gives_tasks_empty_inputs(tmp_path) -> None:
    load = CaseLoader(tmp_path)
    c = next(c for c in definition("Concat").cases if c.id == "concat_middle")
    graph = load(c)[1].graph
    op = graph.ops[0]
    config = config_of((1, 3, 1))  # axis 1 (2 + 3 + 1 wide) in chunks [0, 2) [2, 4) [4, 6)
    assert any(r.empty for t in tasks_of(graph, op, config) for r in t.inputs)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(graph.tensors[t].shape) for t in op.inputs]
    np.testing.assert_array_equal(
        forward_full(graph, op, config, arrays), np.concatenate(arrays, axis=1)
    )


def test_relu_gradient_at_zero_is_zero() -> None:
    x = np.array([-1.0, 0.0, 2.0])
    args = TaskArgs(out_shape=(3,), valid=())
    kernel = definition("Relu")
    (grad,) = kernel.backward(np, None, [x], kernel.forward(np, None, [x], args), x * 0 + 5, args)
    np.testing.assert_array_equal(grad, [0.0, 0.0, 5.0])


def test_average_pool_window_with_nothing_to_count_is_zero() -> None:
    """Only an output shape onnxruntime would not produce has one (a ceil_mode window
    that starts in the end padding); it must not turn into NaN."""
    attrs = PoolAttrs(PoolKind.AVERAGE, (2,), (2,), (1,), (1,), (1,), ceil_mode=True)
    x = np.array([[[0.0, 1.0, 2.0, 3.0, 0.0, 0.0]]])  # pad, 3 data, pad, overflow
    args = TaskArgs(out_shape=(1, 1, 3), valid=(((0, 1), (0, 1), (1, 4)),))
    y = definition("AveragePool").forward(np, attrs, [x], args)
    np.testing.assert_array_equal(y, [[[1.0, 2.5, 0.0]]])
