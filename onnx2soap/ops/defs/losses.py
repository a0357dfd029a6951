"""SoftmaxCrossEntropyLoss and mean squared error (attached by onnx2soap, not an ONNX op):
one task's partial loss.

A task holds some samples. Its forward is the sum of their per-sample losses divided by
``args.loss_scale``, the divisor of the *whole* batch's reduction (labels kept for a
cross-entropy mean, elements for an MSE mean, 1 for sum), so the executor sums partial
losses across tasks and gets the loss of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from onnx2soap.ir import Operand, Tensor, identity
from onnx2soap.ops.base import LABELS, SAVES_INPUTS, OpDef, X, case
from onnx2soap.ops.context import NodeContext, axis_names, make_op, text

CROSS_ENTROPY_NAME = "SoftmaxCrossEntropyLoss"
MSE_NAME = "MeanSquaredError"


class LossReduction(Enum):
    MEAN = "mean"
    SUM = "sum"


@dataclass(frozen=True)
class LossAttrs:
    """``class_axis``: the scores' axis of classes: 1 in ONNX's SoftmaxCrossEntropyLoss
    ([N, C, d1, ...] with labels [N, d1, ...]); the last one in the cross-entropy onnx2soap
    attaches to a model's output ([N, C] or token logits [N, T, C] with labels [N, T])."""

    reduction: LossReduction = LossReduction.MEAN
    ignore_index: int | None = None
    class_axis: int = 1


def convert_cross_entropy(ctx: NodeContext, *, ignore_index=None, reduction="mean"):
    scores, labels = ctx.tensor(0), ctx.tensor(1)
    reduction = text(reduction)
    if ctx.optional(2) is not None:
        raise ctx.fail("class weights (input 2) are not supported")
    if reduction not in ("mean", "sum"):
        raise ctx.fail(f"reduction '{reduction}' is not supported (use mean or sum)")
    attrs = LossAttrs(LossReduction(reduction), ignore_index, class_axis=1)
    return cross_entropy_op(ctx, scores, labels, attrs)


def cross_entropy_op(ctx: NodeContext, scores: Tensor, labels: Tensor, attrs: LossAttrs):
    """Softmax cross-entropy over ``attrs.class_axis`` of ``scores``; labels have the
    scores' shape without that axis. The batch dim splits (partial losses are summed);
    every other dim is a reduction of the scalar loss."""
    rank, axis = len(scores.shape), attrs.class_axis
    expected = scores.shape[:axis] + scores.shape[axis + 1 :]
    if rank < 2 or not 0 < axis < rank or labels.shape != expected:
        where = "[N, C, d1, ...] and labels [N, d1, ...]" if axis == 1 else "[..., C] and [...]"
        raise ctx.fail(f"scores must be {where}; got {list(scores.shape)} and {list(labels.shape)}")
    if scores.shape[axis] < 1:
        raise ctx.fail(f"scores have no classes (axis {axis} is 0)")
    names = ["n", *(f"t{i}" for i in range(1, rank))]
    names[axis] = "c"
    dims = list(zip(names, scores.shape, strict=True))
    operands = [
        Operand(scores.name, tuple(identity(i) for i in range(rank))),
        Operand(labels.name, tuple(identity(i) for i in range(rank) if i != axis)),
    ]
    return make_op(ctx, operands, attrs, dims, (), 4, is_loss=True)


def mse_op(ctx: NodeContext, pred: Tensor, target: Tensor):
    dims = list(zip(axis_names(len(pred.shape)), pred.shape, strict=True))
    axes = tuple(identity(i) for i in range(len(pred.shape)))
    operands = [Operand(pred.name, axes), Operand(target.name, axes)]
    return make_op(ctx, operands, LossAttrs(), dims, (), 3, is_loss=True)


def convert_mse(ctx: NodeContext):
    return mse_op(ctx, ctx.tensor(0), ctx.tensor(1))


def cross_entropy_scale(attrs: LossAttrs, labels, pred_shape) -> float:
    if attrs.reduction is LossReduction.SUM:
        return 1.0
    ignore = attrs.ignore_index
    counted = labels.size if ignore is None else int((labels != ignore).sum())
    return float(max(counted, 1))


def mse_scale(attrs: LossAttrs, labels, pred_shape) -> float:
    return 1.0 if attrs.reduction is LossReduction.SUM else float(math.prod(pred_shape))


def _log_sum_exp(xp, scores):
    """Each row's log Σ exp over the last axis (keepdims), stable: the row max is
    subtracted before exp, so exp never overflows. One array of the scores' size lives
    at a time (the shifted scores, exponentiated in place)."""
    top = scores.max(axis=-1, keepdims=True)
    shifted = scores - top
    total = xp.exp(shifted, out=shifted).sum(axis=-1, keepdims=True)
    return top + xp.log(total)


