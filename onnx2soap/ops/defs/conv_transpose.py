"""ConvTranspose: N-d grouped transposed convolution as a GEMM then a col2im scatter.

Input position ``i`` and kernel tap ``k`` write output position
``y = i * stride + k * dilation - pad_begin``. An access map gives an operand index as a
function of the iteration dims, and the input index ``(y + pad_begin - k * dilation) /
stride`` is not affine (nor integral), so the input's spatial axes are read
``Whole(dims=(output spatial dim, kernel dim))``: spatial dims are never split, and every
task computes its whole spatial output from the whole input. Batch and output channels
split: with ``group == 1`` output channel ``m`` reads W[:, m] (an identity); a depthwise
ConvTranspose (one input and one output channel per group) reads input channel ``m``.
Other grouped ConvTransposes read a channel range and a W column that depend on the
output channel's group, which no affine map expresses: their channels are not split.

W's layout is ``(C_in, C_out / group, k...)``. The forward is one batched matmul per group
giving, for every input position, its contribution at every tap, scattered into a canvas
of the full (unpadded) output with one strided slice per tap (``window_taps`` with the
input as the "output" of a window: ``i * stride + k * dilation``); the pads are cropped.
The backward gathers the same strided slices of the gradient (a convolution).

Pads follow the ONNX spec (onnxruntime agrees): explicit pads; or ``output_shape``, whose
total padding is split with the odd one at the end for SAME_UPPER and at the beginning
otherwise; or SAME_UPPER/SAME_LOWER, meaning ``output_shape = input * stride``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx2soap.ir import AxisMap, Operand, Whole, identity
from onnx2soap.ops.base import OpDef, Saved, W, X, case
from onnx2soap.ops.context import NodeContext, make_op, spatial_names, text
from onnx2soap.ops.kernel_util import window_taps
from onnx2soap.ops.windows import int_list


@dataclass(frozen=True)
class ConvTransposeAttrs:
    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    output_padding: tuple[int, ...]
    group: int = 1
    depthwise: bool = False  # one input and one output channel per group: channels split


def _full(in_size: int, k: int, s: int, d: int, adj: int) -> int:
    """The transposed convolution's output length before the pads are cropped."""
    return s * (in_size - 1) + (k - 1) * d + 1 + adj


