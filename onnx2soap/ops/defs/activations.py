"""Relu and Identity."""

from __future__ import annotations

from onnx2soap.ops.base import NoAttrs, OpDef, Sample, X, case
from onnx2soap.ops.context import NodeContext, elementwise


def convert_relu(ctx: NodeContext):
    return elementwise(ctx, [ctx.tensor(0)], NoAttrs(), 1)


def relu_forward(xp, attrs, inputs, args):
    return xp.maximum(inputs[0], 0)


def relu_backward(xp, attrs, inputs, output, grad_output, args):
    # The subgradient at 0 is 0 (as in PyTorch and ORT training).
    return (grad_output * (inputs[0] > 0),)


def convert_identity(ctx: NodeContext):
    return elementwise(ctx, [ctx.tensor(0)], NoAttrs(), 0)


def identity_forward(xp, attrs, inputs, args):
    return inputs[0].copy()


def identity_backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output.copy(),)


RELU = OpDef(
    name="Relu",
    versions=(13, 14),
    convert=convert_relu,
    forward=relu_forward,
    backward=relu_backward,
    cases=(case("relu", "Relu", X(2, 3, 4), sample=Sample.AWAY_FROM_ZERO),),
)

IDENTITY = OpDef(
    name="Identity",
    versions=(13, 14, 16, 19, 21, 23, 24, 25),
    convert=convert_identity,
    forward=identity_forward,
    backward=identity_backward,
    cases=(case("identity", "Identity", X(3, 4)),),
)

DEFINITIONS = (RELU, IDENTITY)
