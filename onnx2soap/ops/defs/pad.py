"""Pad, constant mode: output index ``j`` of an axis padded by ``begin`` reads input index
``j - begin``, the map ``Affine(((d, 1),), -begin)``, with the constant as the operand's
pad value. The partition math then hands every task a buffer exactly the shape of its
output tile, the pad value already written where it reaches outside the input (the same
mechanism as Conv's zero padding), so the kernel is a copy. A negative pad (cropping) is
the same map reaching only inside the input.

reflect, edge and wrap read mirrored or wrapped indices, which no affine map expresses:
refused.
"""

from __future__ import annotations

from enum import Enum

from onnx2soap.ir import Affine, AxisMap, Operand, identity
from onnx2soap.ops.base import NONE, SAVES_NOTHING, C, NoAttrs, OpDef, X, case
from onnx2soap.ops.context import NodeContext, axis_names, make_op, text
from onnx2soap.ops.defs.transpose import int_values, normalized_axes


class PadMode(Enum):
    CONSTANT = "constant"
    REFLECT = "reflect"
    EDGE = "edge"
    WRAP = "wrap"


def _pad_value(ctx: NodeContext) -> float:
    """The constant_value input (0 when omitted): a float scalar known at load time."""
    if ctx.is_constant(2):
        value = ctx.constant(2)
    elif len(ctx.inputs) > 2 and ctx.inputs[2] is not None:
        raise ctx.fail(
            "constant_value (input 2) must be a constant known when the model is loaded, not "
            "a trained weight or a computed tensor"
        )
    else:
        return 0.0
    if value.size != 1 or value.dtype.kind not in "fiu":
        raise ctx.fail(
            f"constant_value must be a numeric scalar, got {value.dtype} {list(value.shape)}"
        )
    return float(value.reshape(-1)[0])


def convert(ctx: NodeContext, *, mode="constant"):
    x = ctx.tensor(0)
    rank = len(x.shape)
    name = text(mode)
    if name not in {m.value for m in PadMode}:
        raise ctx.fail(f"mode '{name}' is not in the spec (constant, reflect, edge, wrap)")
    if PadMode(name) is not PadMode.CONSTANT:
        raise ctx.fail(
            f"mode '{name}' reads mirrored or wrapped indices, which no access map expresses; "
            "only mode 'constant' is supported"
        )
    pads = int_values(ctx, 1, "pads")
    given = len(ctx.inputs) > 3 and (ctx.inputs[3] is not None or ctx.is_constant(3))
    axes = tuple(range(rank))
    if given:  # opset 18: pads name only these axes
        axes = normalized_axes(ctx, int_values(ctx, 3, "axes"), rank, "axes")
    if len(pads) != 2 * len(axes):
        raise ctx.fail(
            f"pads {list(pads)} must hold a begin and an end for each of the {len(axes)} axes"
        )
    begin = dict.fromkeys(range(rank), 0) | dict(zip(axes, pads[: len(axes)], strict=True))
    end = dict.fromkeys(range(rank), 0) | dict(zip(axes, pads[len(axes) :], strict=True))
    out = tuple(s + begin[a] + end[a] for a, s in enumerate(x.shape))
    if any(s < 1 for s in out):
        raise ctx.fail(
            f"pads {list(pads)} crop input {list(x.shape)} to an empty output {list(out)}"
        )
    axis_maps: list[AxisMap] = [
        Affine(((a, 1),), -begin[a]) if begin[a] else identity(a) for a in range(rank)
    ]
    operand = Operand(x.name, tuple(axis_maps), pad_value=_pad_value(ctx))
    dims = list(zip(axis_names(rank), out, strict=True))
    return make_op(ctx, [operand], NoAttrs(), dims, range(rank), 0)


def forward(xp, attrs, inputs, args):
    return inputs[0].copy()  # the buffer is the tile, padding included


def backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output.copy(),)


PAD = OpDef(
    name="Pad",
    versions=(13, 18, 19, 21, 23, 24, 25),
    convert=convert,
    forward=forward,
    backward=backward,
    saves=SAVES_NOTHING,
    cases=(
        case("pad_spatial", "Pad", X(2, 3, 4, 5), C([0, 0, 1, 2, 0, 0, 3, 1])),
        case("pad_crop", "Pad", X(2, 6, 5), C([0, -2, 1, 0, 1, -3])),
        case("pad_value", "Pad", X(2, 3, 4), C([0, 1, 0, 0, 2, 2]), C(1.5, "float32")),
        case(
            "pad_omitted_value_axes", "Pad", X(2, 3, 4), C([2, 1, 0, 3]), NONE, C([-1, 1]), opset=18
        ),
        case("pad_axes_value", "Pad", X(2, 5), C([3, 2]), C(-2.0, "float32"), C([1]), opset=18),
    ),
)

DEFINITIONS = (PAD,)
