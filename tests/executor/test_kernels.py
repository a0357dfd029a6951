"""Kernels against onnxruntime, against themselves split into tasks, and against finite
differences. Every op comes from a one-node ONNX model through the real importer, and every
buffer from ``slice_from_full`` over soap's regions, as in the executor."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.kernels import KERNELS, kernel_for
from executor.kernels.base import TaskArgs
from onnx2soap.errors import ModelError
from onnx2soap.ir import OpType, PoolAttrs, PoolKind
from onnx2soap.soap.partition import rect_shape
from tests.executor.kernel_cases import (
    CASES,
    Case,
    CaseLoader,
    backward_full,
    buffers,
    central_difference,
    config_of,
    forward_full,
    one_task,
    ort_run,
    splittable_degrees,
    task_args,
    tasks_of,
)


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> CaseLoader:
    return CaseLoader(tmp_path_factory.mktemp("kernels"))


def _data(c: Case, shape, rng: np.random.Generator, dtype=np.float64) -> np.ndarray:
    """Random data; without ties for MaxPool and away from Relu's kink, where a finite
    difference would straddle a switch."""
    if c.op_type == "MaxPool":
        size = int(np.prod(shape))
        return (rng.permutation(size).reshape(shape) / 7.0 - size / 14.0).astype(dtype)
    x = rng.standard_normal(shape)
    if c.op_type == "Relu":
        x = np.where(np.abs(x) < 0.05, 0.5, x)
    return x.astype(dtype)


def _arrays(loaded, c: Case, rng, ties: bool = False) -> list[np.ndarray]:
    graph, op = loaded.graph, loaded.graph.ops[0]
    shapes = [graph.tensors[t].shape for t in op.inputs]
    if ties:  # small integers: MaxPool windows full of equal maxima
        return [rng.integers(-2, 3, s).astype(np.float64) for s in shapes]
    return [_data(c, s, rng) for s in shapes]


def _random_config(data, graph, op):
    degrees = [
        data.draw(st.integers(1, min(3, size)), label=name) if ok else 1
        for name, size, ok in splittable_degrees(graph, op)
    ]
    return config_of(degrees)


def test_every_op_type_has_a_kernel() -> None:
    assert set(KERNELS) == set(OpType)
    assert all(kernel_for(t) is KERNELS[t] for t in OpType)


def test_unknown_op_type_is_refused_clearly() -> None:
    with pytest.raises(ModelError, match=r"no kernel for op type 'Softmax'.*Conv"):
        kernel_for("Softmax")  # type: ignore[arg-type]


@pytest.mark.parametrize("c", CASES, ids=str)
def test_forward_matches_onnxruntime(load: CaseLoader, c: Case) -> None:
    path, model = load(c)
    graph, op = model.graph, model.graph.ops[0]
    assert op.type.value == c.op_type
    x = np.random.default_rng(1).standard_normal(c.x_shape).astype(np.float32)
    values = {**model.weights, "x": x}
    arrays = [values[t] for t in op.inputs]
    got = forward_full(graph, op, one_task(op), arrays)
    (want,) = ort_run(path, {"x": x})
    assert got.dtype == np.float32
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("c", CASES, ids=str)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_split_tasks_compute_the_one_task_result(load: CaseLoader, c: Case, data) -> None:
    """Forward tiles and (halo-summed) backward gradients of any split equal the one-task
    ones: catches halo, padding and tie-break errors."""
    graph, op = load(c)[1].graph, load(c)[1].graph.ops[0]
    config = _random_config(data, graph, op)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    arrays = _arrays(load(c)[1], c, rng, ties=data.draw(st.booleans(), label="ties"))
    whole = forward_full(graph, op, one_task(op), arrays)
    split = forward_full(graph, op, config, arrays)
    np.testing.assert_allclose(split, whole, rtol=1e-12, atol=1e-12)
    grad_output = rng.standard_normal(whole.shape)
    want = backward_full(graph, op, one_task(op), arrays, grad_output)
    got = backward_full(graph, op, config, arrays, grad_output)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("c", CASES, ids=str)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_backward_matches_finite_differences(load: CaseLoader, c: Case, data) -> None:
    """On one task's buffers, padding included: d(sum(R * forward)) / d buffer."""
    graph, op = load(c)[1].graph, load(c)[1].graph.ops[0]
    tasks = tasks_of(graph, op, _random_config(data, graph, op))
    task = tasks[data.draw(st.integers(0, len(tasks) - 1), label="task")]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    bufs = buffers(task, _arrays(load(c)[1], c, rng))
    args = task_args(task)
    kernel = kernel_for(op.type)
    projection = rng.standard_normal(rect_shape(task.output))

    def scalar() -> float:
        return float((projection * kernel.forward(np, op.attrs, bufs, args)).sum())

    out = kernel.forward(np, op.attrs, bufs, args)
    grads = kernel.backward(np, op.attrs, bufs, out, projection.copy(), args)
    for buf, grad in zip(bufs, grads, strict=True):
        assert grad.shape == buf.shape and grad.dtype == buf.dtype
        picks = rng.permutation(buf.size)[:150]  # enough to hit halo, padding and body
        for flat in picks:
            index = np.unravel_index(flat, buf.shape)
            numeric = central_difference(scalar, buf, index, 1e-6)
            assert grad[index] == pytest.approx(numeric, rel=1e-6, abs=1e-6), index


