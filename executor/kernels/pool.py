"""MaxPool, AveragePool and GlobalAveragePool.

Window buffers arrive with halo and padding in place (-inf for MaxPool, 0 for
AveragePool), so a window is read at buffer index ``j * stride + k * dilation``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from executor.kernels._common import check_window_buffer, window_taps
from executor.kernels.base import Array, Interval, TaskArgs
from onnx2soap.ir import PoolAttrs, ReduceAttrs

_LEAD = (slice(None), slice(None))  # n and c: read as they are


def _out_spatial(attrs: PoolAttrs, x: Array, args: TaskArgs, op: str) -> tuple[int, ...]:
    out_spatial = tuple(args.out_shape[2:])
    check_window_buffer(op, attrs, x.shape, out_spatial)
    return out_spatial


def _argmax_taps(xp, attrs: PoolAttrs, x: Array, out_spatial) -> tuple[Array, Array]:
    """The window maxima and, per output, the first kernel position (row-major) holding
    it. A strict ``>`` keeps the earliest tap on ties, so a task that holds the window in
    a split buffer picks the same element as the whole tensor would."""
    best = arg = None
    for t, sl in enumerate(window_taps(attrs, out_spatial)):
        tap = x[(*_LEAD, *sl)]
        if best is None:
            best, arg = tap.copy(), xp.zeros(tap.shape, dtype=xp.int32)
            continue
        better = tap > best
        best = xp.where(better, tap, best)
        arg = xp.where(better, t, arg)
    return best, arg


@dataclass(frozen=True)
class MaxPoolKernel:
    def forward(self, xp, attrs: PoolAttrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        x = inputs[0]
        # The maximum alone: which tap holds it matters only to the backward.
        best = None
        for sl in window_taps(attrs, _out_spatial(attrs, x, args, "MaxPool")):
            tap = x[(*_LEAD, *sl)]
            best = tap.copy() if best is None else xp.maximum(best, tap, out=best)
        return best

    def backward(self, xp, attrs: PoolAttrs, inputs, output, grad_output, args):
        x = inputs[0]
        out_spatial = _out_spatial(attrs, x, args, "MaxPool")
        # Recomputed rather than read from ``output``: ties must go to one tap only.
        arg = _argmax_taps(xp, attrs, x, out_spatial)[1]
        grad_x = xp.zeros_like(x)
        for t, sl in enumerate(window_taps(attrs, out_spatial)):
            grad_x[(*_LEAD, *sl)] += grad_output * (arg == t)
        return (grad_x,)


def _counted(attrs: PoolAttrs, axis: int, valid: Interval, length: int) -> Interval:
    """The buffer-local range of one spatial axis whose taps enter the divisor.

    count_include_pad=0: the tensor's data. count_include_pad=1: the data widened by the
    explicit pads, clipped to the buffer; the extra reach of ceil_mode beyond the pads is
    not counted, as in onnxruntime (which divides by the window clipped to
    ``[-pads_begin, size + pads_end)``). Where the buffer starts inside the tensor,
    ``valid[0]`` is 0 and the clip to 0 makes the begin pad irrelevant, as it should.
    """
    lo, hi = valid
    if attrs.count_include_pad:
        lo, hi = lo - attrs.pads_begin[axis], hi + attrs.pads_end[axis]
    return max(lo, 0), min(hi, length)


def _divisor(xp, attrs: PoolAttrs, x: Array, out_spatial, valid) -> Array:
    """Per output, the number of its taps inside the counted range: a product over the
    spatial axes, since both the window and the range are boxes."""
    rank = len(out_spatial)
    divisor = xp.ones((1, 1, *(1 for _ in out_spatial)), dtype=x.dtype)
    for i, (o, k, s, d) in enumerate(
        zip(out_spatial, attrs.kernel_shape, attrs.strides, attrs.dilations, strict=True)
    ):
        lo, hi = _counted(attrs, i, valid[2 + i], x.shape[2 + i])
        taps = xp.arange(o)[:, None] * s + xp.arange(k)[None, :] * d
        count = ((taps >= lo) & (taps < hi)).sum(axis=1).astype(x.dtype)
        divisor = divisor * count.reshape((1, 1, *(o if j == i else 1 for j in range(rank))))
    # A window with no counted tap only arises where onnxruntime refuses or differs: pads
    # >= kernel (refused: "Pad should be smaller than kernel"), or a ceil_mode window that
    # starts in the end padding (onnxruntime drops it). Its sum is 0; dividing by 1 keeps
    # it 0 instead of NaN.
    return xp.maximum(divisor, 1)


@dataclass(frozen=True)
class AveragePoolKernel:
    def forward(self, xp, attrs: PoolAttrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        x = inputs[0]
        out_spatial = _out_spatial(attrs, x, args, "AveragePool")
        taps = window_taps(attrs, out_spatial)
        total = x[(*_LEAD, *next(taps))].copy()
        for sl in taps:
            total += x[(*_LEAD, *sl)]
        return total / _divisor(xp, attrs, x, out_spatial, args.valid[0])

    def backward(self, xp, attrs: PoolAttrs, inputs, output, grad_output, args):
        x = inputs[0]
        out_spatial = _out_spatial(attrs, x, args, "AveragePool")
        share = grad_output / _divisor(xp, attrs, x, out_spatial, args.valid[0])
        grad_x = xp.zeros_like(x)
        for sl in window_taps(attrs, out_spatial):
            grad_x[(*_LEAD, *sl)] += share
        return (grad_x,)


@dataclass(frozen=True)
class GlobalAveragePoolKernel:
    """The spatial dims are reductions, never split: the buffer holds whole planes."""

    def forward(self, xp, attrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        x = inputs[0]
        return x.mean(axis=tuple(range(2, x.ndim)), keepdims=True)

    def backward(self, xp, attrs, inputs, output, grad_output, args):
        x = inputs[0]
        count = math.prod(x.shape[2:])
        return (xp.zeros_like(x) + grad_output / count,)


@dataclass(frozen=True)
class ReduceMeanKernel:
    """Reduced dims are reductions, never split: the buffer holds them whole."""

    def forward(self, xp, attrs: ReduceAttrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        return inputs[0].mean(axis=attrs.axes, keepdims=True).reshape(args.out_shape)

    def backward(self, xp, attrs: ReduceAttrs, inputs, output, grad_output, args):
        x = inputs[0]
        kept = tuple(1 if a in attrs.axes else s for a, s in enumerate(x.shape))
        count = math.prod(x.shape[a] for a in attrs.axes)
        return (xp.zeros_like(x) + grad_output.reshape(kept) / count,)
