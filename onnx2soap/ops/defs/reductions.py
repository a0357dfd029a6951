"""ReduceSum, ReduceSumSquare, ReduceMax and ReduceMin.

As in ``reduce.py`` (ReduceMean), the reduced dims are reductions (absent from
``out_dims``), so they are never split and every task's buffer holds whole reduced
blocks; the kept dims split freely. Reducing the batch axis makes it such a reduction
too: exact, only no longer split.

ReduceMax/ReduceMin send the gradient to the *first* extremum of each reduced block, in
row-major order of the reduced axes (as our MaxPool does with its window), not spread
evenly over ties as PyTorch's amax/amin do: a deterministic choice that every split
agrees on, since a task always holds the block whole.

The axes are an attribute (ReduceMax/Min/SumSquare before opset 18) or a constant input
(ReduceSum since 13, the others since 18). With empty axes, ``noop_with_empty_axes=1``
reduces over no axis at all: the identity, or the square for ReduceSumSquare (the spec's
"composite-reduction operators still perform the non-reduction steps").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from onnx2soap.ir import Operand, identity
from onnx2soap.ops.base import NONE, C, OpDef, Sample, X, case
from onnx2soap.ops.context import NodeContext, axis_names, make_op


class ReduceKind(Enum):
    SUM = "sum"
    SUM_SQUARE = "sum-square"
    MAX = "max"
    MIN = "min"


@dataclass(frozen=True)
class ReductionAttrs:
    kind: ReduceKind
    axes: tuple[int, ...]  # non-negative, sorted, never 0; empty: reduce over no axis
    keepdims: bool = True


def _axes(ctx: NodeContext, attribute) -> list[int] | None:
    """The axes from the attribute or the constant input 1 (None if neither is given)."""
    given = ctx.optional_constant(1) if len(ctx.inputs) > 1 else None
    if attribute is not None and given is not None:
        raise ctx.fail("axes given both as an attribute and as an input; give one")
    if given is not None:
        if given.ndim != 1 or given.dtype.kind not in "iu":
            raise ctx.fail(
                f"axes input must be a 1-d integer tensor, got {given.dtype} {list(given.shape)}"
            )
        return [int(a) for a in given]
    return None if attribute is None else [int(a) for a in attribute]


def _convert(ctx: NodeContext, kind: ReduceKind, axes, keepdims: int, noop: int):
    x = ctx.tensor(0)
    rank = len(x.shape)
    if keepdims not in (0, 1) or noop not in (0, 1):
        raise ctx.fail(f"keepdims ({keepdims}) and noop_with_empty_axes ({noop}) must be 0 or 1")
    listed = _axes(ctx, axes)
    if not listed:
        # No axes: all of them, the batch included, unless noop.
        listed = [] if noop else list(range(rank))
    if any(not -rank <= a < rank for a in listed):
        raise ctx.fail(
            f"axes {listed} out of range for rank {rank} (accepted: [-{rank}, {rank - 1}])"
        )
    reduced = tuple(sorted({a + rank if a < 0 else a for a in listed}))
    if len(reduced) != len(listed):
        raise ctx.fail(f"axes {listed} name an axis twice")
    x_shape = ctx.tensor(0).shape
    if any(x_shape[a] == 0 for a in reduced):
        # An empty reduction's value (the identity: 0, -inf, +inf) is no use to training.
        raise ctx.fail(f"axes {listed} include an empty axis of input {list(x_shape)}")
    dims = list(zip(axis_names(rank), x.shape, strict=True))
    out_dims = [None if a in reduced else a for a in range(rank) if keepdims or a not in reduced]
    operands = [Operand(x.name, tuple(identity(a) for a in range(rank)))]
    flops = 2 if kind is ReduceKind.SUM_SQUARE else 1
    attrs = ReductionAttrs(kind, reduced, bool(keepdims))
    return make_op(ctx, operands, attrs, dims, out_dims, flops)


def convert_sum(ctx: NodeContext, *, keepdims=1, noop_with_empty_axes=0):
    return _convert(ctx, ReduceKind.SUM, None, keepdims, noop_with_empty_axes)


def convert_sum_square(ctx: NodeContext, *, axes=None, keepdims=1, noop_with_empty_axes=0):
    return _convert(ctx, ReduceKind.SUM_SQUARE, axes, keepdims, noop_with_empty_axes)


def convert_max(ctx: NodeContext, *, axes=None, keepdims=1, noop_with_empty_axes=0):
    return _convert(ctx, ReduceKind.MAX, axes, keepdims, noop_with_empty_axes)


def convert_min(ctx: NodeContext, *, axes=None, keepdims=1, noop_with_empty_axes=0):
    return _convert(ctx, ReduceKind.MIN, axes, keepdims, noop_with_empty_axes)


def _kept_shape(attrs: ReductionAttrs, shape) -> tuple[int, ...]:
    """The buffer's shape with the reduced axes set to 1 (the keepdims shape)."""
    return tuple(1 if a in attrs.axes else s for a, s in enumerate(shape))


