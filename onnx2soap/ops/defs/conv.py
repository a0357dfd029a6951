"""Conv: N-d grouped convolution as one batched GEMM over gathered window columns (im2col).

The X buffer already holds the halo and the zero padding, so output ``j`` reads buffer
index ``j * stride + k * dilation`` at kernel position ``k`` (see ``window_taps``). The
columns are built with strided slices (no sliding_window_view, which cupy lacks), one per
kernel position, and every product is an ``xp.matmul`` batched over the groups.

A grouped convolution's output channel ``c`` reads the input channels of its group
``c // (C_out / group)``: a ``Grouped`` map, and the output channel dim is split in whole
groups only (its granule), so every task holds whole groups of both buffers. Depthwise
(one channel per group) is the identity case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from onnx2soap.ir import AxisMap, Grouped, Operand, identity
from onnx2soap.ops.base import OpDef, W, X, case
from onnx2soap.ops.context import NodeContext, make_op, spatial_names
from onnx2soap.ops.kernel_util import check_window_buffer, window_taps
from onnx2soap.ops.windows import window, window_axes, window_outputs


@dataclass(frozen=True)
class ConvAttrs:
    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    group: int = 1


def convert(
    ctx: NodeContext,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    pads=None,
    strides=None,
):
    x, w, b = ctx.tensor(0), ctx.tensor(1), ctx.optional(2)
    rank = len(x.shape) - 2
    if rank < 1 or len(w.shape) != rank + 2:
        raise ctx.fail(f"X {list(x.shape)} and W {list(w.shape)} are not a valid Conv pair")
    kernel = tuple(kernel_shape) if kernel_shape is not None else w.shape[2:]
    if tuple(kernel) != tuple(w.shape[2:]):
        raise ctx.fail(f"kernel_shape {list(kernel)} disagrees with W {list(w.shape)}")
    win = window(
        ctx, x.shape[2:], kernel, strides=strides, dilations=dilations, pads=pads, auto_pad=auto_pad
    )
    co, ci = w.shape[0], w.shape[1]
    if group < 1 or co < 1 or x.shape[1] != ci * group or co % group:
        raise ctx.fail(f"channels of X {list(x.shape)} and W {list(w.shape)} vs group {group}")
    if b is not None and b.shape != (co,):
        raise ctx.fail(f"B {list(b.shape)} must be [{co}] (one bias per output channel)")
    out_sp = window_outputs(ctx, x.shape[2:], win, False)
    names = spatial_names(rank)
    # dims: n, co, spatial outputs..., ci, kernel positions...
    dims = [("n", x.shape[0]), ("co", co), *zip(names, out_sp, strict=True), ("ci", ci)]
    dims += [(f"k{n}", k) for n, k in zip(names, kernel, strict=True)]
    CI, K0 = 2 + rank, 3 + rank
    channel: AxisMap
    if group == 1:
        channel = identity(CI)
    elif ci == 1 and co == group:  # depthwise: output channel c reads input channel c
        channel = identity(1)
    else:
        channel = Grouped(dim=1, out_per_group=co // group, in_per_group=ci)
    x_axes = (identity(0), channel, *window_axes(2, K0, win))
    w_axes = (identity(1), identity(CI), *(identity(K0 + i) for i in range(rank)))
    operands = [Operand(x.name, x_axes, pad_value=0.0), Operand(w.name, w_axes)]
    if b is not None:
        operands.append(Operand(b.name, (identity(1),)))
    attrs = ConvAttrs(
        win.kernel_shape, win.strides, win.dilations, win.pads_begin, win.pads_end, group
    )
    op = make_op(ctx, operands, attrs, dims, range(2 + rank), 2)
    if isinstance(channel, Grouped):  # whole groups per task
        nest = op.nest
        granular = replace(nest.dims[1], granule=co // group)
        op = replace(op, nest=replace(nest, dims=(nest.dims[0], granular, *nest.dims[2:])))
    return op


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


def _layout(attrs: ConvAttrs, x, w, out_shape) -> _Layout:
    out_spatial = tuple(out_shape[2:])
    check_window_buffer("Conv", attrs, x.shape, out_spatial)
    # The groups present in this task, from the buffers rather than attrs.group: a split
    # depthwise conv holds only its channels' groups in both buffers.
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


def _columns(xp, attrs: ConvAttrs, x, lay: _Layout):
    """(groups, c_in * taps, n * points): what every output reads, channel-major then tap,
    matching the row-major flattening of W's (c_in, *kernel) axes."""
    lead = (slice(None), slice(None))
    taps = [x[(*lead, *sl)] for sl in window_taps(attrs, lay.out_spatial)]
    cols = xp.stack(taps, axis=2)  # (n, C, taps, *out)
    cols = cols.reshape(lay.n, lay.groups, lay.depth, lay.points)
    return cols.transpose(1, 2, 0, 3).reshape(lay.groups, lay.depth, lay.n * lay.points)


