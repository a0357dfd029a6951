"""Expand: numpy-style bidirectional broadcasting of the input to a constant shape.

The output shape is the broadcast of the input's shape and the shape input (so a 1 in
the shape input keeps the input's size). Input axes that are stretched are read with
``Broadcast``: their buffer is size 1 whatever the split. Gradients sum over the
stretched axes.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx2soap.ops.base import SAVES_NOTHING, C, OpDef, X, case
from onnx2soap.ops.context import (
    NodeContext,
    axis_names,
    broadcast_operand,
    broadcast_shape,
    make_op,
)
from onnx2soap.ops.defs.transpose import int_values
from onnx2soap.ops.kernel_util import unbroadcast


@dataclass(frozen=True)
class ExpandAttrs:
    shape: tuple[int, ...]  # the output shape (the broadcast one, not the shape input)


def convert(ctx: NodeContext):
    x = ctx.tensor(0)
    shape = int_values(ctx, 1, "shape")
    if any(s < 0 for s in shape):
        raise ctx.fail(f"shape {list(shape)} has negative sizes")
    out = broadcast_shape(ctx, [x.shape, shape])
    if 0 in out:
        raise ctx.fail(f"the output {list(out)} would be empty")
    dims = list(zip(axis_names(len(out)), out, strict=True))
    operand = broadcast_operand(x, out)
    return make_op(ctx, [operand], ExpandAttrs(out), dims, range(len(out)), 0)


def forward(xp, attrs: ExpandAttrs, inputs, args):
    return xp.broadcast_to(inputs[0], args.out_shape).copy()


def backward(xp, attrs: ExpandAttrs, inputs, output, grad_output, args):
    return (unbroadcast(xp, grad_output, inputs[0].shape),)


EXPAND = OpDef(
    moves_values=True,
    name="Expand",
    versions=(13,),
    convert=convert,
    forward=forward,
    backward=backward,
    saves=SAVES_NOTHING,  # the input's shape only
    cases=(
        case("expand_middle", "Expand", X(2, 1, 4), C([2, 3, 4])),
        case("expand_ones_keep", "Expand", X(3, 1, 5, 1), C([1, 4, 1, 2])),
        case("expand_shorter_shape", "Expand", X(2, 1, 1), C([3, 4])),
        case("expand_noop", "Expand", X(2, 3), C([1])),
    ),
)

DEFINITIONS = (EXPAND,)
