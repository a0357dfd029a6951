"""Add, Sub, Mul and Div: numpy (multidirectional) broadcasting of two float operands,
each a data tensor, a weight or a float constant. Outputs and gradients are fresh arrays,
never views of an input: the executor may accumulate into them in place."""

from __future__ import annotations

from onnx2soap.ops.base import C, NoAttrs, OpDef, Sample, W, X, case
from onnx2soap.ops.context import NodeContext, elementwise
from onnx2soap.ops.kernel_util import unbroadcast

VERSIONS = (13, 14)  # 14 adds integer and bfloat16 types: the float semantics are 13's


def convert_binary(ctx: NodeContext):
    operands = [ctx.tensor(0), ctx.tensor(1)]
    for i, t in enumerate(operands):
        if not t.dtype.is_float:
            raise ctx.fail(f"input {i} is {t.dtype.value}; only float operands are supported")
    return elementwise(ctx, operands, NoAttrs(), 1)


# A Broadcast operand axis has a size-1 buffer: its gradient sums the tile's axis, which
# ``unbroadcast`` does (and it always returns a fresh array).


def add_forward(xp, attrs, inputs, args):
    a, b = inputs
    return a + b


def add_backward(xp, attrs, inputs, output, grad_output, args):
    return tuple(unbroadcast(xp, grad_output, x.shape) for x in inputs)


def sub_forward(xp, attrs, inputs, args):
    a, b = inputs
    return a - b


def sub_backward(xp, attrs, inputs, output, grad_output, args):
    a, b = inputs
    return unbroadcast(xp, grad_output, a.shape), unbroadcast(xp, -grad_output, b.shape)


def mul_forward(xp, attrs, inputs, args):
    a, b = inputs
    return a * b


def mul_backward(xp, attrs, inputs, output, grad_output, args):
    a, b = inputs
    return unbroadcast(xp, grad_output * b, a.shape), unbroadcast(xp, grad_output * a, b.shape)


def div_forward(xp, attrs, inputs, args):
    a, b = inputs
    return a / b


def div_backward(xp, attrs, inputs, output, grad_output, args):
    # d(a/b)/da = 1/b, d(a/b)/db = -a/b^2; both from the inputs (not the output, which a
    # broadcast a may not cover).
    a, b = inputs
    grad_a = grad_output / b
    return unbroadcast(xp, grad_a, a.shape), unbroadcast(xp, -grad_a * a / b, b.shape)


def _cases(op: str, sample: Sample = Sample.NORMAL):
    """The same operand layouts for every binary op: broadcasting both ways, weights on
    either side, and float constants (a scalar, a row) on either side."""
    p = op.lower()
    return (
        case(f"{p}_bias", op, X(2, 3, 4, 5), W(3, 1, 1), sample=sample),
        case(f"{p}_vector_first", op, W(5), X(2, 3, 5), sample=sample),
        case(f"{p}_both_broadcast", op, X(2, 1, 4), W(3, 1), sample=sample),
        case(f"{p}_same_shape", op, X(2, 3), W(2, 3), sample=sample),
        case(f"{p}_const_scalar", op, X(2, 3, 4), C(0.5, dtype="float32"), sample=sample),
        case(
            f"{p}_const_scalar_first",
            op,
            C(-1.5, dtype="float32"),
            X(3, 4),
            sample=sample,
        ),
        case(
            f"{p}_const_row",
            op,
            X(2, 3),
            C([0.5, -2.0, 3.0], dtype="float32"),
            sample=sample,
        ),
    )


ADD = OpDef(
    name="Add",
    versions=VERSIONS,
    convert=convert_binary,
    forward=add_forward,
    backward=add_backward,
    cases=_cases("Add"),
)

SUB = OpDef(
    name="Sub",
    versions=VERSIONS,
    convert=convert_binary,
    forward=sub_forward,
    backward=sub_backward,
    cases=_cases("Sub"),
)

MUL = OpDef(
    name="Mul",
    versions=VERSIONS,
    convert=convert_binary,
    forward=mul_forward,
    backward=mul_backward,
    cases=_cases("Mul"),
)

DIV = OpDef(
    name="Div",
    versions=VERSIONS,
    convert=convert_binary,
    forward=div_forward,
    backward=div_backward,
    # Divisors near 0 would make central differences meaningless.
    cases=_cases("Div", Sample.AWAY_FROM_ZERO),
)

DEFINITIONS = (ADD, SUB, MUL, DIV)
