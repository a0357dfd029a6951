"""RMSNormalization (opset 23): ``Y = X / sqrt(mean(X²) + epsilon) * scale``, the mean
taken over the normalized axes ``[axis, rank)``.

Read from files that write the ONNX op, and from the chains exporters write for
LLaMA-family norms (transformers' LlamaRMSNorm, T5LayerNorm), which the importer fuses
into it (``onnx2soap.importer.rms_norm``): one op keeping X for its backward where the
chain kept X, the normalized X and the statistic's pieces.

X's and the scale's maps are ``onnx2soap.ops.normalized``'s, as LayerNormalization's:
the normalized axes hidden (never split), every leading axis (the rows) split freely.
``stash_type`` 1 is the only precision accepted: the statistic is computed in the run's
float dtype. The scale may be omitted in the importer's fused domain only (a chain that
multiplies by no weight); ONNX's op requires it.

The backward reads X, the scale and each row's inverse rms, which the forward leaves in
``TaskArgs.stash`` (one number a row, ``stash_bytes``); where no one keeps one (the op
tests, the ONNX backend) it is remade from X.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from onnx2soap.ops.base import OpDef, Sample, Saved, W, X, case, output_copies
from onnx2soap.ops.context import NodeContext, axis_names, float_attribute, make_op
from onnx2soap.ops.kernel_util import unbroadcast
from onnx2soap.ops.normalized import normalized_axis, param_operand, x_operand

# square, mean, add, rsqrt, multiply, scale (per-row work counted per point, as
# LayerNormalization counts its own)
_FLOPS_PER_POINT = 6
_DEFAULT_EPSILON = float(np.float32(1e-5))  # the spec's default, as the float32 it stores


@dataclass(frozen=True)
class RMSNormAttrs:
    axis: int  # non-negative
    epsilon: float
    scaled: bool  # the scale is given


def convert(ctx: NodeContext, *, axis=-1, epsilon=_DEFAULT_EPSILON, stash_type=1):
    """ONNX's attributes; ``epsilon`` may be the float64 tensor the importer's fusion
    writes (the constant of the chain it replaced, exact)."""
    x = ctx.tensor(0)
    scale = ctx.optional(1)
    epsilon = float_attribute(epsilon)
    axis = normalized_axis(ctx, x, axis, epsilon, stash_type)
    operands = [x_operand(x, axis)]
    if scale is not None:
        operands.append(param_operand(ctx, "scale", 1, scale, x.shape, axis))
    rank = len(x.shape)
    dims = list(zip(axis_names(rank), x.shape, strict=True))
    attrs = RMSNormAttrs(axis, epsilon, scale is not None)
    return make_op(ctx, operands, attrs, dims, range(rank), _FLOPS_PER_POINT)


def _inverse_rms(xp, attrs: RMSNormAttrs, x):
    """1 / sqrt(mean(x²) + epsilon) over the normalized axes, one per row (kept dims)."""
    axes = tuple(range(attrs.axis, x.ndim))
    return 1 / xp.sqrt((x * x).mean(axis=axes, keepdims=True) + attrs.epsilon)


def forward(xp, attrs: RMSNormAttrs, inputs, args):
    x = inputs[0]
    inv = _inverse_rms(xp, attrs, x)
    if args.stash is not None:  # the executor keeps it for the backward
        args.stash["inv"] = inv
    y = x * inv
    if attrs.scaled:
        y *= inputs[1]  # in place: y is this kernel's own, and the scale broadcasts to it
    return y


def backward(xp, attrs: RMSNormAttrs, inputs, output, grad_output, args):
    # With xhat = x · inv, g = dL/dxhat = dy · scale and n the normalized size,
    # d inv / dx = -inv³ · x / n, so dx = inv · (g - xhat · mean(g · xhat)); made in
    # place, holding xhat and one product beside the gradient.
    x = inputs[0]
    inv = args.stash.get("inv") if args.stash is not None else None
    if inv is None:
        inv = _inverse_rms(xp, attrs, x)
    axes = tuple(range(attrs.axis, x.ndim))
    xhat = x * inv
    scale_grad = None
    g = grad_output
    if attrs.scaled:
        scale_grad = unbroadcast(xp, grad_output * xhat, inputs[1].shape)
        g = grad_output * inputs[1]
    xhat *= (g * xhat).mean(axis=axes, keepdims=True)
    if g is grad_output:  # never written: the step may read it after this kernel
        grad_x = g - xhat
    else:
        g -= xhat
        grad_x = g
    del xhat
    grad_x *= inv
    return (grad_x,) if scale_grad is None else (grad_x, scale_grad)


def stash_bytes(attrs: RMSNormAttrs, out_shape: tuple[int, ...], itemsize: int) -> int:
    """The inverse rms the forward keeps for the backward: one number a row."""
    return math.prod(out_shape[: attrs.axis]) * itemsize


def _rms(id: str, *inputs, **kw):
    return case(id, "RMSNormalization", *inputs, opset=23, **kw)


RMS_NORMALIZATION = OpDef(
    name="RMSNormalization",
    versions=(23,),
    convert=convert,
    forward=forward,
    backward=backward,
    saves=Saved(inputs=(0, 1), output=False),  # x and the scale
    # tracemalloc, numpy, tiles of 128 K to 2 M elements: the forward's square is gone
    # before its output is made; the backward holds xhat and one product beside dx
    workspace=output_copies(0.1, 2.1),
    stashes=True,
    stash_bytes=stash_bytes,
    cases=(
        _rms("rmsnorm_last", X(3, 4, 6), W(6)),
        _rms("rmsnorm_epsilon", X(2, 3, 5), W(5), epsilon=1e-3),
        _rms("rmsnorm_two_axes", X(2, 3, 4, 5), W(4, 5), axis=2),
        _rms("rmsnorm_negative_axis", X(3, 2, 3, 4), W(3, 4), axis=-2),
        # the scale broadcast along the first normalized axis
        _rms("rmsnorm_broadcast_scale", X(2, 3, 4), W(1, 4), axis=1),
        _rms("rmsnorm_2d", X(4, 6), W(6), axis=1, stash_type=1),
        _rms("rmsnorm_distinct", X(2, 7), W(7), sample=Sample.DISTINCT),
    ),
)

DEFINITIONS = (RMS_NORMALIZATION,)
