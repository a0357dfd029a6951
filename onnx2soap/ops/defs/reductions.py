"""ReduceSum, ReduceSumSquare, ReduceL1, ReduceL2, ReduceLogSum, ReduceLogSumExp,
ReduceProd, ReduceMax and ReduceMin.

As in ``reduce.py`` (ReduceMean), the reduced dims are reductions (absent from
``out_dims``), so they are never split and every task's buffer holds whole reduced
blocks; the kept dims split freely. Reducing the batch axis makes it such a reduction
too: exact, only no longer split.

ReduceMax/ReduceMin send the gradient to the *first* extremum of each reduced block, in
row-major order of the reduced axes (as our MaxPool does with its window), not spread
evenly over ties as PyTorch's amax/amin do: a deterministic choice that every split
agrees on, since a task always holds the block whole. Where a norm has a kink the
backward takes PyTorch's subgradient: ReduceL1's is ``sign(x)`` (0 at 0), ReduceL2's
``x / norm`` and 0 where the norm is 0. ReduceProd's gradient is the product of the
block's other elements, from exclusive running products: exact with zeros in the block,
where dividing the product by the element would give 0/0. ReduceLogSumExp subtracts the
block's maximum before exponentiating, so large inputs do not overflow.

The axes are an attribute (before opset 18, ReduceSum excepted) or a constant input
(ReduceSum since 13, the others since 18). With empty axes, ``noop_with_empty_axes=1``
reduces over no axis at all, but the spec's "composite-reduction operators still perform
the non-reduction steps": the identity for ReduceSum, ReduceProd, ReduceMax, ReduceMin and
ReduceLogSumExp, the square for ReduceSumSquare, ``|x|`` for ReduceL1 and ReduceL2 and
``log(x)`` for ReduceLogSum (what onnxruntime and the reference implementation compute).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from onnx2soap.ir import Operand, identity
from onnx2soap.ops.base import (
    NONE,
    SAVES_ALL,
    SAVES_INPUTS,
    SAVES_NOTHING,
    C,
    OpDef,
    Sample,
    Saved,
    X,
    case,
)
from onnx2soap.ops.context import NodeContext, axis_names, make_op


class ReduceKind(Enum):
    SUM = "sum"
    SUM_SQUARE = "sum-square"
    L1 = "l1"
    L2 = "l2"
    LOG_SUM = "log-sum"
    LOG_SUM_EXP = "log-sum-exp"
    PROD = "prod"
    MAX = "max"
    MIN = "min"


# Forward FLOPs per point of the input: the elementwise step and the sum (a log-sum-exp
# also finds the maximum, subtracts it and exponentiates).
_FLOPS = {
    ReduceKind.SUM_SQUARE: 2,
    ReduceKind.L1: 2,
    ReduceKind.L2: 2,
    ReduceKind.LOG_SUM_EXP: 4,
}


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
    attrs = ReductionAttrs(kind, reduced, bool(keepdims))
    return make_op(ctx, operands, attrs, dims, out_dims, _FLOPS.get(kind, 1))


def convert_sum(ctx: NodeContext, *, keepdims=1, noop_with_empty_axes=0):
    # ReduceSum has taken its axes as an input since opset 13: no attribute.
    return _convert(ctx, ReduceKind.SUM, None, keepdims, noop_with_empty_axes)


def _converter(kind: ReduceKind):
    def convert(ctx: NodeContext, *, axes=None, keepdims=1, noop_with_empty_axes=0):
        return _convert(ctx, kind, axes, keepdims, noop_with_empty_axes)

    return convert


def _kept_shape(attrs: ReductionAttrs, shape) -> tuple[int, ...]:
    """The buffer's shape with the reduced axes set to 1 (the keepdims shape)."""
    return tuple(1 if a in attrs.axes else s for a, s in enumerate(shape))


def _pointwise(xp, kind: ReduceKind, x):
    """The non-reduction steps alone: a reduction over no axis (noop_with_empty_axes)."""
    if kind is ReduceKind.SUM_SQUARE:
        return x * x
    if kind in (ReduceKind.L1, ReduceKind.L2):
        return xp.abs(x)
    if kind is ReduceKind.LOG_SUM:
        return xp.log(x)
    return x.copy()


def _reduce(xp, kind: ReduceKind, x, axes: tuple[int, ...]):
    """The reduction over ``axes`` (not empty), the reduced axes kept as size 1."""
    if kind is ReduceKind.MAX:
        return x.max(axis=axes, keepdims=True)
    if kind is ReduceKind.MIN:
        return x.min(axis=axes, keepdims=True)
    if kind is ReduceKind.PROD:
        return x.prod(axis=axes, keepdims=True)
    if kind is ReduceKind.LOG_SUM_EXP:
        # max + log(sum(exp(x - max))): no overflow. A block whose maximum is infinite
        # shifts by 0 instead (inf - inf would be NaN): +inf stays +inf, all -inf gives
        # log(0) = -inf, as the spec's formula does.
        top = x.max(axis=axes, keepdims=True)
        top = xp.where(xp.isfinite(top), top, xp.zeros_like(top))
        return top + xp.log(xp.exp(x - top).sum(axis=axes, keepdims=True))
    if kind in (ReduceKind.SUM_SQUARE, ReduceKind.L2):
        total = (x * x).sum(axis=axes, keepdims=True)
        return xp.sqrt(total) if kind is ReduceKind.L2 else total
    if kind is ReduceKind.L1:
        return xp.abs(x).sum(axis=axes, keepdims=True)
    total = x.sum(axis=axes, keepdims=True)
    return xp.log(total) if kind is ReduceKind.LOG_SUM else total


