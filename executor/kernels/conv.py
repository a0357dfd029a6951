"""N-d grouped convolution as one batched GEMM over gathered window columns (im2col).

The X buffer already holds the halo and the zero padding, so output ``j`` reads buffer
index ``j * stride + k * dilation`` at kernel position ``k`` (see ``window_taps``). The
columns are built with strided slices (no sliding_window_view, which cupy lacks), one per
kernel position, and every product is an ``xp.matmul`` batched over the groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from executor.kernels._common import check_window_buffer, window_taps
from executor.kernels.base import Array, TaskArgs
from onnx2soap.ir import ConvAttrs


@dataclass(frozen=True)
class _Layout:
    """The sizes of one task's convolution, from its buffers and output tile."""

    n: int
    groups: int
    c_in: int  # input channels per group
    c_out: int  # output channels per group, in this task
    taps: int  # kernel positions
    out_spatial: tuple[int, ...]

    @property
    def points(self) -> int:
        return math.prod(self.out_spatial)

    @property
    def depth(self) -> int:  # the contraction length: channels x kernel positions
        return self.c_in * self.taps


def _layout(attrs: ConvAttrs, x: Array, w: Array, args: TaskArgs) -> _Layout:
    out_spatial = tuple(args.out_shape[2:])
    check_window_buffer("Conv", attrs, x.shape, out_spatial)
    # The groups present in this task, from the buffers rather than attrs.group: today a
    # grouped conv never splits its output channels (its channel map is not affine), so
    # both buffers hold every group; should the IR ever split whole groups (depthwise),
    # the buffers would hold only theirs and this still pairs them right.
    c_in = w.shape[1]
    g, rest = divmod(x.shape[1], c_in)
    if rest or not g or w.shape[0] % g:
        raise ValueError(
            f"Conv: X buffer {list(x.shape)} and W buffer {list(w.shape)} do not hold whole "
            f"channel groups (group={attrs.group})"
        )
    return _Layout(
        n=x.shape[0],
        groups=g,
        c_in=c_in,
        c_out=w.shape[0] // g,
        taps=math.prod(attrs.kernel_shape),
        out_spatial=out_spatial,
    )


def _columns(xp, attrs: ConvAttrs, x: Array, lay: _Layout) -> Array:
    """(groups, c_in * taps, n * points): what every output reads, channel-major then tap,
    matching the row-major flattening of W's (c_in, *kernel) axes."""
    lead = (slice(None), slice(None))
    taps = [x[(*lead, *sl)] for sl in window_taps(attrs, lay.out_spatial)]
    cols = xp.stack(taps, axis=2)  # (n, C, taps, *out)
    cols = cols.reshape(lay.n, lay.groups, lay.depth, lay.points)
    return cols.transpose(1, 2, 0, 3).reshape(lay.groups, lay.depth, lay.n * lay.points)


def _to_groups(y: Array, lay: _Layout) -> Array:
    """(n, C_out, *out) -> (groups, c_out, n * points)."""
    y = y.reshape(lay.n, lay.groups, lay.c_out, lay.points)
    return y.transpose(1, 2, 0, 3).reshape(lay.groups, lay.c_out, lay.n * lay.points)


def _from_groups(y: Array, lay: _Layout) -> Array:
    """(groups, c_out, n * points) -> (n, C_out, *out)."""
    y = y.reshape(lay.groups, lay.c_out, lay.n, lay.points).transpose(2, 0, 1, 3)
    return y.reshape(lay.n, lay.groups * lay.c_out, *lay.out_spatial)


@dataclass(frozen=True)
class ConvKernel:
    def forward(self, xp, attrs: ConvAttrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        x, w = inputs[0], inputs[1]
        lay = _layout(attrs, x, w, args)
        weights = w.reshape(lay.groups, lay.c_out, lay.depth)
        y = _from_groups(xp.matmul(weights, _columns(xp, attrs, x, lay)), lay)
        if len(inputs) > 2:
            y += inputs[2].reshape(1, -1, *(1 for _ in lay.out_spatial))
        return y

    def backward(self, xp, attrs: ConvAttrs, inputs, output, grad_output, args):
        x, w = inputs[0], inputs[1]
        lay = _layout(attrs, x, w, args)
        gy = _to_groups(grad_output, lay)  # (groups, c_out, n * points)
        cols = _columns(xp, attrs, x, lay)
        grad_w = xp.matmul(gy, xp.swapaxes(cols, 1, 2)).reshape(w.shape)
        weights = w.reshape(lay.groups, lay.c_out, lay.depth)
        grad_cols = xp.matmul(xp.swapaxes(weights, 1, 2), gy)  # (groups, depth, n * points)
        grad_cols = grad_cols.reshape(lay.groups * lay.c_in, lay.taps, lay.n, *lay.out_spatial)
        grad_x = xp.zeros_like(x)
        lead = (slice(None), slice(None))
        # One strided slice per tap never repeats an index, so += is an exact scatter-add;
        # taps that overlap (stride < kernel extent) accumulate across iterations.
        for t, sl in enumerate(window_taps(attrs, lay.out_spatial)):
            grad_x[(*lead, *sl)] += xp.swapaxes(grad_cols[:, t], 0, 1)
        grads = [grad_x, grad_w]
        if len(inputs) > 2:
            grads.append(grad_output.sum(axis=(0, *range(2, grad_output.ndim))))
        return tuple(grads)
