"""Less, Greater, LessOrEqual, GreaterOrEqual and Equal: masks.

The IR has no bool tensors: a comparison's output is a mask of 0 and 1 in the run's float
dtype, so the Cast to float that exporters write after it (EfficientNet's stochastic
depth: ``Less(uniform, keep) -> Cast -> Div -> Mul``) is the identity, and the mask can
scale a tensor directly. No gradient flows through a comparison: its derivative is zero
almost everywhere, so both inputs get zero gradients.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

from onnx2soap.ops.base import SAVES_NOTHING, C, CaseInput, InputKind, OpDef, W, X, case
from onnx2soap.ops.context import NodeContext, elementwise


@dataclass(frozen=True)
class CompareAttrs:
    compare: Callable  # operator.lt and friends: pure, the same on numpy and cupy


def _converter(compare: Callable):
    def convert(ctx: NodeContext):
        # floats, or ids (input_ids == pad): a mask of ids then, 0/1 like the floats'
        return elementwise(ctx, [ctx.operand(0), ctx.operand(1)], CompareAttrs(compare), 1)

    return convert


def forward(xp, attrs: CompareAttrs, inputs, args):
    a, b = inputs
    # the importer's rule for the output (output_tensor): the first float input's dtype
    dtype = next((x.dtype for x in inputs if x.dtype.kind == "f"), a.dtype)
    return attrs.compare(a, b).astype(dtype)


def backward(xp, attrs, inputs, output, grad_output, args):
    # zeros of the operands' shapes: their values are not needed (SAVES_NOTHING)
    return tuple(xp.zeros(x.shape, dtype=x.dtype) if x.dtype.kind == "f" else None for x in inputs)


def _ids(*shape: int) -> CaseInput:
    return CaseInput(InputKind.DATA, tuple(shape), None, "int64")


def _definition(name: str, compare: Callable, versions: tuple[int, ...]) -> OpDef:
    lower = name.lower()
    return OpDef(
        name=name,
        versions=versions,
        convert=_converter(compare),
        forward=forward,
        backward=backward,
        saves=SAVES_NOTHING,
        cases=(
            case(f"{lower}_const", name, X(2, 3, 4), C(0.25, dtype="float32"), output="bool"),
            case(f"{lower}_weight", name, X(3, 4), W(4), output="bool"),
            case(
                f"{lower}_const_first", name, C([0.5, -0.5, 0.0], "float32"), X(2, 3), output="bool"
            ),
            # ids against an int constant: a 0/1 mask of ids (input_ids == pad)
            case(f"{lower}_ids", name, _ids(3, 4), C(1), output="bool"),
        ),
    )


DEFINITIONS = (
    _definition("Less", operator.lt, (13,)),
    _definition("Greater", operator.gt, (13,)),
    _definition("LessOrEqual", operator.le, (16,)),
    _definition("GreaterOrEqual", operator.ge, (16,)),
    _definition("Equal", operator.eq, (13, 19)),
)