def forward(xp, attrs: ReductionAttrs, inputs, args):
    x = inputs[0]
    if not attrs.axes:  # noop_with_empty_axes: nothing is reduced
        return _pointwise(xp, attrs.kind, x)
    return _reduce(xp, attrs.kind, x, attrs.axes).reshape(args.out_shape)


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


def _blocks(attrs: ReductionAttrs, x):
    """``x`` with the reduced axes moved last and flattened into one: ``[..., K]``, one row
    per reduced block, and the order that moved them (to move them back)."""
    kept = [a for a in range(x.ndim) if a not in attrs.axes]
    order = (*kept, *attrs.axes)
    moved = x.transpose(order)
    return moved.reshape(*moved.shape[: len(kept)], -1), moved.shape, order


def _unblock(flat, moved_shape, order):
    """The inverse of ``_blocks``: a ``[..., K]`` array back in the input's layout."""
    inverse = tuple(int(i) for i in np.argsort(order))
    return flat.reshape(moved_shape).transpose(inverse)


def _first_extremum(xp, attrs: ReductionAttrs, x):
    """A 0/1 mask of ``x``'s shape marking, per reduced block, its first maximum (or
    minimum) in row-major order of the reduced axes. argmax/argmin return the first
    occurrence in numpy and cupy alike."""
    flat, moved_shape, order = _blocks(attrs, x)
    pick = flat.argmax(axis=-1) if attrs.kind is ReduceKind.MAX else flat.argmin(axis=-1)
    mask = (xp.arange(flat.shape[-1]) == pick[..., None]).astype(x.dtype)
    return _unblock(mask, moved_shape, order)


def _product_of_others(xp, attrs: ReductionAttrs, x):
    """Per element, the product of the other elements of its reduced block: the running
    product before it times the one after it (both exclusive), so zeros need no care."""
    flat, moved_shape, order = _blocks(attrs, x)
    one = xp.ones_like(flat[..., :1])
    before = xp.concatenate([one, xp.cumprod(flat[..., :-1], axis=-1)], axis=-1)
    backwards = flat[..., ::-1]
    after = xp.concatenate([one, xp.cumprod(backwards[..., :-1], axis=-1)], axis=-1)[..., ::-1]
    return _unblock(before * after, moved_shape, order)


def backward(xp, attrs: ReductionAttrs, inputs, output, grad_output, args):
    x, kind = inputs[0], attrs.kind
    kept = _kept_shape(attrs, x.shape)
    g = grad_output.reshape(kept)  # broadcasts over the reduced axes
    if kind is ReduceKind.SUM or (not attrs.axes and kind in _IDENTITY_WHEN_NOOP):
        return (xp.zeros(x.shape, dtype=x.dtype) + g,)  # x's shape only
    if kind is ReduceKind.SUM_SQUARE:
        return (2 * x * g,)
    if kind is ReduceKind.L1:
        return (xp.sign(x) * g,)
    if kind is ReduceKind.L2:
        norm = output.reshape(kept)  # |x| itself over no axis: x / |x| is sign(x)
        nonzero = norm > 0
        return (xp.where(nonzero, x / xp.where(nonzero, norm, 1), 0) * g,)
    if kind is ReduceKind.LOG_SUM:
        total = x.sum(axis=attrs.axes, keepdims=True) if attrs.axes else x
        return (xp.zeros_like(x) + g / total,)
    if kind is ReduceKind.LOG_SUM_EXP:
        return (xp.exp(x - output.reshape(kept)) * g,)  # the block's softmax
    if kind is ReduceKind.PROD:
        return (_product_of_others(xp, attrs, x) * g,)
    return (_first_extremum(xp, attrs, x) * g,)


# Reductions whose non-reduction step is the identity: over no axis their gradient is too.
_IDENTITY_WHEN_NOOP = (
    ReduceKind.PROD,
    ReduceKind.LOG_SUM_EXP,
    ReduceKind.MAX,
    ReduceKind.MIN,
)


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
    saves=SAVES_NOTHING,  # x's shape only
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
    convert=_converter(ReduceKind.SUM_SQUARE),
    forward=forward,
    backward=backward,
    saves=SAVES_INPUTS,  # 2 x
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
    convert=_converter(ReduceKind.MAX),
    forward=forward,
    backward=backward,
    saves=SAVES_INPUTS,  # x: each block's first maximum is found again
    cases=_extremum_cases("ReduceMax", "reducemax"),
)

