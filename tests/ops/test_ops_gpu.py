"""The same kernels on cupy: every case of every op, forward and backward, per task of a
split config, equal numpy's. Buffers are cut on the device by ``slice_from_full(cupy, ...)``,
as the executor does on GPU ranks. An op with statistics (BatchNormalization in training
mode) gets them as the executor's ``ReduceStats`` makes them: each stat group's partial
statistics computed by the statistics kernels, on the device for the cupy side, and
combined; they equal numpy's too.

Runs on a GPU, and under the numpy stand-in for cupy (``tests/standins``, which ``make
test`` puts first on the path for a second run of the GPU tests); skipped where cupy is
not installed or sees no GPU.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from executor.buffers import global_slices, slice_from_full
from onnx2soap.ir import Graph, Op
from onnx2soap.ops import TaskArgs, definition, registry
from onnx2soap.soap.partition import ParallelConfig, Task, stat_groups
from tests.ops.harness import (
    CaseLoader,
    all_task_args,
    buffers,
    config_of,
    op_of,
    operand_arrays,
    splittable_degrees,
    tasks_of,
)
from tests.optional import cupy_or_skip

CASES = tuple(c for d in registry().by_name.values() for c in d.cases)

cp = cupy_or_skip()
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> CaseLoader:
    return CaseLoader(tmp_path_factory.mktemp("kernels_gpu"))


def _device_args(
    graph: Graph,
    op: Op,
    config: ParallelConfig,
    device_full: list,
    host_args: list[TaskArgs],
    grad_output: np.ndarray | None,
) -> list[TaskArgs]:
    """``host_args`` with statistics made on the device (``all_task_args`` on cupy)."""
    if not op.nest.sync_dims:
        return host_args
    d, tasks = definition(op.type), tasks_of(graph, op, config)
    stats = d.statistics
    args = [replace(a, stats=None, grad_stats=None) for a in host_args]
    phases = (
        ("stats", stats.forward, stats.combine_forward),
        ("grad_stats", stats.backward, stats.combine_backward),
    )
    for field, partial, combine in phases:
        if field == "grad_stats" and grad_output is None:
            break
        sums = {}
        for group in stat_groups(op, tasks):
            parts = []
            for i in group.tasks:
                bufs = _device_buffers(tasks[i], device_full)
                if field == "stats":
                    parts.append(partial(cp, op.attrs, bufs, args[i]))
                else:
                    out = d.forward(cp, op.attrs, bufs, args[i])
                    tile = cp.asarray(grad_output[global_slices(tasks[i].output)])
                    parts.append(partial(cp, op.attrs, bufs, out, tile, args[i]))
            combined = combine(cp, cp.stack(parts))
            sums.update({i: combined for i in group.tasks})
        args = [replace(a, **{field: sums[i]}) for i, a in enumerate(args)]
    for host, device in zip(host_args, args, strict=True):
        for field in ("stats", "grad_stats"):
            want, got = getattr(host, field), getattr(device, field)
            assert (want is None) == (got is None), field
            if want is not None:
                assert isinstance(got, cp.ndarray)
                np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-10, atol=1e-10)
    return args


def _device_buffers(task: Task, device_full: list) -> list:
    return [slice_from_full(cp, a, r) for a, r in zip(device_full, task.inputs, strict=True)]


def _check_tasks(graph: Graph, op: Op, arrays: list[np.ndarray]):
    degrees = [min(2, size) if ok else 1 for _, size, ok in splittable_degrees(graph, op)]
    config = config_of(degrees)
    kernel = definition(op.type)
    rng = np.random.default_rng(5)
    # The whole output's gradient: each task's tile of it is what the executor's backward
    # reads (a loss's is one number, the same for every task).
    out_shape = () if op.is_loss else graph.tensors[op.output].shape
    grad_output = rng.standard_normal(out_shape)
    host_args = all_task_args(graph, op, config, arrays, None if op.is_loss else grad_output)
    device_full = [cp.asarray(a) for a in arrays]
    device_args = _device_args(
        graph, op, config, device_full, host_args, None if op.is_loss else grad_output
    )
    for task, args, dev_args in zip(tasks_of(graph, op, config), host_args, device_args,
                                    strict=True):  # fmt: skip
        host = buffers(task, arrays)
        dev = _device_buffers(task, device_full)
        for h, d in zip(host, dev, strict=True):
            np.testing.assert_array_equal(cp.asnumpy(d), h)
        want = kernel.forward(np, op.attrs, host, args)
        got = kernel.forward(cp, op.attrs, dev, dev_args)
        assert isinstance(got, cp.ndarray) and got.dtype == want.dtype
        np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-10, atol=1e-10)
        tile = grad_output if op.is_loss else grad_output[global_slices(task.output)]
        grad = np.array(tile, dtype=want.dtype)
        want_grads = kernel.backward(np, op.attrs, host, want, grad.copy(), args)
        got_grads = kernel.backward(cp, op.attrs, dev, got, cp.asarray(grad), dev_args)
        for g, w in zip(got_grads, want_grads, strict=True):
            if w is None:
                assert g is None
                continue
            assert isinstance(g, cp.ndarray) and g.dtype == w.dtype
            np.testing.assert_allclose(cp.asnumpy(g), w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("c", CASES, ids=str)
def test_cupy_matches_numpy(load: CaseLoader, c) -> None:
    model = load(c)[1]
    _check_tasks(model.graph, op_of(model), operand_arrays(c, model, np.random.default_rng(0)))
