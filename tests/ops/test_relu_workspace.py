"""Relu's ``workspace`` against what its kernels allocate, as tracemalloc counts it (the
executor's ``--trace`` measure), within 10 %: its backward makes the mask x > 0, a byte
an element, which numpy casts to the gradient's dtype through a buffer of at most
``UFUNC_BUFFER`` elements as it multiplies."""

from __future__ import annotations

import numpy as np
import pytest

from onnx2soap.ops import TaskArgs, definition
from tests.ops.harness import traced_peak

SHAPES = [(16, 256), (32, 512), (64, 64, 256)]  # half, 2x and 128x the buffer


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_backwards_peak_is_its_workspace_and_the_gradient(shape, dtype) -> None:
    relu = definition("Relu")
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    args = TaskArgs(out_shape=shape, valid=(tuple((0, n) for n in shape),))
    y = relu.forward(np, None, [x], args)
    gy = np.ones_like(y)
    relu.backward(np, None, [x], y, gy, args)  # numpy's caches warm
    backward, grads = traced_peak(lambda: relu.backward(np, None, [x], y, gy, args))
    _, want = relu.workspace(None, [shape], shape, np.dtype(dtype).itemsize)
    assert backward == pytest.approx(want + grads[0].nbytes, rel=0.10)
