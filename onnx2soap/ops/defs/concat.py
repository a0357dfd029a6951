"""Concat. Tasks receive, per input, the part of it their box covers, which is empty
(zero extent along the axis) for inputs the box does not reach. The parts are floats, or
integers (ids beside an integer constant: a start id put in front of shifted labels),
which take no gradient."""

from __future__ import annotations

from dataclasses import dataclass

from onnx2soap.ir import Affine, Operand, identity
from onnx2soap.ops.base import SAVES_NOTHING, C, CaseInput, InputKind, OpDef, W, X, case
from onnx2soap.ops.context import NodeContext, axis_names, make_op, one_kind


@dataclass(frozen=True)
class ConcatAttrs:
    axis: int


def convert(ctx: NodeContext, *, axis):
    parts = [ctx.operand(i) for i in range(len(ctx.inputs))]
    one_kind(ctx, parts, "the parts")
    rank = len(parts[0].shape)
    if not -rank <= axis < rank:
        raise ctx.fail(f"axis={axis} is out of range for rank {rank}")
    axis = axis + rank if axis < 0 else axis
    if any(
        len(t.shape) != rank
        or t.shape[:axis] + t.shape[axis + 1 :]
        != parts[0].shape[:axis] + parts[0].shape[axis + 1 :]
        for t in parts
    ):
        raise ctx.fail(f"inputs {[list(t.shape) for t in parts]} cannot be joined on axis {axis}")
    out = list(parts[0].shape)
    out[axis] = sum(t.shape[axis] for t in parts)
    dims = list(zip(axis_names(len(out)), out, strict=True))
    operands, offset = [], 0
    for t in parts:
        axes = tuple(
            Affine(((i, 1),), -offset) if i == axis else identity(i) for i in range(len(out))
        )
        operands.append(Operand(t.name, axes))
        offset += t.shape[axis]
    return make_op(ctx, operands, ConcatAttrs(axis), dims, range(len(out)), 0)


def forward(xp, attrs: ConcatAttrs, inputs, args):
    return xp.concatenate(list(inputs), axis=attrs.axis)


def backward(xp, attrs: ConcatAttrs, inputs, output, grad_output, args):
    grads, offset = [], 0
    for x in inputs:
        size = x.shape[attrs.axis]
        index = [slice(None)] * grad_output.ndim
        index[attrs.axis] = slice(offset, offset + size)
        grads.append(grad_output[tuple(index)].copy() if x.dtype.kind == "f" else None)
        offset += size
    return tuple(grads)


CONCAT = OpDef(
    moves_values=True,
    name="Concat",
    versions=(13,),
    convert=convert,
    forward=forward,
    backward=backward,
    saves=SAVES_NOTHING,  # the parts' extents and dtypes only
    cases=(
        case("concat_middle", "Concat", W(2, 2, 4), X(2, 3, 4), W(2, 1, 4), axis=1),
        case("concat_last", "Concat", X(2, 3, 2), W(2, 3, 3), W(2, 3, 1), axis=-1),
        # a start id in front of the ids
        case(
            "concat_int_constant_and_ids",
            "Concat",
            C([7, 7, 7], shape=(3, 1)),
            CaseInput(InputKind.DATA, (3, 4), None, "int64"),
            axis=1,
            output="int64",
        ),
    ),
)

DEFINITIONS = (CONCAT,)
