"""Where, Not, And, Or, Xor, IsNaN and IsInf: masks, and selecting by a mask.

The IR has no bool tensors (see ``comparisons``): a boolean is a mask of 0 and 1 in the
run's float dtype, whether a comparison computed it, the model stores it as a constant
(the importer gives a bool constant as a 0/1 float CONSTANT tensor) or it is a mask
input. The kernels read any nonzero value as true, so a mask never needs to be exactly
0/1 to mean what it says, and write exactly 0 and 1.

No gradient flows into a mask: Not, And, Or, Xor, IsNaN and IsInf are piecewise constant
(zero gradients for every input), and Where's condition gets a zero gradient while its
two values get the output gradient where they were selected. Every op is elementwise with
numpy broadcasting: every dim splits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from onnx2soap.ir import DType, Tensor
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
)
from onnx2soap.ops.context import NodeContext, elementwise, one_kind
from onnx2soap.ops.kernel_util import unbroadcast


def _tensor(ctx: NodeContext, i: int, what: str, *, mask: bool) -> Tensor:
    """Input ``i`` as a tensor. A mask may be a 0/1 float tensor or an integer one (a mask
    input read as integers); a value must be float. A bool constant the importer did not
    turn into a tensor is refused with what it needs."""
    if ctx.inputs[i] is None and ctx.is_constant(i):
        value = ctx.constant(i)
        raise ctx.fail(
            f"{what} (input {i}) is a {value.dtype} constant that was not given as a tensor; "
            "a bool constant must arrive as a 0/1 float constant tensor"
        )
    t = ctx.tensor(i)
    if not mask and not t.dtype.is_float:
        raise ctx.fail(f"{what} (input {i}) is {t.dtype.value}; only float tensors are supported")
    return t


def _out_dtype(inputs):
    """The output's dtype, as the importer gives it (``output_tensor``): the first float
    input's, else the first input's."""
    return next((x.dtype for x in inputs if x.dtype.kind == "f"), inputs[0].dtype)


def _no_grad(xp, x):
    """A mask's gradient: zeros for a float buffer, None for an integer one (from its
    shape and dtype alone: Saved)."""
    return xp.zeros(x.shape, dtype=x.dtype) if x.dtype.kind == "f" else None


def _zero_grads(xp, attrs, inputs, output, grad_output, args):
    return tuple(_no_grad(xp, x) for x in inputs)


# --- Where --------------------------------------------------------------------------------


def convert_where(ctx: NodeContext):
    # X and Y: floats, or integers (``masked_fill`` of label ids: T5's and BART's
    # shift-right), an integer constant among them as an operand
    values = [ctx.operand(1), ctx.operand(2)]
    ints = one_kind(ctx, values, "X and Y")
    operands = [_tensor(ctx, 0, "the condition", mask=True), *values]
    op = elementwise(ctx, operands, NoAttrs(), 1)
    # the values' type, whatever the condition's (a bool constant is a 0/1 float)
    return replace(op, dtype=DType.INT64) if ints else op


def where_forward(xp, attrs, inputs, args):
    cond, x, y = inputs
    return xp.where(cond != 0, x, y)  # fresh, and broadcast to the tile like the nest


def where_backward(xp, attrs, inputs, output, grad_output, args):
    cond, x, y = inputs
    if x.dtype.kind != "f":  # selected integers: no gradient anywhere
        return _no_grad(xp, cond), None, None
    keep = cond != 0
    zero = xp.zeros((), dtype=grad_output.dtype)
    return (
        _no_grad(xp, cond),
        unbroadcast(xp, xp.where(keep, grad_output, zero), x.shape),
        unbroadcast(xp, xp.where(keep, zero, grad_output), y.shape),
    )


# --- Not, And, Or, Xor ----------------------------------------------------------------


def _logic_converter(arity: int):
    def convert(ctx: NodeContext):
        operands = [_tensor(ctx, i, f"operand {i}", mask=True) for i in range(arity)]
        return elementwise(ctx, operands, NoAttrs(), 1)

    return convert


def not_forward(xp, attrs, inputs, args):
    (a,) = inputs
    return (a == 0).astype(_out_dtype(inputs))


def _binary_forward(name: str):
    """``name`` is the array module's function (logical_and, ...): numpy and cupy both
    have it."""

    def forward(xp, attrs, inputs, args):
        a, b = inputs
        return getattr(xp, name)(a != 0, b != 0).astype(_out_dtype(inputs))

    return forward


# --- IsNaN, IsInf ----------------------------------------------------------------------


@dataclass(frozen=True)
class IsInfAttrs:
    negative: bool
    positive: bool


def convert_isnan(ctx: NodeContext):
    return elementwise(ctx, [_tensor(ctx, 0, "X", mask=False)], NoAttrs(), 1)


def convert_isinf(ctx: NodeContext, *, detect_negative=1, detect_positive=1):
    for name, value in (("detect_negative", detect_negative), ("detect_positive", detect_positive)):
        if value not in (0, 1):
            raise ctx.fail(f"{name}={value}; accepted: 0 or 1")
    attrs = IsInfAttrs(bool(detect_negative), bool(detect_positive))
    return elementwise(ctx, [_tensor(ctx, 0, "X", mask=False)], attrs, 1)


def isnan_forward(xp, attrs, inputs, args):
    (x,) = inputs
    return xp.isnan(x).astype(x.dtype)


def isinf_forward(xp, attrs: IsInfAttrs, inputs, args):
    (x,) = inputs
    found = xp.zeros(x.shape, dtype=bool)
    if attrs.positive:
        found = found | (x == xp.inf)
    if attrs.negative:
        found = found | (x == -xp.inf)
    return found.astype(x.dtype)


# --- cases ------------------------------------------------------------------------------


def _mask_input(*shape: int) -> CaseInput:
    """A bool data input (an attention mask). Needs the harness to build a BOOL graph
    input for a DATA input of dtype bool, and the importer to read it as a 0/1 float
    data input."""
    return CaseInput(InputKind.DATA, tuple(shape), None, "bool")


def _bools(*shape: int) -> CaseInput:
    """A bool constant of ``shape`` with both values, in a fixed irregular pattern."""
    count = 1
    for s in shape:
        count *= s
    return C([float((7 * k) % 3 != 0) for k in range(count)], dtype="bool", shape=shape)


WHERE = OpDef(
    # X and Y are moved: ids selected keep the bound of whoever reads them
    moves_values=True,
    name="Where",
    versions=(9, 16),  # 16 adds bfloat16
    convert=convert_where,
    forward=where_forward,
    backward=where_backward,
    saves=Saved(inputs=(0,), output=False),  # the condition; X's and Y's shapes only
    cases=(
        case("where_const_cond", "Where", _bools(3, 4), X(2, 3, 4), W(3, 4)),
        case("where_const_fill", "Where", _bools(1, 4), X(2, 3, 4), C(-3.5, dtype="float32")),
        case("where_weight_first", "Where", _bools(3, 1), W(4), X(2, 3, 4), opset=16),
        case("where_mask_input", "Where", _mask_input(2, 3, 4), W(4), C(-2.0, dtype="float32")),
        # label ids: -100 replaced by the padding id (T5's and BART's shift-right)
        case(
            "where_ids_fill",
            "Where",
            _bools(2, 1),
            C(0),
            CaseInput(InputKind.DATA, (2, 5), None, "int64"),
            output="int64",
        ),
        case(
            "where_mask_ids_const",
            "Where",
            _mask_input(3, 4),
            C([7, -100, 3, 1], shape=(4,)),
            C(5),
            output="int64",
            opset=16,
        ),
    ),
)

NOT = OpDef(
    name="Not",
    versions=(1,),
    convert=_logic_converter(1),
    forward=not_forward,
    backward=_zero_grads,
    saves=SAVES_NOTHING,
    cases=(case("not_mask", "Not", _mask_input(2, 3, 4), output="bool"),),
)


def _binary_logic(name: str, function: str) -> OpDef:
    lower = name.lower()
    return OpDef(
        name=name,
        versions=(7,),
        convert=_logic_converter(2),
        forward=_binary_forward(function),
        backward=_zero_grads,
        saves=SAVES_NOTHING,
        cases=(
            case(f"{lower}_const", name, _mask_input(2, 3, 4), _bools(4), output="bool"),
            case(f"{lower}_const_first", name, _bools(3, 1), _mask_input(2, 3, 4), output="bool"),
        ),
    )


ISNAN = OpDef(
    name="IsNaN",
    versions=(13, 20),  # 20 adds float8 types
    convert=convert_isnan,
    forward=isnan_forward,
    backward=_zero_grads,
    saves=SAVES_NOTHING,
    cases=(
        case("isnan", "IsNaN", X(2, 3, 4), output="bool"),
        case("isnan_opset20", "IsNaN", X(3, 5), output="bool", opset=20),
    ),
)

ISINF = OpDef(
    name="IsInf",
    versions=(10, 20),  # 20 adds float8 types
    convert=convert_isinf,
    forward=isinf_forward,
    backward=_zero_grads,
    saves=SAVES_NOTHING,
    cases=(
        case("isinf", "IsInf", X(2, 3, 4), output="bool"),
        case("isinf_positive", "IsInf", X(2, 5), output="bool", detect_negative=0),
        case("isinf_negative", "IsInf", X(3, 4), output="bool", detect_positive=0, opset=20),
        case(
            "isinf_none",
            "IsInf",
            X(2, 4),
            output="bool",
            detect_positive=0,
            detect_negative=0,
            sample=Sample.AWAY_FROM_ZERO,
        ),
    ),
)

DEFINITIONS = (
    WHERE,
    NOT,
    _binary_logic("And", "logical_and"),
    _binary_logic("Or", "logical_or"),
    _binary_logic("Xor", "logical_xor"),
    ISNAN,
    ISINF,
)
