"""Conv's ``workspace`` (what the memory model adds while a kernel runs) against what the
kernel allocates, as tracemalloc counts it (the executor's `--trace` measure): the
backward's peak over what it started with is the workspace, the weight and bias
gradients it returns and the input gradient, within 10 %. Both ways of summing dW are
covered: one batched GEMM (few output channels, large images) and a loop over the
samples (many channels, small images: resnet18's last blocks)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from onnx2soap.ops import TaskArgs, definition
from onnx2soap.ops.defs.conv import ConvAttrs

CASES = {
    # x buffer (padded), w, kernel, stride: resnet18's first Conv and its last block's
    "stem, batched dW": ((8, 3, 37, 37), (16, 3, 7, 7), 7, 2),
    "last block, dW by sample": ((8, 128, 3, 3), (128, 128, 3, 3), 3, 1),
    "middle, dW by sample": ((8, 64, 6, 6), (64, 64, 3, 3), 3, 1),
    "1x1 strided, batched dW": ((8, 32, 8, 8), (16, 32, 1, 1), 1, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_conv_backward_peak_is_its_workspace_and_what_it_returns(case: str) -> None:
    x_shape, w_shape, k, s = CASES[case]
    attrs = ConvAttrs((k, k), (s, s), (1, 1), (0, 0), (0, 0))
    out = (x_shape[0], w_shape[0], *((n - k) // s + 1 for n in x_shape[2:]))
    conv = definition("Conv")
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(t).astype(np.float32) for t in (x_shape, w_shape, w_shape[:1]))
    whole = lambda shape: tuple((0, n) for n in shape)  # noqa: E731
    args = TaskArgs(out_shape=out, valid=(whole(x_shape), whole(w_shape), whole(w_shape[:1])))
    y = conv.forward(np, attrs, [x, w, b], args)
    gy = rng.standard_normal(out).astype(np.float32)
    conv.backward(np, attrs, [x, w, b], y, gy, args)  # numpy's caches warm
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        grads = conv.backward(np, attrs, [x, w, b], y, gy, args)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    _, backward = conv.workspace(attrs, [x_shape, w_shape, w_shape[:1]], out, 4)
    expected = backward + sum(g.nbytes for g in grads)
    assert peak == pytest.approx(expected, rel=0.10), (peak, expected)
