"""Add, Sub, Mul and Div: numpy (multidirectional) broadcasting of two operands of one
element type. Floats (each a data tensor, a weight or a float constant) take gradients;
integers (ids, masks and positions computed from the data, and integer constants beside
them: RoBERTa's position ids, a running count times the padding mask) take none: the
output is int64 and the executor runs no backward for it. Integer Div truncates toward
zero, as ONNX (and C) divide. Outputs and gradients are fresh arrays, never views of an
input: the executor may accumulate into them in place."""

from __future__ import annotations

from onnx2soap.ops.base import (
    SAVES_NOTHING,
    C,
    CaseInput,
    InputKind,
    NoAttrs,
    OpDef,
    Sample,
    Saved,
    W,
    X,
    case,
    wants,
)
from onnx2soap.ops.context import NodeContext, elementwise, one_kind
from onnx2soap.ops.kernel_util import unbroadcast

VERSIONS = (13, 14)  # 14 adds integer and bfloat16 types: the float semantics are 13's


def convert_binary(ctx: NodeContext):
    operands = [ctx.operand(0), ctx.operand(1)]
    one_kind(ctx, operands)
    return elementwise(ctx, operands, NoAttrs(), 1)


def _grad(xp, grad, x):
    """``grad`` summed to ``x``'s shape; None for integers, which take no gradient."""
    return unbroadcast(xp, grad, x.shape) if x.dtype.kind == "f" else None


# A Broadcast operand axis has a size-1 buffer: its gradient sums the tile's axis, which
# ``unbroadcast`` does (and it always returns a fresh array).


def add_forward(xp, attrs, inputs, args):
    a, b = inputs
    return a + b


def add_backward(xp, attrs, inputs, output, grad_output, args):
    return tuple(_grad(xp, grad_output, x) for x in inputs)


def sub_forward(xp, attrs, inputs, args):
    a, b = inputs
    return a - b


def sub_backward(xp, attrs, inputs, output, grad_output, args):
    a, b = inputs
    return _grad(xp, grad_output, a), _grad(xp, -grad_output, b)


def mul_forward(xp, attrs, inputs, args):
    a, b = inputs
    return a * b


def mul_backward(xp, attrs, inputs, output, grad_output, args):
    a, b = inputs  # each is read for the other's gradient only (it may be released)
    grad_a = _grad(xp, grad_output * b, a) if wants(args, 0) else None
    return grad_a, _grad(xp, grad_output * a, b) if wants(args, 1) else None


def div_forward(xp, attrs, inputs, args):
    a, b = inputs
    if a.dtype.kind != "f":  # toward zero: floor division, one up where it rounded down
        q = a // b
        return q + ((q < 0) & (q * b != a))
    return a / b


def div_backward(xp, attrs, inputs, output, grad_output, args):
    # d(a/b)/da = 1/b, d(a/b)/db = -a/b^2; both from the inputs (not the output, which a
    # broadcast a may not cover).
    a, b = inputs  # a is read for b's gradient only (it may be released)
    if a.dtype.kind != "f":
        return None, None
    grad_a = grad_output / b
    grad_b = unbroadcast(xp, -grad_a * a / b, b.shape) if wants(args, 1) else None
    return unbroadcast(xp, grad_a, a.shape) if wants(args, 0) else None, grad_b


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


def _ids(*shape: int) -> CaseInput:
    """An int64 data input (ids, a mask, positions)."""
    return CaseInput(InputKind.DATA, tuple(shape), None, "int64")


def _int_cases(op: str, scalar: int = 3):
    """Integers computed from the data, with an int64 constant either side (RoBERTa adds
    the padding id to its positions)."""
    p = op.lower()
    return (
        case(f"{p}_ids_const", op, _ids(3, 4), C(scalar), output="int64"),
        case(f"{p}_const_ids", op, C([scalar, -2, 5, 1]), _ids(2, 3, 4), output="int64", opset=14),
    )


ADD = OpDef(
    name="Add",
    versions=VERSIONS,
    convert=convert_binary,
    forward=add_forward,
    backward=add_backward,
    saves=SAVES_NOTHING,  # the operands' shapes and dtypes only
    cases=(*_cases("Add"), *_int_cases("Add")),
)

SUB = OpDef(
    name="Sub",
    versions=VERSIONS,
    convert=convert_binary,
    forward=sub_forward,
    backward=sub_backward,
    saves=SAVES_NOTHING,
    cases=(*_cases("Sub"), *_int_cases("Sub")),
)

MUL = OpDef(
    name="Mul",
    versions=VERSIONS,
    convert=convert_binary,
    forward=mul_forward,
    backward=mul_backward,
    # each operand scales the other's gradient: x of x * c is not kept for a constant c
    saves=Saved(inputs=None, output=False, only_for=((0, (1,)), (1, (0,)))),
    cases=(*_cases("Mul"), *_int_cases("Mul")),
)

DIV = OpDef(
    name="Div",
    versions=VERSIONS,
    convert=convert_binary,
    forward=div_forward,
    backward=div_backward,
    # a and b, not the output; a only where b takes a gradient (a constant divisor: none)
    saves=Saved(inputs=None, output=False, only_for=((0, (1,)),)),
    # Divisors near 0 would make central differences meaningless.
    cases=(
        *_cases("Div", Sample.AWAY_FROM_ZERO),
        # toward zero: 1 / -2 is 0 (floor division would give -1)
        case("div_ids_const", "Div", _ids(3, 4), C([-2, 3, -1, 2]), output="int64"),
    ),
)

DEFINITIONS = (ADD, SUB, MUL, DIV)
