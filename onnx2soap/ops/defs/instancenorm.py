"""InstanceNormalization: ``y = scale * (x - mean) / sqrt(var + epsilon) + B``, the mean
and the biased variance taken per sample and channel over the spatial axes.

torch exports GroupNorm through it (legacy and dynamo alike): x reshaped to
``[N, groups, -1]``, normalized with constant scale 1 and bias 0, reshaped back, then
multiplied and shifted by GroupNorm's own weight and bias; wav2vec2's feature extractor
and conv audio classifiers are built that way.

Every output point depends on its whole spatial block, so X reads the spatial axes with
``Whole(dims=(d,))``: those dims stay kept (the output indexes them one to one) but are
never split. The batch and channel dims are identities and split freely; scale and B
are ``[C]`` weights (or the folded constants of a GroupNorm export) read by the channel
dim, which makes it a parameter dim. The statistics need no other task's data, so this
is a plain loop nest, unlike BatchNormalization's synchronized statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from onnx2soap.ir import Operand, Whole, identity
from onnx2soap.ops.base import C, OpDef, Sample, Saved, W, X, case, output_copies
from onnx2soap.ops.context import NodeContext, axis_names, make_op

# mean, subtract, square, mean, add, rsqrt, multiply, scale, shift (as LayerNormalization)
_FLOPS_PER_POINT = 9

# The spec's default, as the float32 value ONNX stores (what onnxruntime computes with).
_EPSILON = float(np.float32(1e-5))


@dataclass(frozen=True)
class InstanceNormAttrs:
    epsilon: float


def _param(ctx: NodeContext, i: int, channels: int) -> Operand:
    what = ("scale", "B")[i - 1]
    t = ctx.tensor(i)
    if not t.dtype.is_float:
        raise ctx.fail(f"{what} (input {i}) is {t.dtype.value}; a float tensor is needed")
    if t.shape != (channels,):
        raise ctx.fail(f"{what} {list(t.shape)} must be [C] = [{channels}]")
    return Operand(t.name, (identity(1),))


def convert(ctx: NodeContext, *, epsilon=_EPSILON):
    x = ctx.tensor(0)
    rank = len(x.shape)
    if not x.dtype.is_float:
        raise ctx.fail(f"input is {x.dtype.value}; a float tensor is needed")
    if rank < 3:
        raise ctx.fail(f"input {list(x.shape)} has rank {rank}; [N, C, D1, ...] (rank >= 3) needed")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ctx.fail(f"epsilon {epsilon} must be a finite number >= 0")
    x_axes = tuple(identity(d) if d < 2 else Whole(dims=(d,)) for d in range(rank))
    operands = [Operand(x.name, x_axes), _param(ctx, 1, x.shape[1]), _param(ctx, 2, x.shape[1])]
    dims = list(zip(axis_names(rank), x.shape, strict=True))
    attrs = InstanceNormAttrs(float(epsilon))
    return make_op(ctx, operands, attrs, dims, range(rank), _FLOPS_PER_POINT)


def _per_channel(p, ndim: int):
    """A ``[C]`` parameter shaped to broadcast over ``[N, C, spatial...]``."""
    return p.reshape((1, -1) + (1,) * (ndim - 2))


def _normalized(xp, attrs: InstanceNormAttrs, x):
    """(xhat, 1 / sqrt(var + epsilon)) over the spatial axes (two passes: stable)."""
    axes = tuple(range(2, x.ndim))
    centered = x - x.mean(axis=axes, keepdims=True)
    inv = 1 / xp.sqrt((centered * centered).mean(axis=axes, keepdims=True) + attrs.epsilon)
    return centered * inv, inv


def forward(xp, attrs: InstanceNormAttrs, inputs, args):
    x, scale, bias = inputs
    xhat, _ = _normalized(xp, attrs, x)
    return xhat * _per_channel(scale, x.ndim) + _per_channel(bias, x.ndim)


def backward(xp, attrs: InstanceNormAttrs, inputs, output, grad_output, args):
    # With g = dL/dxhat = dy * scale: dx = inv * (g - mean(g) - xhat * mean(g * xhat)),
    # the means over the spatial axes (LayerNormalization's formula, per sample and
    # channel); scale and B sum over the batch and the spatial axes.
    x, scale, bias = inputs
    spatial = tuple(range(2, x.ndim))
    xhat, inv = _normalized(xp, attrs, x)
    g = grad_output * _per_channel(scale, x.ndim)
    grad_x = inv * (
        g
        - g.mean(axis=spatial, keepdims=True)
        - xhat * (g * xhat).mean(axis=spatial, keepdims=True)
    )
    others = (0, *spatial)
    grad_scale = (grad_output * xhat).sum(axis=others).reshape(scale.shape)
    grad_bias = grad_output.sum(axis=others).reshape(bias.shape)
    return grad_x, grad_scale, grad_bias


def _in(id: str, *inputs, **kw):
    return case(id, "InstanceNormalization", *inputs, **kw)


def _f(*values: float):
    """A float32 constant vector: GroupNorm's folded scale of ones or bias of zeros."""
    return C(list(values), dtype="float32")


INSTANCE_NORMALIZATION = OpDef(
    name="InstanceNormalization",
    versions=(6, 22),  # 22 adds bfloat16
    convert=convert,
    forward=forward,
    backward=backward,
    saves=Saved(inputs=(0, 1), output=False),  # x and the scale; B's shape only
    # measured under tracemalloc on [8, 32, 400] and [8, 16, 20, 20] tiles: 2.1 and 3.1-4.0
    workspace=output_copies(2.2, 4.1),
    cases=(
        _in("instancenorm_1d", X(2, 3, 5), W(3), W(3)),
        _in("instancenorm_2d", X(2, 3, 4, 3), W(3), W(3), epsilon=1e-3),
        _in("instancenorm_3d", X(2, 2, 3, 2, 3), W(2), W(2), opset=22),
        # GroupNorm as torch exports it: groups as channels, scale 1 and bias 0 folded
        _in("instancenorm_groupnorm", X(3, 4, 6), _f(1, 1, 1, 1), _f(0, 0, 0, 0)),
        _in("instancenorm_distinct", X(2, 3, 7), W(3), W(3), sample=Sample.DISTINCT, opset=13),
    ),
)

DEFINITIONS = (INSTANCE_NORMALIZATION,)
