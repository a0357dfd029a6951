"""The registry-driven op test: for every op definition and every one of its cases, the
forward equals onnxruntime's, any split computes what one task does (forward tiles and
halo-summed gradients), and the backward equals central differences. An op without cases
fails here."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.data import id_bound
from onnx2soap.ir import TensorRole
from onnx2soap.ops import definition, registry
from onnx2soap.ops.base import InputKind
from onnx2soap.soap.partition import rect_shape
from tests.ops.harness import (
    CaseLoader,
    all_task_args,
    backward_full,
    buffers,
    central_difference,
    config_of,
    forward_full,
    loss_scale_of,
    one_task,
    op_of,
    operand_arrays,
    ort_run,
    sample,
    splittable_degrees,
    task_args,
    tasks_of,
)

DEFINITIONS = tuple(registry().by_name.values())
CASES = tuple(c for d in DEFINITIONS for c in d.cases)


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> CaseLoader:
    return CaseLoader(tmp_path_factory.mktemp("ops"))


@pytest.mark.parametrize("d", DEFINITIONS, ids=lambda d: d.name)
def test_every_op_has_cases_of_its_own_type(d) -> None:
    assert d.cases, f"op {d.name} has no test cases"
    assert all(c.op_type == d.name for c in d.cases)


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


def _random_config(data, graph, op):
    degrees = [
        data.draw(st.integers(1, min(3, size)), label=name) if ok else 1
        for name, size, ok in splittable_degrees(graph, op)
    ]
    return config_of(degrees)


ORT_CASES = [c for c in CASES if definition(c.op_type).onnx and c.deterministic]


def test_random_cases_are_few() -> None:
    """Only random ops may opt out of the onnxruntime reference."""
    random = {c.op_type for c in CASES if not c.deterministic}
    assert random <= {"Dropout", "RandomUniformLike"}, random


@pytest.mark.parametrize("c", ORT_CASES, ids=str)
def test_forward_matches_onnxruntime(load: CaseLoader, c) -> None:
    path, model = load(c)
    graph, op = model.graph, op_of(model)
    assert op.type == c.op_type
    rng = np.random.default_rng(1)
    feeds = {}
    for i in c.inputs:
        if i.kind is InputKind.DATA and i.dtype == "bool":
            feeds["x"] = rng.standard_normal(i.shape) > 0  # onnxruntime's bool, our 0/1 ids
        elif i.kind is InputKind.DATA and i.dtype == "int64":
            feeds["x"] = rng.integers(0, id_bound(graph, "x"), i.shape)
        elif i.kind is InputKind.DATA:
            feeds["x"] = sample(c, i.shape, rng, np.float32)
    arrays = operand_arrays(c, model, rng, dtype=np.float32)
    ours = {k: v.astype(np.int64) if v.dtype == np.bool_ else v for k, v in feeds.items()}
    values = {**model.weights, **model.state, **model.constants, **ours}
    if graph.labels in op.inputs:
        feeds["labels"] = values[graph.labels] = arrays[op.inputs.index(graph.labels)]
    got = forward_full(graph, op, one_task(op), [values[t] for t in op.inputs])
    (want,) = ort_run(path, feeds)
    # floats come back float32; ops of ids only (Not of a mask input) give ids
    assert got.dtype == (np.float32 if graph.tensors[op.output].dtype.is_float else np.int64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("c", CASES, ids=str)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_split_tasks_compute_the_one_task_result(load: CaseLoader, c, data) -> None:
    """Forward tiles and (halo-summed) backward gradients of any split equal the one-task
    ones: catches halo, padding and tie-break errors."""
    model = load(c)[1]
    graph, op = model.graph, op_of(model)
    config = _random_config(data, graph, op)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    arrays = operand_arrays(c, model, rng, ties=data.draw(st.booleans(), label="ties"))
    whole = forward_full(graph, op, one_task(op), arrays)
    split = forward_full(graph, op, config, arrays)
    np.testing.assert_allclose(split, whole, rtol=1e-12, atol=1e-12)
    grad_output = rng.standard_normal(whole.shape)
    want = backward_full(graph, op, one_task(op), arrays, grad_output)
    got = backward_full(graph, op, config, arrays, grad_output)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("c", CASES, ids=str)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_backward_matches_finite_differences(load: CaseLoader, c, data) -> None:
    """On one task's buffers, padding included: d(sum(R * forward)) / d buffer."""
    model = load(c)[1]
    graph, op = model.graph, op_of(model)
    # An op with statistics reads every task's data through them: differentiate the
    # whole op (one task), its statistics recomputed at every evaluation.
    config = one_task(op) if op.nest.sync_dims else _random_config(data, graph, op)
    tasks = tasks_of(graph, op, config)
    task = tasks[data.draw(st.integers(0, len(tasks) - 1), label="task")]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    arrays = operand_arrays(c, model, rng)
    bufs = buffers(task, arrays)
    d = definition(op.type)
    projection = rng.standard_normal(rect_shape(task.output))

    def args_now(grad=None):
        if op.nest.sync_dims:
            return all_task_args(graph, op, config, bufs, grad)[0]
        return task_args(task, loss_scale_of(graph, op, arrays), graph.tensors[op.output].shape)

    def scalar() -> float:
        return float((projection * d.forward(np, op.attrs, bufs, args_now())).sum())

    args = args_now(projection)
    out = d.forward(np, op.attrs, bufs, args)
    grads = d.backward(np, op.attrs, bufs, out, np.array(projection, copy=True), args)
    assert len(grads) == len(bufs)
    fixed = (TensorRole.STATE, TensorRole.CONSTANT, TensorRole.LABELS)
    for name, buf, grad in zip(op.inputs, bufs, grads, strict=True):
        if grad is None:  # only what takes no gradient
            assert buf.dtype.kind != "f" or graph.tensors[name].role in fixed
            continue
        assert grad.shape == buf.shape and grad.dtype == buf.dtype
        picks = rng.permutation(buf.size)[:150]  # enough to hit halo, padding and body
        for flat in picks:
            index = np.unravel_index(flat, buf.shape)
            numeric = central_difference(scalar, buf, index, 1e-6)
            assert grad[index] == pytest.approx(numeric, rel=1e-6, abs=1e-6), index
