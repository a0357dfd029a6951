"""Squeeze and Unsqueeze (opset 13 on: the axes are a constant input).

Both only add or drop size-1 axes, so the data order is unchanged and the kernels are
reshapes of the local buffer. Squeeze reads each removed size-1 input axis with
``Broadcast``; Unsqueeze's new output axes are size-1 axes (``None`` in ``out_dims``).
The kept axes are identity maps, so every dim splits freely; the batch may move (its
kind follows it through the maps).
"""

from __future__ import annotations

from onnx2soap.ir import AxisMap, Broadcast, Operand, identity
from onnx2soap.ops.base import SAVES_NOTHING, C, NoAttrs, OpDef, X, case
from onnx2soap.ops.context import NodeContext, axis_names, make_op
from onnx2soap.ops.defs.transpose import int_values, normalized_axes


def convert_squeeze(ctx: NodeContext):
    x = ctx.tensor(0)
    rank = len(x.shape)
    given = len(ctx.inputs) > 1 and (ctx.inputs[1] is not None or ctx.is_constant(1))
    if given:
        removed = set(normalized_axes(ctx, int_values(ctx, 1, "axes"), rank, "axes"))
        wide = sorted(a for a in removed if x.shape[a] != 1)
        if wide:
            raise ctx.fail(f"axes {wide} of input {list(x.shape)} are not of size 1")
    else:  # no axes: every size-1 axis goes
        removed = {a for a, s in enumerate(x.shape) if s == 1}
    kept = [a for a in range(rank) if a not in removed]
    dims = list(zip(axis_names(len(kept)), (x.shape[a] for a in kept), strict=True))
    axes: list[AxisMap] = []
    for a in range(rank):
        axes.append(Broadcast() if a in removed else identity(kept.index(a)))
    return make_op(ctx, [Operand(x.name, tuple(axes))], NoAttrs(), dims, range(len(kept)), 0)


def convert_unsqueeze(ctx: NodeContext):
    x = ctx.tensor(0)
    rank = len(x.shape)
    requested = int_values(ctx, 1, "axes")
    out_rank = rank + len(requested)
    added = set(normalized_axes(ctx, requested, out_rank, "axes"))
    dims = list(zip(axis_names(rank), x.shape, strict=True))
    # Input axis k is the k-th output axis that is not a new one.
    out_dims: list[int | None] = []
    for a in range(out_rank):
        out_dims.append(None if a in added else len([d for d in out_dims if d is not None]))
    axes = tuple(identity(k) for k in range(rank))
    return make_op(ctx, [Operand(x.name, axes)], NoAttrs(), dims, out_dims, 0)


def forward(xp, attrs, inputs, args):
    return inputs[0].reshape(args.out_shape).copy()


def backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output.reshape(inputs[0].shape).copy(),)


SQUEEZE = OpDef(
    moves_values=True,
    name="Squeeze",
    versions=(13, 21, 23, 24, 25),
    convert=convert_squeeze,
    forward=forward,
    backward=backward,
    saves=SAVES_NOTHING,  # the input's shape only
    cases=(
        case("squeeze_middle", "Squeeze", X(2, 1, 3, 1), C([1])),
        case("squeeze_negative_axes", "Squeeze", X(2, 3, 1, 4, 1), C([-1, -3])),
        case("squeeze_all_size1", "Squeeze", X(3, 1, 4, 1)),
        # (axes given as an omitted input '' is valid ONNX, but onnxruntime rejects it)
        case("squeeze_opset21", "Squeeze", X(2, 4, 1), C([2]), opset=21),
    ),
)

UNSQUEEZE = OpDef(
    moves_values=True,
    name="Unsqueeze",
    versions=(13, 21, 23, 24, 25),
    convert=convert_unsqueeze,
    forward=forward,
    backward=backward,
    saves=SAVES_NOTHING,  # the input's shape only
    cases=(
        case("unsqueeze_middle", "Unsqueeze", X(2, 3, 4), C([1])),
        case("unsqueeze_several", "Unsqueeze", X(2, 3), C([3, 1])),
        case("unsqueeze_negative_axes", "Unsqueeze", X(3, 4), C([-1, -3])),
        case("unsqueeze_last", "Unsqueeze", X(4, 2, 3), C([3])),
    ),
)

DEFINITIONS = (SQUEEZE, UNSQUEEZE)
