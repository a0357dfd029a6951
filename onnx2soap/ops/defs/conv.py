"""Conv: N-d grouped convolution as one batched GEMM over gathered window columns (im2col).

The X buffer already holds the halo and the zero padding, so output ``j`` reads buffer
index ``j * stride + k * dilation`` at kernel position ``k`` (see ``window_taps``). The
columns are built with one slice copy per kernel position (no sliding_window_view, which
cupy lacks), and every product is an ``xp.matmul`` batched over the samples and groups.

A grouped convolution's output channel ``c`` reads the input channels of its group
``c // (C_out / group)``: a ``Grouped`` map, and the output channel dim is split in whole
groups only (its granule), so every task holds whole groups of both buffers. Depthwise
(one channel per group) is the identity case.

Without groups the input channels ``ci`` split too (``LoopNest.partial_dims``): each
task convolves its channels with its slice of W, a partial output, and the partial tiles
are summed; the bias belongs to the sum once, added (and given its gradient) by the task
whose channels start at 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from onnx2soap.ir import AxisMap, Grouped, Operand, identity
from onnx2soap.ops.base import OpDef, Saved, W, X, case
from onnx2soap.ops.context import NodeContext, make_op, spatial_names
from onnx2soap.ops.kernel_util import check_window_buffer, flat_shifts, window_taps
from onnx2soap.ops.windows import window, window_axes, window_outputs

_LEAD = (slice(None), slice(None))  # n and channels: read as they are


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
    if group == 1:  # the input channels are a plain contraction: partial sums
        op = replace(op, nest=replace(op.nest, partial_dims=(CI,)))
    return op


def _first_channels(args, rank: int) -> bool:
    """Whether the task holds input channel 0 (every task that does not split them; the
    whole op where the box is not given): it alone adds the bias."""
    return not args.box or args.box[2 + rank][0] == 0


@dataclass(frozen=True)
class _Layout:
    """The sizes of one task's convolution, from its buffers and output tile."""

    n: int
    groups: int
    c_in: int  # input channels per group
    c_out: int  # output channels per group, in this task
    taps: int  # kernel positions
    out_spatial: tuple[int, ...]
    buffer: tuple[int, ...]  # the X buffer's spatial shape
    wide: bool  # stride 1 everywhere: the columns are shifted runs of the flat buffer

    @property
    def depth(self) -> int:  # the contraction length: kernel positions x channels
        return self.taps * self.c_in

    @property
    def grid(self) -> tuple[int, ...]:
        """The positions one sample's columns span: the outputs, or in the wide layout
        the whole buffer (the outputs are its corner, the rest garbage)."""
        return self.buffer if self.wide else self.out_spatial

    @property
    def corner(self) -> tuple[slice, ...]:
        """The outputs within the grid."""
        return tuple(slice(o) for o in self.out_spatial)


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
        buffer=tuple(x.shape[2:]),
        wide=all(s == 1 for s in attrs.strides) and 0 not in out_spatial,
    )


# The columns are (n, groups, taps * c_in, grid): what every output reads, per sample,
# tap-major (W is reordered to match), so that each product is one GEMM per sample and
# group (one xp.matmul call) that writes the output in its own layout. Each tap is
# copied once, straight into its place.
#
# With stride 1 (the "wide" layout) output position p of a channel reads p + shift at a
# tap (kernel_util.flat_shifts), so one tap's columns of all samples and channels are a
# single run of the flat buffer: a long contiguous copy instead of many short strided
# rows (numpy pays ~100 ns per row). The grid is then the whole buffer: the positions
# that are no output are garbage, dropped from the output and given zero gradient.


def _tap_major(xp, w, lay: _Layout):
    """W (C_out, c_in, *kernel) as (groups, c_out, taps * c_in), the columns' order."""
    w = w.reshape(lay.groups, lay.c_out, lay.c_in, lay.taps)
    return xp.swapaxes(w, 2, 3).reshape(lay.groups, lay.c_out, lay.depth)


def _channel_major(xp, grad_w, w_shape, lay: _Layout):
    """The inverse of _tap_major, for dW."""
    grad_w = grad_w.reshape(lay.groups, lay.c_out, lay.taps, lay.c_in)
    return xp.swapaxes(grad_w, 2, 3).reshape(w_shape)


