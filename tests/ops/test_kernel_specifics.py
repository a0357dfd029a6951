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


def _unary(op_type: str, x: np.ndarray):
    """(forward, backward of ones) of a one-input op without attributes, one task."""
    args = TaskArgs(out_shape=x.shape, valid=())
    kernel = definition(op_type)
    y = kernel.forward(np, None, [x], args)
    (grad,) = kernel.backward(np, None, [x], y, np.ones_like(y), args)
    return y, grad


def test_rounding_on_its_jumps_and_zero_gradients() -> None:
    """Round takes halves to the even neighbour (the spec's and numpy's rint), Floor and
    Ceil are exact on integers and negatives; their gradients are zero, as torch's."""
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.0, -2.0, -0.2, 0.7])
    rounded, grad = _unary("Round", x)
    np.testing.assert_array_equal(rounded, [0, 2, 2, -0.0, -2, -2, 2, -2, -0.0, 1])
    assert np.signbit(rounded[3]) and np.signbit(rounded[8])
    np.testing.assert_array_equal(grad, np.zeros_like(x))
    floor, grad = _unary("Floor", x)
    np.testing.assert_array_equal(floor, [0, 1, 2, -1, -2, -3, 2, -2, -1, 0])
    np.testing.assert_array_equal(grad, np.zeros_like(x))
    ceil, _ = _unary("Ceil", x)
    np.testing.assert_array_equal(ceil, [1, 2, 3, -0.0, -1, -2, 2, -2, -0.0, 1])


def test_cumsum_directions_and_exclusive() -> None:
    """The spec's examples: [1, 2, 3] scanned four ways; the gradient is the opposite
    scan (exact on integers), and ids keep their dtype and take none."""
    from onnx2soap.ops.defs.cumsum import CumSumAttrs

    x = np.array([[1.0, 2.0, 3.0]])
    args = TaskArgs(out_shape=x.shape, valid=())
    kernel = definition("CumSum")
    want = {
        (False, False): [1, 3, 6],
        (True, False): [0, 1, 3],
        (False, True): [6, 5, 3],
        (True, True): [5, 3, 0],
    }
    g = np.array([[1.0, 10.0, 100.0]])
    grads = {(False, False): [111, 110, 100], (True, False): [110, 100, 0]}
    grads |= {(False, True): [1, 11, 111], (True, True): [0, 1, 11]}
    for (exclusive, reverse), values in want.items():
        attrs = CumSumAttrs(axis=1, exclusive=exclusive, reverse=reverse)
        y = kernel.forward(np, attrs, [x], args)
        np.testing.assert_array_equal(y, [values])
        (grad,) = kernel.backward(np, attrs, [x], y, g, args)
        np.testing.assert_array_equal(grad, [grads[exclusive, reverse]])
    ids = np.array([[1, 1, 0, 1]])
    attrs = CumSumAttrs(axis=1, exclusive=False, reverse=False)
    y = kernel.forward(np, attrs, [ids], TaskArgs(out_shape=ids.shape, valid=()))
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, [[1, 2, 2, 3]])
    assert kernel.backward(np, attrs, [ids], y, y, args) == (None,)


def _reduce(op_type: str, x: np.ndarray, axes: tuple[int, ...]):
    """(forward, backward of ones) of a keepdims reduction over ``axes``, one task."""
    from onnx2soap.ops.defs.reductions import ReduceKind, ReductionAttrs

    kind = {"ReduceProd": ReduceKind.PROD, "ReduceL2": ReduceKind.L2}
    kind |= {"ReduceL1": ReduceKind.L1, "ReduceLogSumExp": ReduceKind.LOG_SUM_EXP}
    attrs = ReductionAttrs(kind[op_type], axes)
    out = tuple(1 if a in axes else s for a, s in enumerate(x.shape))
    args = TaskArgs(out_shape=out, valid=())
    kernel = definition(op_type)
    y = kernel.forward(np, attrs, [x], args)
    (grad,) = kernel.backward(np, attrs, [x], y, np.ones_like(y), args)
    return y, grad


def test_reduce_prod_gradient_with_zeros_is_the_product_of_the_others() -> None:
    x = np.array([[2.0, 0.0, 3.0, 4.0], [0.0, 5.0, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    y, grad = _reduce("ReduceProd", x, (1,))
    np.testing.assert_array_equal(y, [[0.0], [0.0], [24.0]])
    np.testing.assert_array_equal(grad, [[0, 24, 0, 0], [0, 0, 0, 0], [24, 12, 8, 6]])


def test_norm_subgradients_at_zero_are_torch_s() -> None:
    """ReduceL2 of an all-zero block: gradient 0, not NaN (torch masks it); ReduceL1's
    is sign(x), 0 at 0."""
    x = np.array([[0.0, 0.0], [3.0, -4.0]])
    y, grad = _reduce("ReduceL2", x, (1,))
    np.testing.assert_array_equal(y, [[0.0], [5.0]])
    np.testing.assert_allclose(grad, [[0.0, 0.0], [0.6, -0.8]])
    _, grad = _reduce("ReduceL1", x, (1,))
    np.testing.assert_array_equal(grad, [[0.0, 0.0], [1.0, -1.0]])


def test_reduce_log_sum_exp_does_not_overflow() -> None:
    x = np.array([[1000.0, 1000.0], [-1000.0, -np.inf], [-np.inf, -np.inf]])
    with np.errstate(divide="ignore", invalid="ignore"):  # the all -inf block: log(0)
        y, grad = _reduce("ReduceLogSumExp", x, (1,))
    np.testing.assert_allclose(y, [[1000.0 + np.log(2.0)], [-1000.0], [-np.inf]])
    np.testing.assert_allclose(grad[:2], [[0.5, 0.5], [1.0, 0.0]])
