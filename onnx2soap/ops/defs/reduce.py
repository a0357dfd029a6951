"""GlobalAveragePool and ReduceMean: reduced dims are reductions, never split, so the
buffer holds them whole."""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx2soap.ir import Operand, identity
from onnx2soap.ops.base import SAVES_NOTHING, C, NoAttrs, OpDef, X, case
from onnx2soap.ops.context import NodeContext, axis_names, elementwise, make_op, spatial_names


@dataclass(frozen=True)
class ReduceAttrs:
    axes: tuple[int, ...]  # non-negative, sorted
    keepdims: bool = True


def convert_global_average(ctx: NodeContext):
    x = ctx.tensor(0)
    rank = len(x.shape) - 2
    if rank < 1:
        raise ctx.fail(f"X {list(x.shape)} has no spatial axes")
    names = spatial_names(rank)
    dims = [("n", x.shape[0]), ("c", x.shape[1]), *zip(names, x.shape[2:], strict=True)]
    operands = [Operand(x.name, tuple(identity(i) for i in range(len(x.shape))))]
    out_dims = (0, 1, *([None] * rank))
    return make_op(ctx, operands, NoAttrs(), dims, out_dims, 1)


def global_average_forward(xp, attrs, inputs, args):
    x = inputs[0]
    return x.mean(axis=tuple(range(2, x.ndim)), keepdims=True)


def global_average_backward(xp, attrs, inputs, output, grad_output, args):
    x = inputs[0]
    count = math.prod(x.shape[2:])
    return (xp.zeros(x.shape, dtype=x.dtype) + grad_output / count,)  # x's shape only


def convert_reduce_mean(ctx: NodeContext, *, axes=None, keepdims=1, noop_with_empty_axes=0):
    x = ctx.tensor(0)
    rank = len(x.shape)
    if axes is None and len(ctx.inputs) > 1 and ctx.is_constant(1):
        axes = [int(a) for a in ctx.constant(1)]  # opset 18 moved axes to an input
    if not axes:
        if noop_with_empty_axes:
            return elementwise(ctx, [x], NoAttrs(), 0)
        axes = list(range(rank))
    if any(not -rank <= a < rank for a in axes):
        raise ctx.fail(f"axes {list(axes)} out of range for rank {rank}")
    reduced = tuple(sorted({a + rank if a < 0 else a for a in axes}))
    dims = list(zip(axis_names(rank), x.shape, strict=True))
    out_dims = [None if a in reduced else a for a in range(rank) if keepdims or a not in reduced]
    operands = [Operand(x.name, tuple(identity(i) for i in range(rank)))]
    return make_op(ctx, operands, ReduceAttrs(reduced, bool(keepdims)), dims, out_dims, 1)


def reduce_mean_forward(xp, attrs, inputs, args):
    if isinstance(attrs, NoAttrs):  # noop_with_empty_axes: the identity
        return inputs[0].copy()
    return inputs[0].mean(axis=attrs.axes, keepdims=True).reshape(args.out_shape)


def reduce_mean_backward(xp, attrs, inputs, output, grad_output, args):
    x = inputs[0]
    if isinstance(attrs, NoAttrs):
        return (grad_output.copy(),)
    kept = tuple(1 if a in attrs.axes else s for a, s in enumerate(x.shape))
    count = math.prod(x.shape[a] for a in attrs.axes)
    return (xp.zeros(x.shape, dtype=x.dtype) + grad_output.reshape(kept) / count,)


GLOBAL_AVERAGE_POOL = OpDef(
    name="GlobalAveragePool",
    versions=(1, 22),
    convert=convert_global_average,
    forward=global_average_forward,
    backward=global_average_backward,
    saves=SAVES_NOTHING,  # x's shape only
    cases=(
        case("globalavgpool2d", "GlobalAveragePool", X(2, 3, 4, 5)),
        case("globalavgpool1d", "GlobalAveragePool", X(3, 2, 5)),
    ),
)

REDUCE_MEAN = OpDef(
    name="ReduceMean",
    versions=(13, 18),
    convert=convert_reduce_mean,
    forward=reduce_mean_forward,
    backward=reduce_mean_backward,
    saves=SAVES_NOTHING,  # x's shape only
    cases=(
        case("reducemean_spatial", "ReduceMean", X(2, 3, 4, 5), axes=[2, 3]),
        case("reducemean_dropped", "ReduceMean", X(2, 3, 4, 5), axes=[-1, 1], keepdims=0),
        # opset 18 moved the axes to a constant input (what the dynamo exporter writes)
        case("reducemean_opset18", "ReduceMean", X(2, 3, 4, 5), C([2, 3]), opset=18),
    ),
)

DEFINITIONS = (GLOBAL_AVERAGE_POOL, REDUCE_MEAN)