def _columns(xp, attrs: ConvAttrs, x, lay: _Layout):
    n, g, ci, size = lay.n, lay.groups, lay.c_in, math.prod(lay.grid)
    if lay.taps == 1 and lay.wide:  # a 1x1 convolution reads the buffer as it is
        return x.reshape(n, g, ci, size)
    cols = xp.empty((n, g, lay.taps, ci, *lay.grid), dtype=x.dtype)
    if lay.wide:
        shifts = flat_shifts(attrs, lay.buffer)
        flat = xp.zeros(x.size + shifts[-1], dtype=x.dtype)  # the last runs read past X
        flat[: x.size] = x.reshape(-1)
        for t, off in enumerate(shifts):
            cols[:, :, t] = flat[off : off + x.size].reshape(n, g, ci, *lay.grid)
    else:
        for t, sl in enumerate(window_taps(attrs, lay.out_spatial)):
            cols[:, :, t] = x[(*_LEAD, *sl)].reshape(n, g, ci, *lay.grid)
    return cols.reshape(n, g, lay.depth, size)


def _col2im(xp, attrs: ConvAttrs, grad_cols, x, lay: _Layout):
    """The gradient of the X buffer from that of its columns (the adjoint of _columns).
    One slice per tap never repeats an index, so += is an exact scatter-add; taps that
    overlap accumulate across iterations."""
    n, c = lay.n, x.shape[1]
    if lay.taps == 1 and lay.wide:  # the columns were X
        return grad_cols.reshape(x.shape)
    grad_cols = grad_cols.reshape(n, lay.groups, lay.taps, lay.c_in, -1)
    if lay.wide:
        shifts = flat_shifts(attrs, lay.buffer)
        flat = xp.zeros(x.size + shifts[-1], dtype=grad_cols.dtype)
        for t, off in enumerate(shifts):
            run = flat[off : off + x.size].reshape(grad_cols[:, :, t].shape)
            run += grad_cols[:, :, t]  # garbage positions add 0
        return flat[: x.size].reshape(x.shape)  # contiguous, and ours alone
    grad_x = xp.zeros_like(x)
    for t, sl in enumerate(window_taps(attrs, lay.out_spatial)):
        grad_x[(*_LEAD, *sl)] += grad_cols[:, :, t].reshape(n, c, *lay.out_spatial)
    return grad_x


def _weight_grad(xp, gy, cols, lay: _Layout):
    """dW (groups, c_out, depth): the sum over samples of gy[i] @ cols[i]^T.

    Computed transposed, cols[i] @ gy[i]^T, which OpenBLAS runs faster for the few
    output channels of small convolutions. One batched GEMM and a sum where its
    per-sample products are no larger than the columns (large images: the early layers);
    a loop over the samples where they would be, to keep memory in check.
    """
    gy_t = xp.swapaxes(gy, 2, 3)  # BLAS reads it transposed, no copy
    if lay.c_out <= math.prod(lay.grid):
        grad = xp.matmul(cols, gy_t).sum(axis=0)
    else:
        grad = xp.matmul(cols[0], gy_t[0])
        for i in range(1, lay.n):
            grad += xp.matmul(cols[i], gy_t[i])
    return xp.swapaxes(grad, 1, 2)


def _output(xp, product_, bias, lay: _Layout):
    """(n, C_out, *out), contiguous, from the GEMM's (n, groups, c_out, grid), plus the
    bias (the garbage dropped by one copy)."""
    y = product_.reshape(lay.n, lay.groups * lay.c_out, *lay.grid)
    if lay.grid != lay.out_spatial:
        y = xp.ascontiguousarray(y[(*_LEAD, *lay.corner)])
    if bias is not None:
        y += bias.reshape(1, -1, *(1 for _ in lay.grid))
    return y


def _grad_grid(xp, grad_output, lay: _Layout):
    """The output gradient as (n, groups, c_out, grid), zero at the garbage positions."""
    shape = (lay.n, lay.groups, lay.c_out, math.prod(lay.grid))
    if lay.grid == lay.out_spatial:
        return grad_output.reshape(shape)
    gy = xp.zeros((*grad_output.shape[:2], *lay.grid), dtype=grad_output.dtype)
    gy[(*_LEAD, *lay.corner)] = grad_output
    return gy.reshape(shape)


