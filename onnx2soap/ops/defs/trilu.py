"""Trilu (opset 14): keep the upper (``upper=1``) or lower triangle of each matrix over
the last two axes, relative to the diagonal ``k`` (an optional int64 constant), and zero
the rest.

Element ``(..., i, j)`` is kept iff ``j - i >= k`` (upper) or ``j - i <= k`` (lower): a
mask multiply, so the nest is elementwise (every axis an identity, every dim splits).
The mask depends on the *global* row and column, which a kernel never derives from its
local buffer: it reads them from ``TaskArgs.origin`` (the tile's first element), so any
split of the last two axes computes what one task does. The gradient is the same mask
applied to the output gradient.

A rank-2 input is accepted: its rows are then the batch, and the mask depends on the
sample's global index, which ``origin`` gives exactly as well. So are ids (a causal mask
built from integers): they keep their dtype and take no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx2soap.ops.base import NONE, SAVES_NOTHING, C, CaseInput, InputKind, OpDef, Sample, X, case
from onnx2soap.ops.context import NodeContext, elementwise


@dataclass(frozen=True)
class TriluAttrs:
    upper: bool
    k: int  # the diagonal: 0 the main one, > 0 above it, < 0 below it


def convert(ctx: NodeContext, *, upper=1):
    x = ctx.tensor(0)
    if len(x.shape) < 2:
        raise ctx.fail(f"input {list(x.shape)} has rank {len(x.shape)}; rank >= 2 required")
    if upper not in (0, 1):
        raise ctx.fail(f"upper={upper}; accepted: 0 or 1")
    k = ctx.optional_constant(1)
    if k is not None:
        if k.dtype.kind not in "iu" or k.size != 1:
            raise ctx.fail(f"k must be an int64 scalar, got {k.dtype} of shape {list(k.shape)}")
        k = int(k.reshape(()))
    return elementwise(ctx, [x], TriluAttrs(bool(upper), k or 0), 1)


def _mask(xp, attrs: TriluAttrs, args, ndim: int):
    """The kept elements of the task's tile, shaped ``[rows, cols]`` (broadcasts over the
    leading axes), from the tile's global row and column numbers."""
    if len(args.origin) != ndim:
        raise ValueError(
            f"Trilu needs the tile's global origin (rank {ndim}), got {list(args.origin)}"
        )
    rows, cols = args.out_shape[-2:]
    i = xp.arange(rows).reshape(-1, 1) + args.origin[-2]
    j = xp.arange(cols).reshape(1, -1) + args.origin[-1]
    return (j - i >= attrs.k) if attrs.upper else (j - i <= attrs.k)


def forward(xp, attrs: TriluAttrs, inputs, args):
    x = inputs[0]
    # where, not a multiply: an Inf or NaN outside the triangle still becomes 0.
    return xp.where(_mask(xp, attrs, args, x.ndim), x, xp.zeros((), dtype=x.dtype))


def backward(xp, attrs: TriluAttrs, inputs, output, grad_output, args):
    if inputs[0].dtype.kind != "f":
        return (None,)  # ids take no gradient
    g = grad_output
    return (xp.where(_mask(xp, attrs, args, g.ndim), g, xp.zeros((), dtype=g.dtype)),)


def _k(value: int):
    return C(value, dtype="int64")


TRILU = OpDef(
    name="Trilu",
    versions=(14,),
    convert=convert,
    forward=forward,
    backward=backward,
    saves=SAVES_NOTHING,  # the tile's triangle, from args; the input's dtype only
    cases=(
        case("trilu_upper", "Trilu", X(2, 4, 5)),
        case("trilu_lower", "Trilu", X(2, 5, 4), upper=0),
        case("trilu_upper_k", "Trilu", X(2, 3, 4, 5), _k(1)),
        case("trilu_upper_negative_k", "Trilu", X(2, 5, 4), _k(-2), upper=1),
        case("trilu_lower_k", "Trilu", X(2, 4, 6), _k(2), upper=0),
        case("trilu_lower_negative_k", "Trilu", X(3, 2, 5, 5), _k(-1), upper=0),
        case("trilu_k_beyond", "Trilu", X(2, 3, 4), _k(7), upper=0),
        case("trilu_omitted_k", "Trilu", X(2, 4, 4), NONE, upper=0),
        case("trilu_rank2", "Trilu", X(5, 4), _k(-1), sample=Sample.DISTINCT),
        case(
            "trilu_ids",
            "Trilu",
            CaseInput(InputKind.DATA, (2, 4, 4), None, "int64"),
            output="int64",
        ),
    ),
)

DEFINITIONS = (TRILU,)
