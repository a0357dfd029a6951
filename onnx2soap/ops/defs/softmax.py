"""Softmax and LogSoftmax (opset 13 semantics: one axis, default -1).

Every output along the normalized axis depends on the whole of that axis, so the input
reads it with ``Whole(dims=(axis,))``: the dim is kept (the output indexes it one to one)
but hidden, hence never split (the batch axis too, if it is the one normalized). Every
other dim is an identity and splits freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from onnx2soap.ir import AxisMap, Operand, Whole, identity
from onnx2soap.ops.base import SAVES_INPUTS, SAVES_OUTPUT, OpDef, Sample, X, case
from onnx2soap.ops.context import NodeContext, axis_names, make_op


class SoftmaxKind(Enum):
    SOFTMAX = "softmax"
    LOG_SOFTMAX = "log-softmax"


@dataclass(frozen=True)
class SoftmaxAttrs:
    kind: SoftmaxKind
    axis: int  # non-negative, never 0 (the batch)


# max, subtract, exp, sum, divide (or log and subtract)
_FLOPS_PER_POINT = 5


def _convert(ctx: NodeContext, kind: SoftmaxKind, axis: int):
    x = ctx.tensor(0)
    rank = len(x.shape)
    if rank < 2:
        raise ctx.fail(
            f"input {list(x.shape)} has rank {rank}: the only axis is the batch, which "
            "cannot be normalized over (rank >= 2 required)"
        )
    if not -rank <= axis < rank:
        raise ctx.fail(
            f"axis {axis} is out of range for rank {rank} (accepted: [-{rank}, {rank - 1}])"
        )
    axis = axis + rank if axis < 0 else axis
    dims = list(zip(axis_names(rank), x.shape, strict=True))
    # The normalized axis is read whole by every task (hidden, so its dim is never
    # split); the output still indexes that dim one to one.
    axes: tuple[AxisMap, ...] = tuple(
        Whole(dims=(a,)) if a == axis else identity(a) for a in range(rank)
    )
    operands = [Operand(x.name, axes)]
    return make_op(ctx, operands, SoftmaxAttrs(kind, axis), dims, range(rank), _FLOPS_PER_POINT)


def convert_softmax(ctx: NodeContext, *, axis=-1):
    return _convert(ctx, SoftmaxKind.SOFTMAX, int(axis))


def convert_log_softmax(ctx: NodeContext, *, axis=-1):
    return _convert(ctx, SoftmaxKind.LOG_SOFTMAX, int(axis))


def _shifted(xp, x, axis: int):
    """``x`` minus its maximum along ``axis``: exp never overflows."""
    return x - x.max(axis=axis, keepdims=True)


def softmax_forward(xp, attrs: SoftmaxAttrs, inputs, args):
    e = xp.exp(_shifted(xp, inputs[0], attrs.axis))
    return e / e.sum(axis=attrs.axis, keepdims=True)


def softmax_backward(xp, attrs: SoftmaxAttrs, inputs, output, grad_output, args):
    # dx = y * (g - sum(g * y)), the Jacobian-vector product of softmax, from the output
    # tile as autograd's (in mixed precision, as stored: as Megatron-LM's fused softmax)
    y = output
    inner = (grad_output * y).sum(axis=attrs.axis, keepdims=True)
    return (y * (grad_output - inner),)


def log_softmax_forward(xp, attrs: SoftmaxAttrs, inputs, args):
    z = _shifted(xp, inputs[0], attrs.axis)
    return z - xp.log(xp.exp(z).sum(axis=attrs.axis, keepdims=True))


def log_softmax_backward(xp, attrs: SoftmaxAttrs, inputs, output, grad_output, args):
    # dx = g - softmax(x) * sum(g)
    y = softmax_forward(xp, attrs, inputs, args)
    return (grad_output - y * grad_output.sum(axis=attrs.axis, keepdims=True),)


def _cases(op: str, prefix: str):
    return (
        case(f"{prefix}_default_axis", op, X(2, 3, 5)),
        case(f"{prefix}_axis1", op, X(3, 4, 2, 3), axis=1),
        case(f"{prefix}_axis2", op, X(2, 3, 4, 2), axis=2, opset=13),
        case(f"{prefix}_negative_axis", op, X(2, 4, 3), axis=-2),
        case(f"{prefix}_2d", op, X(4, 6), opset=21),
        case(f"{prefix}_distinct", op, X(2, 7), sample=Sample.DISTINCT),
    )


SOFTMAX = OpDef(
    name="Softmax",
    versions=(13,),
    convert=convert_softmax,
    forward=softmax_forward,
    backward=softmax_backward,
    # y, not x: the input goes after its last forward reader (attention's masked scores),
    # the output is what the attention product keeps anyway
    saves=SAVES_OUTPUT,
    cases=_cases("Softmax", "softmax"),
)

LOG_SOFTMAX = OpDef(
    name="LogSoftmax",
    versions=(13,),
    convert=convert_log_softmax,
    forward=log_softmax_forward,
    backward=log_softmax_backward,
    saves=SAVES_INPUTS,  # softmax(x), recomputed
    cases=_cases("LogSoftmax", "logsoftmax"),
)

DEFINITIONS = (SOFTMAX, LOG_SOFTMAX)