REDUCE_MIN = OpDef(
    name="ReduceMin",
    versions=(13, 18, 20),
    convert=_converter(ReduceKind.MIN),
    forward=forward,
    backward=backward,
    saves=SAVES_INPUTS,
    cases=_extremum_cases("ReduceMin", "reducemin"),
)


def _reduction(
    name: str, kind: ReduceKind, versions: tuple[int, ...], *cases, saves: Saved
) -> OpDef:
    return OpDef(
        name=name,
        versions=versions,
        convert=_converter(kind),
        forward=forward,
        backward=backward,
        cases=cases,
        saves=saves,
    )


AWAY = Sample.AWAY_FROM_ZERO
POSITIVE = Sample.POSITIVE
EMPTY = C([], shape=(0,))

REDUCE_L1 = _reduction(
    "ReduceL1",
    ReduceKind.L1,
    (13, 18),
    # |x| has a kink at 0: the data stays away from it
    case("reducel1_attr", "ReduceL1", X(2, 3, 4), sample=AWAY, axes=[1, 2]),
    case("reducel1_dropped", "ReduceL1", X(2, 3, 4), sample=AWAY, axes=[-1], keepdims=0),
    case("reducel1_input", "ReduceL1", X(3, 2, 4), C([1]), sample=AWAY, opset=18),
    case(
        "reducel1_noop", "ReduceL1", X(2, 3), EMPTY, sample=AWAY, opset=18, noop_with_empty_axes=1
    ),
    saves=SAVES_INPUTS,  # sign(x)
)

REDUCE_L2 = _reduction(
    "ReduceL2",
    ReduceKind.L2,
    (13, 18),
    case("reducel2_attr", "ReduceL2", X(2, 3, 4), axes=[2]),
    case("reducel2_dropped", "ReduceL2", X(2, 3, 4, 2), axes=[1, 3], keepdims=0),
    # wav2vec2's weight norm: the norm over every axis but one, keepdims, axes an input
    case("reducel2_input", "ReduceL2", X(3, 4, 2), C([0, 2]), opset=18),
    case(
        "reducel2_noop", "ReduceL2", X(2, 3), EMPTY, sample=AWAY, opset=18, noop_with_empty_axes=1
    ),
    saves=SAVES_ALL,  # x / |x|: x and the norm
)

REDUCE_LOG_SUM = _reduction(
    "ReduceLogSum",
    ReduceKind.LOG_SUM,
    (13, 18, 28),  # 28 removes the integer types
    case("reducelogsum_attr", "ReduceLogSum", X(2, 3, 4), sample=POSITIVE, axes=[1]),
    case(
        "reducelogsum_dropped", "ReduceLogSum", X(2, 3, 4), sample=POSITIVE, axes=[1, 2], keepdims=0
    ),
    case("reducelogsum_input", "ReduceLogSum", X(2, 5), C([-1]), sample=POSITIVE, opset=18),
    case(
        "reducelogsum_noop",
        "ReduceLogSum",
        X(2, 3),
        EMPTY,
        sample=POSITIVE,
        opset=18,
        noop_with_empty_axes=1,
    ),
    saves=SAVES_INPUTS,  # 1 / sum(x)
)

REDUCE_LOG_SUM_EXP = _reduction(
    "ReduceLogSumExp",
    ReduceKind.LOG_SUM_EXP,
    (13, 18, 28),  # 28 removes the integer types
    case("reducelogsumexp_attr", "ReduceLogSumExp", X(2, 3, 4), axes=[2]),
    case("reducelogsumexp_dropped", "ReduceLogSumExp", X(2, 3, 4), axes=[0, 2], keepdims=0),
    case("reducelogsumexp_input", "ReduceLogSumExp", X(3, 4, 2), C([1, 2]), opset=18),
    # spread values (up to +-1.7): the shift by the maximum matters
    case(
        "reducelogsumexp_distinct",
        "ReduceLogSumExp",
        X(2, 24),
        C([1]),
        sample=Sample.DISTINCT,
        opset=18,
    ),
    case(
        "reducelogsumexp_noop", "ReduceLogSumExp", X(2, 3), EMPTY, opset=18, noop_with_empty_axes=1
    ),
    saves=SAVES_ALL,  # exp(x - y): x and the output
)

REDUCE_PROD = _reduction(
    "ReduceProd",
    ReduceKind.PROD,
    (13, 18),
    case("reduceprod_attr", "ReduceProd", X(2, 3, 4), axes=[1]),
    case("reduceprod_dropped", "ReduceProd", X(2, 3, 4), axes=[-1, 1], keepdims=0),
    case("reduceprod_middle", "ReduceProd", X(3, 4, 2, 3), C([1, 3]), opset=18),
    case("reduceprod_noop", "ReduceProd", X(2, 3), EMPTY, opset=18, noop_with_empty_axes=1),
    saves=SAVES_INPUTS,  # the products of the others
)

DEFINITIONS = (
    REDUCE_SUM,
    REDUCE_SUM_SQUARE,
    REDUCE_L1,
    REDUCE_L2,
    REDUCE_LOG_SUM,
    REDUCE_LOG_SUM_EXP,
    REDUCE_PROD,
    REDUCE_MAX,
    REDUCE_MIN,
)
