"""Add: numpy broadcasting. Outputs and gradients are fresh arrays, never views of an
input: the executor may accumulate into them in place."""

from __future__ import annotations

from onnx2soap.ops.base import NoAttrs, OpDef, W, X, case
from onnx2soap.ops.context import NodeContext, elementwise
from onnx2soap.ops.kernel_util import unbroadcast


def convert_add(ctx: NodeContext):
    return elementwise(ctx, [ctx.tensor(0), ctx.tensor(1)], NoAttrs(), 1)


def add_forward(xp, attrs, inputs, args):
    a, b = inputs
    return a + b


def add_backward(xp, attrs, inputs, output, grad_output, args):
    # A Broadcast operand axis has a size-1 buffer: its gradient sums the tile's axis.
    return tuple(unbroadcast(xp, grad_output, x.shape) for x in inputs)


ADD = OpDef(
    name="Add",
    versions=(13, 14),
    convert=convert_add,
    forward=add_forward,
    backward=add_backward,
    cases=(
        case("add_bias", "Add", X(2, 3, 4, 5), W(3, 1, 1)),
        case("add_vector", "Add", W(5), X(2, 3, 5)),
        case("add_both_broadcast", "Add", X(2, 1, 4), W(3, 1)),
    ),
)

DEFINITIONS = (ADD,)
