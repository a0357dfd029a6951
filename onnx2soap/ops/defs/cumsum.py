"""CumSum: the running sum along one axis, forwards or backwards (``reverse``), with or
without the element itself (``exclusive``).

RoBERTa's position ids are a CumSum of the padding mask (ids, no gradient); a CumSum of
floats (a running total of activations) takes a gradient. Every output point depends on
a prefix (or suffix) of the scanned axis, so X reads that axis ``Whole``: its dim stays
kept but is never split, and the task's buffer holds the axis from end to end. Every
other axis is an identity and splits freely (the batch too, unless it is the scanned
axis).

The axis is a constant known when the model is loaded (a 0-d or one-element int32 or
int64 tensor), kept in the attributes. The gradient of a scan is the opposite scan of the
output gradient, with the same ``exclusive``: output ``j`` sums inputs ``i <= j`` (``<``
if exclusive), so input ``i`` receives from outputs ``j >= i`` (``>``).
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx2soap.ir import Operand, Whole, identity
from onnx2soap.ops.base import SAVES_NOTHING, C, CaseInput, InputKind, OpDef, X, case
from onnx2soap.ops.context import NodeContext, axis_names, make_op


@dataclass(frozen=True)
class CumSumAttrs:
    axis: int  # non-negative
    exclusive: bool
    reverse: bool


def convert(ctx: NodeContext, *, exclusive=0, reverse=0):
    x = ctx.tensor(0)
    rank = len(x.shape)
    for name, value in (("exclusive", exclusive), ("reverse", reverse)):
        if value not in (0, 1):
            raise ctx.fail(f"{name}={value}; accepted: 0 or 1")
    axis = ctx.constant(1)
    if axis.dtype.kind not in "iu" or axis.size != 1 or axis.ndim > 1:
        raise ctx.fail(
            f"axis must be a 0-d (or one-element) integer tensor, got {axis.dtype} "
            f"{list(axis.shape)}"
        )
    if rank == 0:
        raise ctx.fail("input is a scalar; CumSum needs an axis to scan")
    a = int(axis.reshape(()))
    if not -rank <= a < rank:
        raise ctx.fail(
            f"axis {a} is out of range for rank {rank} (accepted: [-{rank}, {rank - 1}])"
        )
    a = a + rank if a < 0 else a
    axes = tuple(Whole(dims=(d,)) if d == a else identity(d) for d in range(rank))
    dims = list(zip(axis_names(rank), x.shape, strict=True))
    attrs = CumSumAttrs(a, bool(exclusive), bool(reverse))
    return make_op(ctx, [Operand(x.name, axes)], attrs, dims, range(rank), 1)


def scan(xp, x, axis: int, exclusive: bool, reverse: bool):
    """The running sum of ``x`` along ``axis``, a fresh array of ``x``'s dtype. The
    exclusive sum shifts the inclusive one by one place (exact, unlike subtracting x)."""
    if reverse:
        x = xp.flip(x, axis=axis)
    total = xp.cumsum(x, axis=axis, dtype=x.dtype)
    if exclusive:
        head = [slice(None)] * x.ndim
        head[axis] = slice(0, 1)
        body = [slice(None)] * x.ndim
        body[axis] = slice(0, x.shape[axis] - 1)
        zero = xp.zeros_like(total[tuple(head)])
        total = xp.concatenate([zero, total[tuple(body)]], axis=axis)
    if reverse:
        total = xp.flip(total, axis=axis)
    return xp.ascontiguousarray(total)


def forward(xp, attrs: CumSumAttrs, inputs, args):
    return scan(xp, inputs[0], attrs.axis, attrs.exclusive, attrs.reverse)


def backward(xp, attrs: CumSumAttrs, inputs, output, grad_output, args):
    if inputs[0].dtype.kind != "f":
        return (None,)  # ids take no gradient
    return (scan(xp, grad_output, attrs.axis, attrs.exclusive, not attrs.reverse),)


def _ids(*shape: int) -> CaseInput:
    """An int64 data input (a padding mask, say)."""
    return CaseInput(InputKind.DATA, tuple(shape), None, "int64")


CUMSUM = OpDef(
    name="CumSum",
    versions=(11, 14),  # 14 adds bfloat16 and float16
    convert=convert,
    forward=forward,
    backward=backward,
    saves=SAVES_NOTHING,  # the opposite scan of the gradient; the input's dtype only
    cases=(
        case("cumsum", "CumSum", X(2, 5, 3), C(1)),
        case("cumsum_last_negative", "CumSum", X(2, 3, 4), C(-1)),
        case("cumsum_exclusive", "CumSum", X(3, 6), C(1), exclusive=1),
        case("cumsum_reverse", "CumSum", X(2, 4, 3), C(1), reverse=1),
        case("cumsum_reverse_exclusive", "CumSum", X(2, 3, 5), C(2), exclusive=1, reverse=1),
        case("cumsum_batch_axis", "CumSum", X(4, 3), C(0), opset=13),
        case("cumsum_axis_int32_1d", "CumSum", X(2, 5), C([1], dtype="int32")),
        # RoBERTa's position ids: a running count of the tokens that are not padding
        case("cumsum_ids", "CumSum", _ids(3, 6), C(1), output="int64"),
        case("cumsum_ids_exclusive", "CumSum", _ids(2, 5), C(1), output="int64", exclusive=1),
    ),
)

DEFINITIONS = (CUMSUM,)