def _to_groups(y, lay: _Layout):
    """(n, C_out, *out) -> (groups, c_out, n * points)."""
    y = y.reshape(lay.n, lay.groups, lay.c_out, lay.points)
    return y.transpose(1, 2, 0, 3).reshape(lay.groups, lay.c_out, lay.n * lay.points)


def _from_groups(y, lay: _Layout):
    """(groups, c_out, n * points) -> (n, C_out, *out)."""
    y = y.reshape(lay.groups, lay.c_out, lay.n, lay.points).transpose(2, 0, 1, 3)
    return y.reshape(lay.n, lay.groups * lay.c_out, *lay.out_spatial)


def forward(xp, attrs: ConvAttrs, inputs, args):
    x, w = inputs[0], inputs[1]
    lay = _layout(attrs, x, w, args.out_shape)
    weights = w.reshape(lay.groups, lay.c_out, lay.depth)
    y = _from_groups(xp.matmul(weights, _columns(xp, attrs, x, lay)), lay)
    if len(inputs) > 2:
        y += inputs[2].reshape(1, -1, *(1 for _ in lay.out_spatial))
    return y


def backward(xp, attrs: ConvAttrs, inputs, output, grad_output, args):
    x, w = inputs[0], inputs[1]
    lay = _layout(attrs, x, w, args.out_shape)
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


CONV = OpDef(
    name="Conv",
    versions=(11, 22),
    convert=convert,
    forward=forward,
    backward=backward,
    cases=(
        case("conv2d", "Conv", X(2, 3, 6, 7), W(4, 3, 3, 3), W(4), pads=[1, 1, 1, 1]),
        case(
            "conv2d_strided_dilated",
            "Conv",
            X(2, 2, 9, 8),
            W(3, 2, 3, 2),
            strides=[2, 3],
            dilations=[2, 1],
            pads=[1, 2, 2, 0],
        ),
        case("conv2d_groups", "Conv", X(2, 4, 6, 6), W(6, 2, 3, 3), W(6), group=2, strides=[2, 1]),
        # 3 groups of 2 input and 4 output channels: splits cut between groups only
        case("conv2d_groups3", "Conv", X(2, 6, 5, 5), W(12, 2, 3, 3), W(12), group=3, pads=[1] * 4),
        case("conv2d_depthwise", "Conv", X(2, 3, 5, 5), W(3, 1, 3, 3), group=3, pads=[2, 2, 2, 2]),
        case(
            "conv2d_depthwise_bias_strided",
            "Conv",
            X(2, 4, 7, 6),
            W(4, 1, 3, 3),
            W(4),
            group=4,
            strides=[2, 2],
            pads=[1, 1, 1, 1],
        ),
        case("conv2d_same_upper", "Conv", X(1, 2, 7, 6), W(3, 2, 4, 3), auto_pad="SAME_UPPER"),
        case(
            "conv2d_same_lower",
            "Conv",
            X(1, 2, 7, 6),
            W(3, 2, 4, 2),
            W(3),
            auto_pad="SAME_LOWER",
            strides=[2, 2],
        ),
        case(
            "conv2d_valid", "Conv", X(2, 2, 6, 6), W(2, 2, 2, 3), auto_pad="VALID", strides=[2, 1]
        ),
        case(
            "conv1d", "Conv", X(2, 3, 11), W(4, 3, 3), W(4), strides=[2], dilations=[2], pads=[2, 1]
        ),
        case("conv3d", "Conv", X(1, 2, 4, 5, 4), W(3, 2, 2, 3, 2), pads=[1, 0, 1, 0, 1, 1]),
    ),
)

DEFINITIONS = (CONV,)