def _pool_attrs(kind: PoolKind, kernel: int, stride: int) -> PoolAttrs:
    return PoolAttrs(kind, (kernel,), (stride,), (1,), (0,), (0,))


def test_maxpool_ties_go_to_the_first_maximum() -> None:
    x = np.array([[[1.0, 3.0, 3.0, 2.0, 3.0]]])
    attrs = _pool_attrs(PoolKind.MAX, 2, 1)
    args = TaskArgs(out_shape=(1, 1, 4), valid=(((0, 1), (0, 1), (0, 5)),))
    kernel = KERNELS[OpType.MAXPOOL]
    y = kernel.forward(np, attrs, [x], args)
    np.testing.assert_array_equal(y, [[[3.0, 3.0, 3.0, 3.0]]])
    (grad,) = kernel.backward(np, attrs, [x], y, np.array([[[1.0, 10.0, 100.0, 1000.0]]]), args)
    # windows (1,3) (3,3) (3,2) (2,3): the first maximum of each
    np.testing.assert_array_equal(grad, [[[0.0, 11.0, 100.0, 0.0, 1000.0]]])


def test_concat_task_with_empty_inputs() -> None:
    from onnx2soap.ir import ConcatAttrs

    parts = [np.zeros((2, 0, 3)), np.arange(12.0).reshape(2, 2, 3), np.zeros((2, 0, 3))]
    args = TaskArgs(out_shape=(2, 2, 3), valid=())
    kernel = KERNELS[OpType.CONCAT]
    y = kernel.forward(np, ConcatAttrs(axis=1), parts, args)
    np.testing.assert_array_equal(y, parts[1])
    grads = kernel.backward(np, ConcatAttrs(axis=1), parts, y, y + 1, args)
    assert [g.shape for g in grads] == [(2, 0, 3), (2, 2, 3), (2, 0, 3)]
    np.testing.assert_array_equal(grads[1], parts[1] + 1)


def test_outputs_and_gradients_do_not_alias_inputs() -> None:
    """The executor may accumulate into what a kernel returns."""
    x = np.arange(6.0).reshape(2, 3)
    args = TaskArgs(out_shape=(2, 3), valid=())
    for op_type in (OpType.IDENTITY, OpType.RELU, OpType.FLATTEN, OpType.ADD):
        kernel = KERNELS[op_type]
        inputs = [x, x] if op_type is OpType.ADD else [x]
        y = kernel.forward(np, None, inputs, args)
        g = np.ones_like(y)
        grads = kernel.backward(np, None, inputs, y, g, args)
        assert not np.shares_memory(y, x)
        for grad in grads:
            assert not np.shares_memory(grad, g) and not np.shares_memory(grad, x)
        if op_type is OpType.ADD:
            assert not np.shares_memory(grads[0], grads[1])


def test_concat_split_along_the_axis_gives_tasks_empty_inputs(load: CaseLoader) -> None:
    c = next(c for c in CASES if isinstance(c, Case) and c.id == "concat_middle")
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
    kernel = KERNELS[OpType.RELU]
    (grad,) = kernel.backward(np, None, [x], kernel.forward(np, None, [x], args), x * 0 + 5, args)
    np.testing.assert_array_equal(grad, [0.0, 0.0, 5.0])


def test_average_pool_window_with_nothing_to_count_is_zero() -> None:
    """Only an output shape onnxruntime would not produce has one (a ceil_mode window
    that starts in the end padding); it must not turn into NaN."""
    attrs = PoolAttrs(PoolKind.AVERAGE, (2,), (2,), (1,), (1,), (1,), ceil_mode=True)
    x = np.array([[[0.0, 1.0, 2.0, 3.0, 0.0, 0.0]]])  # pad, 3 data, pad, overflow
    args = TaskArgs(out_shape=(1, 1, 3), valid=(((0, 1), (0, 1), (1, 4)),))
    y = KERNELS[OpType.AVERAGEPOOL].forward(np, attrs, [x], args)
    np.testing.assert_array_equal(y, [[[1.0, 2.5, 0.0]]])
