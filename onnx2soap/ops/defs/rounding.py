"""Floor, Ceil and Round: window arithmetic (Swin's padding to whole windows), bucketing.

Elementwise on one float tensor (every dim splits), the output in the input's dtype.
Round takes halves to the even neighbour, as the spec and numpy's and cupy's ``rint`` do
(``round(2.5) = 2``, ``round(-0.5) = -0``).

The functions are piecewise constant: their derivative is zero wherever it exists, so
the backward gives zero gradients, as PyTorch's floor, ceil and round do (no
straight-through estimate). The cases draw normal data, which lands within a
finite-difference step of a jump with odds of about 1e-6 per element (data on the jumps,
halves to even included, is checked in tests/ops/test_kernel_specifics.py).
"""

from __future__ import annotations

from onnx2soap.ops.base import SAVES_NOTHING, NoAttrs, OpDef, X, case
from onnx2soap.ops.context import NodeContext, elementwise


def convert(ctx: NodeContext):
    t = ctx.tensor(0)
    if not t.dtype.is_float:
        raise ctx.fail(f"input is {t.dtype.value}; only float tensors are supported")
    return elementwise(ctx, [t], NoAttrs(), 1)


def floor_forward(xp, attrs, inputs, args):
    return xp.floor(inputs[0])


def ceil_forward(xp, attrs, inputs, args):
    return xp.ceil(inputs[0])


def round_forward(xp, attrs, inputs, args):
    return xp.rint(inputs[0])


def zero_backward(xp, attrs, inputs, output, grad_output, args):
    x = inputs[0]
    return (xp.zeros(x.shape, dtype=x.dtype),)  # its shape and dtype alone (Saved)


def _definition(name: str, forward, versions: tuple[int, ...], *cases) -> OpDef:
    return OpDef(
        name=name,
        versions=versions,
        convert=convert,
        forward=forward,
        backward=zero_backward,
        saves=SAVES_NOTHING,
        cases=cases,
    )


DEFINITIONS = (
    _definition(
        "Floor",
        floor_forward,
        (13,),
        case("floor", "Floor", X(2, 3, 4)),
        case("floor_2d", "Floor", X(3, 7), opset=13),
    ),
    _definition(
        "Ceil",
        ceil_forward,
        (13,),
        case("ceil", "Ceil", X(2, 3, 4)),
        case("ceil_2d", "Ceil", X(3, 7), opset=13),
    ),
    _definition(
        "Round",
        round_forward,
        (11, 22),  # 22 adds bfloat16
        case("round", "Round", X(2, 3, 4)),
        case("round_opset22", "Round", X(3, 5), opset=22),
    ),
)
