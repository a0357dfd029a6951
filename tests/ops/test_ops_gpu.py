"""The same kernels on cupy: every case of every op, forward and backward, per task of a
split config, equal numpy's. Buffers are cut on the device by ``slice_from_full(cupy, ...)``,
as the executor does on GPU ranks. Skipped where cupy or a GPU is missing."""

from __future__ import annotations

import numpy as np
import pytest

from executor.buffers import slice_from_full
from onnx2soap.ir import Graph, Op
from onnx2soap.ops import definition, registry
from tests.ops.harness import (
    CaseLoader,
    buffers,
    config_of,
    loss_scale_of,
    op_of,
    operand_arrays,
    splittable_degrees,
    task_args,
    tasks_of,
)

CASES = tuple(c for d in registry().by_name.values() for c in d.cases)

cp = pytest.importorskip("cupy")
try:
    _GPUS = cp.cuda.runtime.getDeviceCount()
except cp.cuda.runtime.CUDARuntimeError:
    _GPUS = 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_GPUS == 0, reason="no CUDA GPU"),
]


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> CaseLoader:
    return CaseLoader(tmp_path_factory.mktemp("kernels_gpu"))


def _check_tasks(graph: Graph, op: Op, arrays: list[np.ndarray]):
    degrees = [min(2, size) if ok else 1 for _, size, ok in splittable_degrees(graph, op)]
    kernel = definition(op.type)
    loss_scale = loss_scale_of(graph, op, arrays)
    device_full = [cp.asarray(a) for a in arrays]
    rng = np.random.default_rng(5)
    for task in tasks_of(graph, op, config_of(degrees)):
        args = task_args(task, loss_scale, graph.tensors[op.output].shape)
        host = buffers(task, arrays)
        dev = [slice_from_full(cp, a, r) for a, r in zip(device_full, task.inputs, strict=True)]
        for h, d in zip(host, dev, strict=True):
            np.testing.assert_array_equal(cp.asnumpy(d), h)
        want = kernel.forward(np, op.attrs, host, args)
        got = kernel.forward(cp, op.attrs, dev, args)
        assert isinstance(got, cp.ndarray) and got.dtype == want.dtype
        np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-10, atol=1e-10)
        grad = rng.standard_normal(want.shape).astype(want.dtype)
        want_grads = kernel.backward(np, op.attrs, host, want, grad, args)
        got_grads = kernel.backward(cp, op.attrs, dev, got, cp.asarray(grad), args)
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