def _picked(xp, attrs: LossAttrs, labels, classes: int):
    """(each row's label as an index into the last axis (..., 1), whether the row counts
    (..., 1) in the scores' dtype-agnostic bool).

    Rows labelled ignore_index count for nothing, in the loss and in the gradient, even
    where ignore_index is a valid class. A label outside ``[0, C)`` that is not
    ignore_index is an error in ORT; here its row counts for nothing too (checking would
    synchronize a GPU on every step). No one-hot of the labels is made: a [rows, C] array
    of bools where the scores need one number a row.
    """
    labels = labels[..., None]
    counted = (labels >= 0) & (labels < classes)
    if attrs.ignore_index is not None:
        counted &= labels != attrs.ignore_index
    return xp.where(counted, labels, 0), counted


def _scale(xp, grad_output, args, dtype):
    """d(partial loss)/d(sum of per-sample losses), in the scores' dtype: a 0-d array is
    not a weak scalar under NEP 50 and would otherwise promote float32 gradients."""
    return xp.asarray(grad_output / args.loss_scale, dtype=dtype)


def cross_entropy_forward(xp, attrs: LossAttrs, inputs, args):
    """Σ over counted rows of logsumexp(row) - row[label]."""
    scores, labels = inputs
    last = xp.moveaxis(scores, attrs.class_axis, -1)
    index, counted = _picked(xp, attrs, labels, last.shape[-1])
    chosen = xp.take_along_axis(last, index, axis=-1)
    total = ((_log_sum_exp(xp, last) - chosen) * counted).sum()
    return xp.asarray(total / args.loss_scale, dtype=scores.dtype)


def cross_entropy_backward(xp, attrs: LossAttrs, inputs, output, grad_output, args):
    """softmax(row) - onehot(label), on counted rows, times the loss's scale: the softmax
    made in place in the one array returned, the label's 1 taken off where it lies."""
    scores, labels = inputs
    last = xp.moveaxis(scores, attrs.class_axis, -1)
    classes = last.shape[-1]
    index, counted = _picked(xp, attrs, labels, classes)
    scale = _scale(xp, grad_output, args, scores.dtype)
    grad = xp.empty(last.shape, dtype=last.dtype)  # rows contiguous: viewed as [rows, C]
    xp.subtract(last, _log_sum_exp(xp, last), out=grad)
    xp.exp(grad, out=grad)
    grad *= counted * scale
    rows = grad.reshape(-1, classes)
    at = xp.arange(rows.shape[0])
    rows[at, index.reshape(-1)] -= (counted.reshape(-1) * scale).astype(grad.dtype)
    return xp.ascontiguousarray(xp.moveaxis(grad, -1, attrs.class_axis)), None


def mse_forward(xp, attrs: LossAttrs, inputs, args):
    pred, target = inputs
    diff = pred - target
    return xp.asarray((diff * diff).sum() / args.loss_scale, dtype=pred.dtype)


def mse_backward(xp, attrs: LossAttrs, inputs, output, grad_output, args):
    pred, target = inputs
    return (pred - target) * (2 * _scale(xp, grad_output, args, pred.dtype)), None


def cross_entropy_workspace(attrs, shapes, out_shape, itemsize: int) -> tuple[int, int]:
    """Per score: the forward's logsumexp holds the shifted scores, exponentiated in
    place; the backward's logsumexp holds them once more beside the gradient it returns
    (measured under tracemalloc)."""
    n = math.prod(shapes[0])
    return n * itemsize, n * itemsize


CROSS_ENTROPY = OpDef(
    name=CROSS_ENTROPY_NAME,
    versions=(13,),
    convert=convert_cross_entropy,
    forward=cross_entropy_forward,
    backward=cross_entropy_backward,
    saves=SAVES_INPUTS,  # the scores and the labels, not the loss
    loss_scale=cross_entropy_scale,
    workspace=cross_entropy_workspace,
    cases=(
        case("ce_mean", CROSS_ENTROPY_NAME, X(6, 4), LABELS(6)),
        case("ce_sum", CROSS_ENTROPY_NAME, X(5, 3), LABELS(5), reduction="sum"),
        case("ce_ignore", CROSS_ENTROPY_NAME, X(7, 4), LABELS(7), ignore_index=1),
        # ONNX's class axis is 1 also for per-position losses: [N, C, T] with labels [N, T]
        case("ce_positions", CROSS_ENTROPY_NAME, X(3, 4, 5), LABELS(3, 5)),
        case(
            "ce_positions_2d", CROSS_ENTROPY_NAME, X(2, 3, 2, 4), LABELS(2, 2, 4), reduction="sum"
        ),
    ),
)

MSE = OpDef(
    name=MSE_NAME,
    onnx=False,
    convert=convert_mse,
    forward=mse_forward,
    backward=mse_backward,
    saves=SAVES_INPUTS,  # the prediction and the target, not the loss
    loss_scale=mse_scale,
    cases=(case("mse", MSE_NAME, X(4, 3), LABELS(4, 3, dtype="float32")),),
)

DEFINITIONS = (CROSS_ENTROPY, MSE)
