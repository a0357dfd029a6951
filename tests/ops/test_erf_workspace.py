"""Erf's and Gelu's ``workspace`` against what their kernels allocate, as tracemalloc
counts it (the executor's ``--trace`` measure), within 10 %: numpy's erf runs its float64
series a chunk at a time (``ERF_CHUNK``), and the tanh form of Gelu its chain of passes
(``TANH_GELU_CHUNK``), so a large tile's scratch is fixed; and the chunks give the same
values as the passes over the whole tile."""

from __future__ import annotations

import numpy as np
import pytest

from onnx2soap.ops import TaskArgs, definition
from onnx2soap.ops.defs.activations import (
    ERF_CHUNK,
    TANH_GELU_CHUNK,
    GeluApproximation,
    GeluAttrs,
    _erf,
    _erf_portable,
)
from tests.ops.harness import traced_peak

SHAPES = [(4, 100), (8, 64, 256), (32, 64, 1024)]  # below, at 2x and at 32x the chunk
OPS = {"Erf": None, "Gelu": GeluAttrs(GeluApproximation.NONE)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(OPS))
def test_the_kernels_peaks_are_their_workspace_and_what_they_return(name, shape) -> None:
    op, attrs = definition(name), OPS[name]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    args = TaskArgs(out_shape=shape, valid=(tuple((0, n) for n in shape),))
    y = op.forward(np, attrs, [x], args)
    gy = np.ones_like(y)
    op.backward(np, attrs, [x], y, gy, args)  # numpy's caches warm
    forward, y = traced_peak(lambda: op.forward(np, attrs, [x], args))
    backward, grads = traced_peak(lambda: op.backward(np, attrs, [x], y, gy, args))
    want_forward, want_backward = op.workspace(attrs, [shape], shape, 4)
    assert forward == pytest.approx(want_forward + y.nbytes, rel=0.10)
    assert backward == pytest.approx(want_backward + grads[0].nbytes, rel=0.10)


def test_a_large_tiles_scratch_is_one_chunks() -> None:
    x = np.random.default_rng(1).standard_normal(20 * ERF_CHUNK + 7).astype(np.float32)
    scratch, _ = traced_peak(lambda: _erf(np, x))
    assert scratch < 16 * 8 * ERF_CHUNK + x.nbytes  # the whole tile's series: 13 x 8 x 20 x
    expected = _erf_portable(np, x.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(_erf(np, x), expected)


TANH = GeluAttrs(GeluApproximation.TANH)


# at 4x and 64x the chunk (a tile of 400 elements: its arrays' Python objects weigh
# about as much as its chunk)
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_the_tanh_gelus_peaks_are_its_workspace_and_what_it_returns(shape) -> None:
    op = definition("Gelu")
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    args = TaskArgs(out_shape=shape, valid=(tuple((0, n) for n in shape),))
    y = op.forward(np, TANH, [x], args)
    gy = np.ones_like(y)
    op.backward(np, TANH, [x], y, gy, args)  # numpy's caches warm
    forward, y = traced_peak(lambda: op.forward(np, TANH, [x], args))
    backward, grads = traced_peak(lambda: op.backward(np, TANH, [x], y, gy, args))
    want_forward, want_backward = op.workspace(TANH, [shape], shape, 4)
    assert want_backward == 3 * TANH_GELU_CHUNK * 4
    assert forward == pytest.approx(want_forward + y.nbytes, rel=0.10)
    assert backward == pytest.approx(want_backward + grads[0].nbytes, rel=0.10)


def test_the_tanh_gelus_chunks_give_the_whole_tiles_values() -> None:
    """Each chunk's passes are the expression's, in its order: the same float32 values as
    the expression over the whole tile (a tile of 3 chunks and a part; and transposed, a
    view its kernels read through a copy)."""
    rng = np.random.default_rng(3)
    x = (3 * rng.standard_normal((7, 3 * TANH_GELU_CHUNK // 7 + 5))).astype(np.float32)
    gy = rng.standard_normal(x.shape).astype(np.float32)
    op = definition("Gelu")
    for xs, gs in ((x, gy), (x.T, gy.T)):
        t = np.tanh(TANH.tanh_scale * (xs + TANH.cubic * xs * xs * xs))
        slope = 0.5 * (1 + t) + 0.5 * xs * (1 - t * t) * (
            TANH.tanh_scale * (1 + 3 * TANH.cubic * xs * xs)
        )
        np.testing.assert_array_equal(op.forward(np, TANH, [xs], None), 0.5 * xs * (1 + t))
        np.testing.assert_array_equal(op.backward(np, TANH, [xs], None, gs, None)[0], gs * slope)