def _pads(
    ctx: NodeContext,
    in_sp,
    kernel,
    strides,
    dilations,
    adj,
    *,
    pads,
    auto_pad: str,
    output_shape,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(pads_begin, pads_end) per the spec's precedence: output_shape, then auto_pad,
    then explicit pads."""
    rank = len(in_sp)
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise ctx.fail(f"auto_pad '{auto_pad}' is not one of NOTSET, VALID, SAME_UPPER, SAME_LOWER")
    implied = ""
    if output_shape is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        implied = f" (input x strides, from auto_pad {auto_pad})"
        output_shape = tuple(i * s for i, s in zip(in_sp, strides, strict=True))
    if output_shape is None:
        if auto_pad == "VALID":
            return (0,) * rank, (0,) * rank
        flat = int_list(ctx, "pads", pads, 2 * rank, 0, 0)
        return flat[:rank], flat[rank:]
    out = int_list(ctx, "output_shape", output_shape, rank, 1, 1)
    begin, end = [], []
    for o, i, k, s, d, a in zip(out, in_sp, kernel, strides, dilations, adj, strict=True):
        total = _full(i, k, s, d, a) - o
        if total < 0:
            raise ctx.fail(
                f"output_shape {list(out)}{implied} needs negative padding on axis "
                f"{len(begin)} (its full transposed output is {o + total}); only cropping is "
                "supported "
                "(onnxruntime and the spec disagree on larger outputs)"
            )
        small, big = total // 2, total - total // 2
        upper = auto_pad == "SAME_UPPER"
        begin.append(small if upper else big)
        end.append(big if upper else small)
    return tuple(begin), tuple(end)


def convert(
    ctx: NodeContext,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    output_padding=None,
    output_shape=None,
    pads=None,
    strides=None,
):
    x, w, b = ctx.tensor(0), ctx.tensor(1), ctx.optional(2)
    rank = len(x.shape) - 2
    if rank < 1 or rank > 3 or len(w.shape) != rank + 2:
        raise ctx.fail(
            f"X {list(x.shape)} and W {list(w.shape)} are not a 1-3 d ConvTranspose pair "
            "(X: N, C, spatial...; W: C, M / group, kernel...)"
        )
    in_sp = x.shape[2:]
    kernel = w.shape[2:]
    if kernel_shape:
        kernel = int_list(ctx, "kernel_shape", kernel_shape, rank, 1, 1)
    if tuple(kernel) != tuple(w.shape[2:]):
        raise ctx.fail(f"kernel_shape {list(kernel)} disagrees with W {list(w.shape)}")
    strides = int_list(ctx, "strides", strides, rank, 1, 1)
    dilations = int_list(ctx, "dilations", dilations, rank, 1, 1)
    adj = int_list(ctx, "output_padding", output_padding, rank, 0, 0)
    if any(a >= max(s, d) for a, s, d in zip(adj, strides, dilations, strict=True)):
        raise ctx.fail(
            f"output_padding {list(adj)} must be smaller than the stride {list(strides)} or "
            f"the dilation {list(dilations)} of its axis"
        )
    begin, end = _pads(
        ctx,
        in_sp,
        kernel,
        strides,
        dilations,
        adj,
        pads=pads,
        auto_pad=text(auto_pad),
        output_shape=output_shape,
    )
    out_sp = tuple(
        _full(i, k, s, d, a) - pb - pe
        for i, k, s, d, a, pb, pe in zip(
            in_sp, kernel, strides, dilations, adj, begin, end, strict=True
        )
    )
    if any(o < 1 for o in out_sp):
        raise ctx.fail(f"the pads {[*begin, *end]} leave an empty output {list(out_sp)}")
    c_in, m_per_group = w.shape[0], w.shape[1]
    if group < 1 or x.shape[1] != c_in or c_in % group or m_per_group < 1:
        raise ctx.fail(
            f"channels of X {list(x.shape)} and W {list(w.shape)} vs group {group}: W must be "
            "(C, M / group, kernel...) with C divisible by group"
        )
    m = m_per_group * group
    ci = c_in // group
    if b is not None and b.shape != (m,):
        raise ctx.fail(f"B {list(b.shape)} must be [{m}] (one bias per output channel)")
    names = spatial_names(rank)
    # dims: n, m, spatial outputs..., ci (input channels per group), kernel positions...
    dims = [("n", x.shape[0]), ("m", m), *zip(names, out_sp, strict=True), ("ci", ci)]
    dims += [(f"k{n}", k) for n, k in zip(names, kernel, strict=True)]
    CI, K0 = 2 + rank, 3 + rank
    depthwise = group > 1 and ci == 1 and m_per_group == 1
    x_channel: AxisMap
    w_in: AxisMap
    w_out: AxisMap
    if group == 1:
        x_channel, w_in, w_out = identity(CI), identity(CI), identity(1)
    elif depthwise:  # output channel m reads input channel m and W[m, 0]
        x_channel, w_in, w_out = identity(1), identity(1), identity(CI)
    else:  # the group of output channel m picks the channels: not affine
        x_channel = w_in = w_out = Whole(dims=(1,))
    spatial = tuple(Whole(dims=(2 + i, K0 + i)) for i in range(rank))
    x_axes = (identity(0), x_channel, *spatial)
    w_axes = (w_in, w_out, *(identity(K0 + i) for i in range(rank)))
    operands = [Operand(x.name, x_axes), Operand(w.name, w_axes)]
    if b is not None:
        operands.append(Operand(b.name, (identity(1),)))
    attrs = ConvTransposeAttrs(
        tuple(kernel), strides, dilations, begin, end, adj, int(group), depthwise
    )
    # The nest spans output positions, but the work is one multiply-add per *input*
    # position and tap: scale so that the nest's FLOPs match.
    flops = max(1, round(2 * math.prod(in_sp) / math.prod(out_sp)))
    return make_op(ctx, operands, attrs, dims, range(2 + rank), flops)


@dataclass(frozen=True)
class _Layout:
    """The sizes of one task's transposed convolution, from its buffers."""

    n: int
    groups: int
    c_in: int  # input channels per group
    c_out: int  # output channels per group, in this task
    taps: int
    in_spatial: tuple[int, ...]

    @property
    def points(self) -> int:
        return math.prod(self.in_spatial)


def _layout(attrs: ConvTransposeAttrs, x, w) -> _Layout:
    # A split depthwise ConvTranspose holds only its channels' groups; otherwise the
    # buffers hold every input channel (group == 1: one group).
    groups = x.shape[1] if attrs.depthwise else attrs.group
    if x.shape[1] != w.shape[0] or x.shape[1] % groups:
        raise ValueError(
            f"ConvTranspose: X buffer {list(x.shape)} and W buffer {list(w.shape)} do not "
            f"hold whole channel groups (group={attrs.group})"
        )
    return _Layout(
        n=x.shape[0],
        groups=groups,
        c_in=x.shape[1] // groups,
        c_out=w.shape[1],
        taps=math.prod(attrs.kernel_shape),
        in_spatial=tuple(x.shape[2:]),
    )


def _canvas_shape(attrs: ConvTransposeAttrs, lay: _Layout, out_spatial) -> tuple[int, ...]:
    """Spatial extent holding every tap's writes and the cropped output window."""
    return tuple(
        max(_full(i, k, s, d, 0), pb + o)
        for i, k, s, d, pb, o in zip(
            lay.in_spatial,
            attrs.kernel_shape,
            attrs.strides,
            attrs.dilations,
            attrs.pads_begin,
            out_spatial,
            strict=True,
        )
    )


def _crop(attrs: ConvTransposeAttrs, out_spatial) -> tuple[slice, ...]:
    return tuple(slice(pb, pb + o) for pb, o in zip(attrs.pads_begin, out_spatial, strict=True))


def _x_groups(x, lay: _Layout):
    """(n, groups * c_in, *in) -> (groups, c_in, n * points)."""
    x = x.reshape(lay.n, lay.groups, lay.c_in, lay.points)
    return x.transpose(1, 2, 0, 3).reshape(lay.groups, lay.c_in, lay.n * lay.points)


def _w_groups(w, lay: _Layout):
    """(groups * c_in, c_out, *kernel) -> (groups, c_in, c_out * taps)."""
    return w.reshape(lay.groups, lay.c_in, lay.c_out * lay.taps)


def _taps(attrs: ConvTransposeAttrs, lay: _Layout):
    """Per tap (row-major), the canvas slices it writes for the input positions:
    ``i * stride + k * dilation``, a window whose "outputs" are the inputs."""
    return window_taps(attrs, lay.in_spatial)


def forward(xp, attrs: ConvTransposeAttrs, inputs, args):
    x, w = inputs[0], inputs[1]
    lay = _layout(attrs, x, w)
    out_spatial = tuple(args.out_shape[2:])
    # (groups, c_out * taps, n * points): every input position's value at every tap
    cols = xp.matmul(xp.swapaxes(_w_groups(w, lay), 1, 2), _x_groups(x, lay))
    cols = cols.reshape(lay.groups, lay.c_out, lay.taps, lay.n, lay.points)
    cols = cols.transpose(2, 3, 0, 1, 4).reshape(
        lay.taps, lay.n, lay.groups * lay.c_out, *lay.in_spatial
    )
    canvas = xp.zeros(
        (lay.n, lay.groups * lay.c_out, *_canvas_shape(attrs, lay, out_spatial)), dtype=x.dtype
    )
    lead = (slice(None), slice(None))
    # One strided slice per tap never repeats an index, so += is an exact scatter-add;
    # taps that overlap (stride < kernel extent) accumulate across iterations.
    for t, sl in enumerate(_taps(attrs, lay)):
        canvas[(*lead, *sl)] += cols[t]
    y = canvas[(*lead, *_crop(attrs, out_spatial))].copy()
    if len(inputs) > 2:
        y += inputs[2].reshape(1, -1, *(1 for _ in out_spatial))
    return y


def backward(xp, attrs: ConvTransposeAttrs, inputs, output, grad_output, args):
    x, w = inputs[0], inputs[1]
    lay = _layout(attrs, x, w)
    out_spatial = tuple(args.out_shape[2:])
    lead = (slice(None), slice(None))
    canvas = xp.zeros(
        (lay.n, lay.groups * lay.c_out, *_canvas_shape(attrs, lay, out_spatial)),
        dtype=grad_output.dtype,
    )
    canvas[(*lead, *_crop(attrs, out_spatial))] = grad_output
    # The gather: per tap, the gradient at the positions the input wrote.
    gcols = xp.stack([canvas[(*lead, *sl)] for sl in _taps(attrs, lay)], axis=0)
    gcols = gcols.reshape(lay.taps, lay.n, lay.groups, lay.c_out, lay.points)
    gcols = gcols.transpose(2, 3, 0, 1, 4).reshape(
        lay.groups, lay.c_out * lay.taps, lay.n * lay.points
    )
    grad_xg = xp.matmul(_w_groups(w, lay), gcols)  # (groups, c_in, n * points)
    grad_x = grad_xg.reshape(lay.groups, lay.c_in, lay.n, lay.points).transpose(2, 0, 1, 3)
    grad_x = grad_x.reshape(x.shape)
    grad_w = xp.matmul(_x_groups(x, lay), xp.swapaxes(gcols, 1, 2)).reshape(w.shape)
    grads = [grad_x, grad_w]
    if len(inputs) > 2:
        grads.append(grad_output.sum(axis=(0, *range(2, grad_output.ndim))))
    return tuple(grads)


CONV_TRANSPOSE = OpDef(
    name="ConvTranspose",
    versions=(11, 22),
    convert=convert,
    forward=forward,
    backward=backward,
    saves=Saved(inputs=(0, 1), output=False),  # X and W; the bias's shape only
    cases=(
        case("convtranspose2d", "ConvTranspose", X(2, 3, 4, 3), W(3, 4, 3, 3), W(4)),
        case(
            "convtranspose2d_strided_padded",
            "ConvTranspose",
            X(2, 2, 3, 4),
            W(2, 3, 3, 2),
            strides=[2, 3],
            pads=[1, 0, 1, 1],
        ),
        case(
            "convtranspose2d_dilated_output_padding",
            "ConvTranspose",
            X(1, 2, 3, 3),
            W(2, 2, 2, 3),
            W(2),
            strides=[2, 2],
            dilations=[2, 1],
            output_padding=[1, 1],
            pads=[0, 1, 1, 0],
        ),
        case(
            "convtranspose2d_groups",
            "ConvTranspose",
            X(2, 4, 3, 3),
            W(4, 3, 2, 2),
            W(6),
            group=2,
            strides=[2, 1],
        ),
        # depthwise with a channel multiplier: a grouped ConvTranspose, channels whole
        case(
            "convtranspose2d_channel_multiplier",
            "ConvTranspose",
            X(2, 2, 3, 3),
            W(2, 2, 2, 2),
            group=2,
            strides=[2, 2],
            pads=[0, 1, 1, 0],
        ),
        case(
            "convtranspose2d_depthwise",
            "ConvTranspose",
            X(2, 3, 3, 4),
            W(3, 1, 3, 3),
            W(3),
            group=3,
            strides=[2, 2],
            pads=[1, 1, 1, 1],
        ),
        case(
            "convtranspose2d_output_shape",
            "ConvTranspose",
            X(1, 2, 3, 3),
            W(2, 3, 3, 3),
            strides=[2, 2],
            output_shape=[6, 5],
        ),
        case(
            "convtranspose2d_output_shape_upper",
            "ConvTranspose",
            X(1, 2, 3, 3),
            W(2, 2, 3, 3),
            strides=[2, 2],
            output_padding=[1, 0],
            output_shape=[7, 5],
            auto_pad="SAME_UPPER",
        ),
        case(
            "convtranspose2d_same_upper",
            "ConvTranspose",
            X(1, 2, 3, 3),
            W(2, 2, 3, 4),
            strides=[2, 2],
            auto_pad="SAME_UPPER",
        ),
        case(
            "convtranspose2d_same_lower",
            "ConvTranspose",
            X(2, 2, 3, 2),
            W(2, 3, 3, 3),
            W(3),
            strides=[2, 2],
            auto_pad="SAME_LOWER",
        ),
        case(
            "convtranspose1d_valid",
            "ConvTranspose",
            X(2, 3, 4),
            W(3, 2, 3),
            strides=[3],
            dilations=[2],
            auto_pad="VALID",
            opset=22,
        ),
        case(
            "convtranspose3d",
            "ConvTranspose",
            X(1, 2, 2, 3, 2),
            W(2, 2, 2, 2, 3),
            W(2),
            strides=[2, 1, 2],
            pads=[0, 1, 1, 1, 0, 0],
        ),
    ),
)

DEFINITIONS = (CONV_TRANSPOSE,)
