"""MaxPool and AveragePool.

Window buffers arrive with halo and padding in place (-inf for MaxPool, 0 for
AveragePool), so a window is read at buffer index ``j * stride + k * dilation``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from onnx2soap.ir import Operand, identity
from onnx2soap.ops.base import (
    SAVES_INPUTS,
    SAVES_NOTHING,
    Interval,
    OpDef,
    Sample,
    TaskArgs,
    X,
    case,
)
from onnx2soap.ops.context import NodeContext, make_op, spatial_names
from onnx2soap.ops.kernel_util import check_window_buffer, flat_shifts, window_taps
from onnx2soap.ops.windows import window, window_axes, window_outputs

_LEAD = (slice(None), slice(None))  # n and c: read as they are


class PoolKind(Enum):
    MAX = "max"
    AVERAGE = "average"


@dataclass(frozen=True)
class PoolAttrs:
    kind: PoolKind
    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    ceil_mode: bool = False
    count_include_pad: bool = False


def _convert(ctx, kind, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, include):
    x = ctx.tensor(0)
    rank = len(x.shape) - 2
    if rank < 1:
        raise ctx.fail(f"X {list(x.shape)} has no spatial axes")
    if kernel_shape is None:
        raise ctx.fail(f"kernel_shape is required ({rank} entries for X {list(x.shape)})")
    win = window(
        ctx,
        x.shape[2:],
        kernel_shape,
        strides=strides,
        dilations=dilations,
        pads=pads,
        auto_pad=auto_pad,
    )
    if any(
        p >= k for p, k in zip((*win.pads_begin, *win.pads_end), win.kernel_shape * 2, strict=True)
    ):
        raise ctx.fail(
            f"pads {[*win.pads_begin, *win.pads_end]} must be smaller than kernel_shape "
            f"{list(win.kernel_shape)}"
        )
    out_sp = window_outputs(ctx, x.shape[2:], win, bool(ceil_mode))
    names = spatial_names(rank)
    dims = [("n", x.shape[0]), ("c", x.shape[1]), *zip(names, out_sp, strict=True)]
    dims += [(f"k{n}", k) for n, k in zip(names, win.kernel_shape, strict=True)]
    x_axes = (identity(0), identity(1), *window_axes(2, 2 + rank, win))
    pad_value = float("-inf") if kind is PoolKind.MAX else 0.0
    attrs = PoolAttrs(
        kind,
        win.kernel_shape,
        win.strides,
        win.dilations,
        win.pads_begin,
        win.pads_end,
        bool(ceil_mode),
        bool(include),
    )
    operands = [Operand(x.name, x_axes, pad_value=pad_value)]
    return make_op(ctx, operands, attrs, dims, range(2 + rank), 1)


def convert_maxpool(
    ctx: NodeContext,
    *,
    auto_pad="NOTSET",
    ceil_mode=0,
    dilations=None,
    kernel_shape=None,
    pads=None,
    storage_order=0,
    strides=None,
):
    del storage_order  # only affects the Indices output, which is refused
    return _convert(
        ctx, PoolKind.MAX, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, 0
    )


def convert_averagepool(
    ctx: NodeContext,
    *,
    auto_pad="NOTSET",
    ceil_mode=0,
    count_include_pad=0,
    dilations=None,
    kernel_shape=None,
    pads=None,
    strides=None,
):
    return _convert(
        ctx,
        PoolKind.AVERAGE,
        kernel_shape,
        strides,
        dilations,
        pads,
        auto_pad,
        ceil_mode,
        count_include_pad,
    )


def _out_spatial(attrs: PoolAttrs, x, args: TaskArgs, op: str) -> tuple[int, ...]:
    out_spatial = tuple(args.out_shape[2:])
    check_window_buffer(op, attrs, x.shape, out_spatial)
    return out_spatial


def _gather(xp, attrs: PoolAttrs, x, out_spatial):
    """(taps, n, c, *out): every window's elements, one strided copy per kernel position
    (row-major), so that the arithmetic runs on contiguous arrays, where numpy is many
    times faster than on short strided rows."""
    shape = (*x.shape[:2], *out_spatial)
    taps = math.prod(attrs.kernel_shape)
    windows = xp.empty((taps, *shape), dtype=x.dtype)
    for t, sl in enumerate(window_taps(attrs, out_spatial)):
        windows[t] = x[(*_LEAD, *sl)]
    return windows


def _window_max(xp, windows):
    best = windows[0].copy()
    for tap in windows[1:]:
        xp.maximum(best, tap, out=best)
    return best


def _disjoint(attrs: PoolAttrs) -> bool:
    """No two kernel positions of any windows read the same buffer element: each tap's
    gradient can be assigned instead of accumulated."""
    return all(
        s >= (k - 1) * d + 1
        for k, s, d in zip(attrs.kernel_shape, attrs.strides, attrs.dilations, strict=True)
    )


def _tiled(attrs: PoolAttrs, buffer, out_spatial) -> bool:
    """The windows cover the whole buffer, each element once: no zero fill is needed."""
    return all(
        s == k and d == 1 and b == o * k
        for k, s, d, b, o in zip(
            attrs.kernel_shape, attrs.strides, attrs.dilations, buffer, out_spatial, strict=True
        )
    )


def maxpool_forward(xp, attrs: PoolAttrs, inputs, args):
    x = inputs[0]
    taps = window_taps(attrs, _out_spatial(attrs, x, args, "MaxPool"))
    best = x[(*_LEAD, *next(taps))].copy()
    for sl in taps:  # in place: no array per tap
        xp.maximum(best, x[(*_LEAD, *sl)], out=best)
    return best


def maxpool_backward(xp, attrs: PoolAttrs, inputs, output, grad_output, args):
    """Each window's gradient goes to its first maximal tap in row-major kernel order, as
    a task holding the whole tensor would pick it: ties are common (a window of zeros
    after a ReLU). Scanning the taps in that order, ``rest`` holds the gradient of the
    windows whose maximum has not been met yet; ``rest * hit`` is exact (x * 1, x * 0)."""
    x = inputs[0]
    out_spatial = _out_spatial(attrs, x, args, "MaxPool")
    windows = _gather(xp, attrs, x, out_spatial)
    best = _window_max(xp, windows)  # the same bits as the forward's output
    rest = grad_output.copy()
    hit = xp.empty(best.shape, dtype=bool)
    disjoint = _disjoint(attrs)
    tiled = disjoint and _tiled(attrs, x.shape[2:], out_spatial)
    grad_x = xp.empty_like(x) if tiled else xp.zeros_like(x)
    for share, sl in zip(windows, window_taps(attrs, out_spatial), strict=True):
        xp.equal(share, best, out=hit)
        xp.multiply(rest, hit, out=share)  # the tap's values are no longer needed
        rest -= share
        if disjoint:
            grad_x[(*_LEAD, *sl)] = share
        else:
            grad_x[(*_LEAD, *sl)] += share
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


def _divisor(xp, attrs: PoolAttrs, x, out_spatial, valid):
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


def _wide(attrs: PoolAttrs, out_spatial) -> bool:
    """Stride 1 everywhere: each tap is one run of the flat buffer (flat_shifts)."""
    return all(s == 1 for s in attrs.strides) and 0 not in out_spatial


def _corner(out_spatial) -> tuple[slice, ...]:
    """The outputs within a grid the size of the buffer (the wide layout)."""
    return (*_LEAD, *(slice(o) for o in out_spatial))


def averagepool_forward(xp, attrs: PoolAttrs, inputs, args):
    x = inputs[0]
    out_spatial = _out_spatial(attrs, x, args, "AveragePool")
    if _wide(attrs, out_spatial):
        flat = x.reshape(-1)
        total = flat.copy()  # the first shift is 0
        for off in flat_shifts(attrs, x.shape[2:])[1:]:
            total[: flat.size - off] += flat[off:]  # the rest is garbage
        total = xp.ascontiguousarray(total.reshape(x.shape)[_corner(out_spatial)])
    else:
        taps = window_taps(attrs, out_spatial)
        total = x[(*_LEAD, *next(taps))].copy()
        for sl in taps:
            total += x[(*_LEAD, *sl)]
    total /= _divisor(xp, attrs, x, out_spatial, args.valid[0])
    return total


def averagepool_backward(xp, attrs: PoolAttrs, inputs, output, grad_output, args):
    x = inputs[0]
    out_spatial = _out_spatial(attrs, x, args, "AveragePool")
    share = grad_output / _divisor(xp, attrs, x, out_spatial, args.valid[0])
    # x's shape and dtype alone (Saved): its values do not enter the gradient
    if _wide(attrs, out_spatial):
        grid = xp.zeros(x.shape, dtype=x.dtype)  # the garbage positions have no gradient
        grid[_corner(out_spatial)] = share
        share = grid.reshape(-1)
        grad_x = share.copy()  # the first shift is 0
        for off in flat_shifts(attrs, x.shape[2:])[1:]:
            grad_x[off:] += share[: share.size - off]
        return (grad_x.reshape(x.shape),)
    grad_x = xp.zeros(x.shape, dtype=x.dtype)
    for sl in window_taps(attrs, out_spatial):
        grad_x[(*_LEAD, *sl)] += share
    return (grad_x,)


def _avg(id: str, shape, opset: int = 17, **attrs) -> object:
    return case(id, "AveragePool", X(*shape), opset=opset, **attrs)


def maxpool_workspace(attrs: PoolAttrs, shapes, out_shape, itemsize: int) -> tuple[int, int]:
    """The backward's copies of every tap, the window maxima, the gradient still to
    place and a mask (the forward writes only its output)."""
    out = math.prod(out_shape)
    return 0, (math.prod(attrs.kernel_shape) + 2) * out * itemsize + out


def averagepool_workspace(attrs: PoolAttrs, shapes, out_shape, itemsize: int) -> tuple[int, int]:
    """The divided output gradient; with stride 1 the whole-buffer sums (forward) and
    the gradient spread on a grid the size of X (backward)."""
    grid = math.prod(shapes[0]) if _wide(attrs, tuple(out_shape[2:])) else 0
    return grid * itemsize, (math.prod(out_shape) + grid) * itemsize


MAXPOOL = OpDef(
    name="MaxPool",
    versions=(12, 22),
    convert=convert_maxpool,
    forward=maxpool_forward,
    backward=maxpool_backward,
    saves=SAVES_INPUTS,  # x: the windows' first maxima are found again
    workspace=maxpool_workspace,
    cases=tuple(
        case(id, "MaxPool", X(*shape), sample=Sample.DISTINCT, **attrs)
        for id, shape, attrs in (
            ("maxpool2d", (2, 3, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)),
            (
                "maxpool2d_ceil",
                (1, 2, 8, 7),
                dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1], ceil_mode=1),
            ),
            (
                "maxpool2d_dilated",
                (1, 2, 9, 8),
                dict(kernel_shape=[2, 3], strides=[1, 2], dilations=[3, 2], pads=[1, 2, 0, 1]),
            ),
            (
                "maxpool1d_same",
                (2, 3, 10),
                dict(kernel_shape=[4], strides=[3], auto_pad="SAME_LOWER"),
            ),
            ("maxpool3d", (1, 2, 5, 4, 5), dict(kernel_shape=[2, 2, 3], strides=[2, 1, 2])),
            # disjoint windows tiling the buffer: the gradient is assigned, not added
            ("maxpool2d_tiled", (2, 3, 8, 6), dict(kernel_shape=[2, 2], strides=[2, 2])),
        )
    ),
)

AVERAGEPOOL = OpDef(
    name="AveragePool",
    versions=(11, 19, 22),
    convert=convert_averagepool,
    forward=averagepool_forward,
    backward=averagepool_backward,
    saves=SAVES_NOTHING,  # x's shape only
    workspace=averagepool_workspace,
    cases=(
        _avg("avgpool2d", (2, 3, 7, 7), kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4),
        _avg(
            "avgpool2d_include_pad",
            (2, 2, 7, 6),
            kernel_shape=[3, 2],
            strides=[2, 1],
            pads=[1, 1, 2, 0],
            count_include_pad=1,
        ),
        _avg(
            "avgpool2d_ceil",
            (1, 2, 8, 6),
            kernel_shape=[3, 3],
            strides=[2, 2],
            pads=[1, 0, 1, 1],
            ceil_mode=1,
        ),
        _avg(
            "avgpool2d_ceil_include_pad",
            (1, 2, 8, 6),
            kernel_shape=[3, 3],
            strides=[2, 2],
            pads=[1, 0, 1, 1],
            ceil_mode=1,
            count_include_pad=1,
        ),
        _avg(
            "avgpool2d_dilated",
            (1, 2, 9, 8),
            opset=19,
            kernel_shape=[2, 3],
            strides=[2, 1],
            dilations=[2, 2],
            pads=[1, 2, 1, 1],
            count_include_pad=1,
        ),
        _avg(
            "avgpool2d_dilated_ceil",
            (1, 2, 9, 8),
            opset=19,
            kernel_shape=[2, 2],
            strides=[2, 3],
            dilations=[2, 3],
            pads=[1, 1, 1, 0],
            ceil_mode=1,
        ),
        _avg(
            "avgpool1d_same_include_pad",
            (2, 3, 10),
            kernel_shape=[4],
            strides=[3],
            auto_pad="SAME_UPPER",
            count_include_pad=1,
        ),
        _avg("avgpool3d", (1, 2, 5, 4, 5), kernel_shape=[2, 2, 3], pads=[0, 1, 1] * 2),
        # stride 1: taps are runs of the flat buffer
        _avg("avgpool2d_stride1", (2, 3, 6, 5), kernel_shape=[3, 3], pads=[1] * 4),
    ),
)

DEFINITIONS = (MAXPOOL, AVERAGEPOOL)
