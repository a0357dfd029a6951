"""Sin and Cos: rotary position embeddings (Llama, Mistral, Qwen2) take the sine and
cosine of the positions times the inverse frequencies.

Elementwise on one float tensor (every dim splits). The positions usually come from a
Range and a Cast, so the input is often computed from constants alone; the op then
carries no batch and takes no gradient from the model, but a gradient is still defined
(the derivative, as PyTorch's) for a Sin or Cos of activations.
"""

from __future__ import annotations

from onnx2soap.ops.base import SAVES_INPUTS, NoAttrs, OpDef, X, case
from onnx2soap.ops.context import NodeContext, elementwise

# 22 only adds bfloat16 to the types: the float semantics are 7's.
VERSIONS = (7, 22)

# Sine and cosine cost about as much as an exponential in numpy and cupy: counted as the
# few FLOPs a polynomial evaluation takes, like Sigmoid's.
_FLOPS = 4


def convert(ctx: NodeContext):
    t = ctx.tensor(0)
    if not t.dtype.is_float:
        raise ctx.fail(f"input is {t.dtype.value}; only float tensors are supported")
    return elementwise(ctx, [t], NoAttrs(), _FLOPS)


def sin_forward(xp, attrs, inputs, args):
    return xp.sin(inputs[0])


def sin_backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output * xp.cos(inputs[0]),)


def cos_forward(xp, attrs, inputs, args):
    return xp.cos(inputs[0])


def cos_backward(xp, attrs, inputs, output, grad_output, args):
    return (-grad_output * xp.sin(inputs[0]),)


SIN = OpDef(
    name="Sin",
    versions=VERSIONS,
    convert=convert,
    forward=sin_forward,
    backward=sin_backward,
    saves=SAVES_INPUTS,  # cos(x)
    cases=(
        case("sin", "Sin", X(2, 3, 4)),
        case("sin_opset22", "Sin", X(3, 5), opset=22),
    ),
)

COS = OpDef(
    name="Cos",
    versions=VERSIONS,
    convert=convert,
    forward=cos_forward,
    backward=cos_backward,
    saves=SAVES_INPUTS,  # sin(x)
    cases=(
        case("cos", "Cos", X(2, 3, 4)),
        case("cos_opset22", "Cos", X(3, 5), opset=22),
    ),
)

DEFINITIONS = (SIN, COS)
