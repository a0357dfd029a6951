"""LayerNormalization (opset 17): ``Y = (X - mean) / sqrt(var + epsilon) * Scale + B``, the
mean and the biased variance taken over the normalized axes ``[axis, rank)``.

X's and the parameters' maps are ``onnx2soap.ops.normalized``'s: the normalized axes
hidden (never split), every leading axis (the batch first) split freely. Normalizing over
the batch axis is allowed: it is then hidden like any normalized axis, never split.

Only the first output is computed: a read Mean or InvStdDev output is refused by the
importer (``stash_type`` 1, what exporters write, is the only precision accepted: the
statistics are computed in the run's float dtype).

The backward reads X, the scale and each row's mean and inverse deviation, which the
forward leaves in ``TaskArgs.stash`` (two numbers a row, ``stash_bytes``); where no one
keeps them (the op tests, the ONNX backend) they are remade from X.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx2soap.ops.base import OpDef, Sample, Saved, W, X, case, output_copies
from onnx2soap.ops.context import NodeContext, axis_names, make_op
from onnx2soap.ops.kernel_util import unbroadcast
from onnx2soap.ops.normalized import normalized_axis, param_operand, x_operand

# mean, subtract, square, mean, add, rsqrt, multiply, scale, shift
_FLOPS_PER_POINT = 9


@dataclass(frozen=True)
class LayerNormAttrs:
    axis: int  # non-negative, >= 1 (never the batch)
    epsilon: float


def convert(ctx: NodeContext, *, axis=-1, epsilon=1e-5, stash_type=1):
    x = ctx.tensor(0)
    scale = ctx.tensor(1)
    bias = ctx.optional(2)
    axis = normalized_axis(ctx, x, axis, epsilon, stash_type)
    operands = [x_operand(x, axis), param_operand(ctx, "Scale", 1, scale, x.shape, axis)]
    if bias is not None:
        operands.append(param_operand(ctx, "B", 2, bias, x.shape, axis))
    rank = len(x.shape)
    dims = list(zip(axis_names(rank), x.shape, strict=True))
    attrs = LayerNormAttrs(axis, float(epsilon))
    return make_op(ctx, operands, attrs, dims, range(rank), _FLOPS_PER_POINT)


def _centered(xp, attrs: LayerNormAttrs, x):
    """(x - mean, mean, 1 / sqrt(var + epsilon)), the statistics over the normalized
    axes, one each a row (kept dims; two passes: stable)."""
    axes = tuple(range(attrs.axis, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    centered = x - mean
    inv = 1 / xp.sqrt((centered * centered).mean(axis=axes, keepdims=True) + attrs.epsilon)
    return centered, mean, inv


def forward(xp, attrs: LayerNormAttrs, inputs, args):
    # made in place in the centered x: one array beside it, the square, for a moment
    centered, mean, inv = _centered(xp, attrs, inputs[0])
    if args.stash is not None:  # the executor keeps them for the backward
        args.stash["mean"], args.stash["inv"] = mean, inv
    y = xp.multiply(centered, inv, out=centered)  # xhat
    y *= inputs[1]  # the parameters broadcast to y
    if len(inputs) > 2:
        y += inputs[2]
    return y


def backward(xp, attrs: LayerNormAttrs, inputs, output, grad_output, args):
    # With g = dL/dxhat = dy * scale and n the normalized size:
    # dx = inv * (g - mean(g) - xhat * mean(g * xhat)); made in place in g, holding
    # xhat and one product beside it.
    x, scale = inputs[0], inputs[1]
    axes = tuple(range(attrs.axis, x.ndim))
    stash = args.stash or {}
    mean, inv = stash.get("mean"), stash.get("inv")
    if mean is None or inv is None:  # no one kept them (op tests, the ONNX backend)
        xhat, _, inv = _centered(xp, attrs, x)
    else:
        xhat = x - mean
    xhat *= inv
    product = grad_output * xhat
    grads = [None, unbroadcast(xp, product, scale.shape)]
    if len(inputs) > 2:
        grads.append(unbroadcast(xp, grad_output, inputs[2].shape))
    g = grad_output * scale
    xhat *= xp.multiply(g, xhat, out=product).mean(axis=axes, keepdims=True)
    del product
    g -= g.mean(axis=axes, keepdims=True)
    g -= xhat
    del xhat
    g *= inv
    grads[0] = g
    return tuple(grads)


def stash_bytes(attrs: LayerNormAttrs, out_shape: tuple[int, ...], itemsize: int) -> int:
    """The mean and the inverse deviation the forward keeps for the backward: two
    numbers a row."""
    return 2 * math.prod(out_shape[: attrs.axis]) * itemsize


def _ln(id: str, *inputs, **kw):
    return case(id, "LayerNormalization", *inputs, **kw)


LAYER_NORMALIZATION = OpDef(
    name="LayerNormalization",
    versions=(17,),
    convert=convert,
    forward=forward,
    backward=backward,
    saves=Saved(inputs=(0, 1), output=False),  # x and the scale; B's shape only
    # tracemalloc, numpy, tiles of 128 K to 2 M elements: the forward's square beside
    # the centered x it makes its output in; the backward holds xhat and one product
    # beside dx
    workspace=output_copies(1.1, 2.1),
    stashes=True,
    stash_bytes=stash_bytes,
    cases=(
        _ln("layernorm_last", X(3, 4, 6), W(6), W(6)),
        _ln("layernorm_no_bias", X(2, 3, 5), W(5)),
        # No case with B given as '' (NONE): onnxruntime 1.32 segfaults on it.
        _ln("layernorm_epsilon", X(2, 3, 5), W(5), W(5), epsilon=1e-3),
        _ln("layernorm_two_axes", X(2, 3, 4, 5), W(4, 5), W(4, 5), axis=2),
        _ln("layernorm_negative_axis", X(3, 2, 3, 4), W(3, 4), W(4), axis=-2),
        # Scale broadcast along the first normalized axis, bias along the last.
        _ln("layernorm_broadcast_params", X(2, 3, 4), W(1, 4), W(3, 1), axis=1),
        _ln("layernorm_2d", X(4, 6), W(6), W(6), axis=1, stash_type=1),
        _ln("layernorm_distinct", X(2, 7), W(7), W(7), sample=Sample.DISTINCT),
    ),
)

DEFINITIONS = (LAYER_NORMALIZATION,)