def forward(xp, attrs: ConvAttrs, inputs, args):
    x, w = inputs[0], inputs[1]
    lay = _layout(attrs, x, w, args.out_shape)
    product_ = xp.matmul(_tap_major(xp, w, lay), _columns(xp, attrs, x, lay))
    first = _first_channels(args, len(attrs.kernel_shape))
    return _output(xp, product_, inputs[2] if len(inputs) > 2 and first else None, lay)


def backward(xp, attrs: ConvAttrs, inputs, output, grad_output, args):
    x, w = inputs[0], inputs[1]
    lay = _layout(attrs, x, w, args.out_shape)
    gy = _grad_grid(xp, grad_output, lay)  # (n, groups, c_out, grid)
    cols = _columns(xp, attrs, x, lay)
    grad_w = _channel_major(xp, _weight_grad(xp, gy, cols, lay), w.shape, lay)
    del cols  # freed before the column gradient takes their size again
    weights_t = xp.swapaxes(_tap_major(xp, w, lay), 1, 2)
    grad_cols = xp.matmul(weights_t, gy)  # (n, groups, depth, grid)
    grads = [_col2im(xp, attrs, grad_cols, x, lay), grad_w]
    if len(inputs) > 2:
        if _first_channels(args, len(attrs.kernel_shape)):
            grads.append(grad_output.sum(axis=(0, *range(2, grad_output.ndim))))
        else:
            grads.append(xp.zeros(inputs[2].shape, dtype=grad_output.dtype))
    return tuple(grads)


def workspace(attrs: ConvAttrs, shapes, out_shape, itemsize: int) -> tuple[int, int]:
    """The most the kernels above hold at once besides X, W, Y and the gradients they
    return: the columns with the flat copy of X (wide layout) or the GEMM's result, the
    reordered W; in the backward the padded output gradient, the columns with dW's
    per-sample products, then the columns' gradient (checked against tracemalloc in
    tests/ops/test_conv_workspace.py)."""
    x, w = shapes[0], shapes[1]
    n, c_in = x[0], w[1]
    g = x[1] // c_in if c_in else 0
    c_out = w[0] // g if g else 0
    taps, out_spatial = math.prod(attrs.kernel_shape), tuple(out_shape[2:])
    wide = all(s == 1 for s in attrs.strides) and 0 not in out_spatial
    grid = tuple(x[2:]) if wide else out_spatial
    size, depth = math.prod(grid), taps * c_in
    cols = 0 if taps == 1 and wide else n * g * depth * size
    flat = math.prod(x) if wide and cols else 0
    product_ = n * g * c_out * size if grid != out_spatial else 0  # else it is Y itself
    # _weight_grad: one batched GEMM's per-sample products, or a loop's one product at a
    # time (its running sum is the dW it returns, which the memory model counts with the
    # gradients a kernel returns; counted here too, resnet18's last Conv was 34 % over)
    per_sample = n if c_out <= size else 1
    forward_ = max(cols + flat, cols + product_ + math.prod(w))
    # _col2im: the columns' gradient, and off the wide layout one tap's slice of it
    # reshaped (a copy) and numpy's buffer for adding it into a strided view of X's
    # gradient (a 1x1 Conv of stride 2 measured 19 % over the model without them)
    tap_copy = 2 * n * g * c_in * size if cols and not wide else 0
    backward_ = product_ + max(
        cols + max(flat, per_sample * g * depth * c_out),
        math.prod(w) + (n * g * depth * size + tap_copy if cols else 0),
    )
    return forward_ * itemsize, backward_ * itemsize


CONV = OpDef(
    name="Conv",
    versions=(11, 22),
    convert=convert,
    forward=forward,
    backward=backward,
    workspace=workspace,
    saves=Saved(inputs=(0, 1), output=False),  # X and W; the bias's shape only
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
        # 1x1: the columns are the buffer itself (stride 1) or one strided slice
        case("conv2d_pointwise", "Conv", X(2, 4, 5, 5), W(6, 4, 1, 1), W(6)),
        case("conv2d_pointwise_strided", "Conv", X(2, 3, 6, 5), W(4, 3, 1, 1), strides=[2, 2]),
        # more output channels than grid positions: dW sums its products sample by sample
        case("conv2d_many_channels", "Conv", X(2, 2, 3, 3), W(12, 2, 2, 2), W(12)),
    ),
)

DEFINITIONS = (CONV,)