def forward(xp, attrs: ReductionAttrs, inputs, args):
    x = inputs[0]
    if attrs.kind is ReduceKind.SUM_SQUARE:
        x = x * x
    if not attrs.axes:  # noop_with_empty_axes: nothing is reduced
        return x.copy() if x is inputs[0] else x
    if attrs.kind is ReduceKind.MAX:
        y = x.max(axis=attrs.axes, keepdims=True)
    elif attrs.kind is ReduceKind.MIN:
        y = x.min(axis=attrs.axes, keepdims=True)
    else:
        y = x.sum(axis=attrs.axes, keepdims=True)
    return y.reshape(args.out_shape)


def _first_extremum(xp, attrs: ReductionAttrs, x):
    """A 0/1 mask of ``x``'s shape marking, per reduced block, its first maximum (or
    minimum) in row-major order of the reduced axes. argmax/argmin return the first
    occurrence in numpy and cupy alike."""
    kept = [a for a in range(x.ndim) if a not in attrs.axes]
    order = (*kept, *attrs.axes)
    moved = x.transpose(order)
    lead = moved.shape[: len(kept)]
    flat = moved.reshape(*lead, -1)
    pick = flat.argmax(axis=-1) if attrs.kind is ReduceKind.MAX else flat.argmin(axis=-1)
    mask = (xp.arange(flat.shape[-1]) == pick[..., None]).astype(x.dtype)
    inverse = tuple(int(i) for i in np.argsort(order))
    return mask.reshape(moved.shape).transpose(inverse)


def backward(xp, attrs: ReductionAttrs, inputs, output, grad_output, args):
    x = inputs[0]
    g = grad_output.reshape(_kept_shape(attrs, x.shape))  # broadcasts over reduced axes
    if attrs.kind is ReduceKind.SUM:
        return (xp.zeros_like(x) + g,)
    if attrs.kind is ReduceKind.SUM_SQUARE:
        return (2 * x * g,)
    if not attrs.axes:  # max/min over no axis: the identity
        return (g.copy(),)
    return (_first_extremum(xp, attrs, x) * g,)


def _extremum_cases(op: str, prefix: str):
    """ReduceMax/ReduceMin cases: distinct values, so finite differences never straddle
    a tie (the split tests also draw tied data)."""
    d = Sample.DISTINCT
    return (
        case(f"{prefix}_axes_attr", op, X(2, 3, 4, 2), sample=d, axes=[2, 3]),
        case(f"{prefix}_dropped", op, X(2, 3, 4), sample=d, axes=[-1, 1], keepdims=0),
        case(f"{prefix}_middle", op, X(3, 4, 2, 3), sample=d, opset=13, axes=[1, 3]),
        case(f"{prefix}_input", op, X(2, 3, 4), C([1]), sample=d, opset=18, keepdims=0),
        case(f"{prefix}_opset20", op, X(2, 5, 3), C([-1, -2]), sample=d, opset=20),
        case(f"{prefix}_noop", op, X(2, 3), C([], shape=(0,)), opset=18, noop_with_empty_axes=1),
    )


REDUCE_SUM = OpDef(
    name="ReduceSum",
    versions=(13,),
    convert=convert_sum,
    forward=forward,
    backward=backward,
    cases=(
        case("reducesum_spatial", "ReduceSum", X(2, 3, 4, 5), C([2, 3])),
        case("reducesum_dropped", "ReduceSum", X(2, 3, 4), C([-1, 1]), opset=13, keepdims=0),
        case("reducesum_middle", "ReduceSum", X(3, 4, 2, 3), C([1]), keepdims=0),
        case("reducesum_noop_omitted", "ReduceSum", X(2, 3), noop_with_empty_axes=1),
        case(
            "reducesum_noop_empty",
            "ReduceSum",
            X(2, 3, 2),
            C([], shape=(0,)),
            opset=18,
            noop_with_empty_axes=1,
        ),
        case("reducesum_noop_none", "ReduceSum", X(2, 3), NONE, noop_with_empty_axes=1),
    ),
)

REDUCE_SUM_SQUARE = OpDef(
    name="ReduceSumSquare",
    versions=(13, 18),
    convert=convert_sum_square,
    forward=forward,
    backward=backward,
    cases=(
        case("reducesumsquare_attr", "ReduceSumSquare", X(2, 3, 4), axes=[1, 2]),
        case("reducesumsquare_dropped", "ReduceSumSquare", X(2, 3, 4), axes=[-2], keepdims=0),
        case("reducesumsquare_input", "ReduceSumSquare", X(2, 3, 4, 2), C([3, 1]), opset=18),
        # the spec: over no axis ReduceSumSquare still squares
        case(
            "reducesumsquare_noop",
            "ReduceSumSquare",
            X(2, 3),
            opset=18,
            noop_with_empty_axes=1,
        ),
    ),
)

REDUCE_MAX = OpDef(
    name="ReduceMax",
    versions=(13, 18, 20),
    convert=convert_max,
    forward=forward,
    backward=backward,
    cases=_extremum_cases("ReduceMax", "reducemax"),
)

REDUCE_MIN = OpDef(
    name="ReduceMin",
    versions=(13, 18, 20),
    convert=convert_min,
    forward=forward,
    backward=backward,
    cases=_extremum_cases("ReduceMin", "reducemin"),
)

DEFINITIONS = (REDUCE_SUM, REDUCE_SUM_SQUARE, REDUCE_MAX, REDUCE_MIN)
