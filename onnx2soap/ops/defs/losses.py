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
from onnx2soap.ops.base import LABELS, OpDef, X, case
from onnx2soap.ops.context import NodeContext, axis_names, make_op, text

CROSS_ENTROPY_NAME = "SoftmaxCrossEntropyLoss"
MSE_NAME = "MeanSquaredError"


class LossReduction(Enum):
    MEAN = "mean"
    SUM = "sum"


@dataclass(frozen=True)
class LossAttrs:
    reduction: LossReduction = LossReduction.MEAN
    ignore_index: int | None = None


def convert_cross_entropy(ctx: NodeContext, *, ignore_index=None, reduction="mean"):
    scores, labels = ctx.tensor(0), ctx.tensor(1)
    reduction = text(reduction)
    if ctx.optional(2) is not None:
        raise ctx.fail("class weights (input 2) are not supported")
    if reduction not in ("mean", "sum"):
        raise ctx.fail(f"reduction '{reduction}' is not supported (use mean or sum)")
    if len(scores.shape) != 2 or labels.shape != scores.shape[:1]:
        raise ctx.fail(
            f"scores must be [N, C] and labels [N]; got {list(scores.shape)} and "
            f"{list(labels.shape)}"
        )
    if scores.shape[1] < 1:
        raise ctx.fail("scores have no classes (axis 1 is 0)")
    return cross_entropy_op(ctx, scores, labels, LossAttrs(LossReduction(reduction), ignore_index))


def cross_entropy_op(ctx: NodeContext, scores: Tensor, labels: Tensor, attrs: LossAttrs):
    dims = [("n", scores.shape[0]), ("c", scores.shape[1])]
    operands = [
        Operand(scores.name, (identity(0), identity(1))),
        Operand(labels.name, (identity(0),)),
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


def _log_softmax(xp, scores):
    """Stable: the row max is subtracted before exp, so exp never overflows and the
    logsumexp term is >= 0."""
    shifted = scores - scores.max(axis=1, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))


def _targets(xp, attrs: LossAttrs, labels, classes: int):
    """(one-hot of the kept labels (n, C), kept mask (n, 1)), both bool.

    Rows labelled ignore_index have an all-false one-hot row and a false mask: they
    contribute nothing to the loss nor to the gradient, even where ignore_index is a valid
    class. A label outside ``[0, C)`` that is not ignore_index is an error in ORT; here its
    row is all false too (checking would synchronize a GPU on every step).
    """
    labels = labels.reshape(-1, 1)
    if attrs.ignore_index is None:
        keep = xp.ones(labels.shape, dtype=bool)
    else:
        keep = labels != attrs.ignore_index
    onehot = (labels == xp.arange(classes).reshape(1, -1)) & keep
    return onehot, keep


def _scale(xp, grad_output, args, dtype):
    """d(partial loss)/d(sum of per-sample losses), in the scores' dtype: a 0-d array is
    not a weak scalar under NEP 50 and would otherwise promote float32 gradients."""
    return xp.asarray(grad_output / args.loss_scale, dtype=dtype)


def cross_entropy_forward(xp, attrs: LossAttrs, inputs, args):
    scores, labels = inputs
    onehot, _ = _targets(xp, attrs, labels, scores.shape[1])
    total = -(_log_softmax(xp, scores) * onehot).sum()
    return xp.asarray(total / args.loss_scale, dtype=scores.dtype)


def cross_entropy_backward(xp, attrs: LossAttrs, inputs, output, grad_output, args):
    scores, labels = inputs
    onehot, keep = _targets(xp, attrs, labels, scores.shape[1])
    softmax = xp.exp(_log_softmax(xp, scores))
    return (softmax * keep - onehot) * _scale(xp, grad_output, args, scores.dtype), None


def mse_forward(xp, attrs: LossAttrs, inputs, args):
    pred, target = inputs
    diff = pred - target
    return xp.asarray((diff * diff).sum() / args.loss_scale, dtype=pred.dtype)


def mse_backward(xp, attrs: LossAttrs, inputs, output, grad_output, args):
    pred, target = inputs
    return (pred - target) * (2 * _scale(xp, grad_output, args, pred.dtype)), None


CROSS_ENTROPY = OpDef(
    name=CROSS_ENTROPY_NAME,
    versions=(13,),
    convert=convert_cross_entropy,
    forward=cross_entropy_forward,
    backward=cross_entropy_backward,
    loss_scale=cross_entropy_scale,
    cases=(
        case("ce_mean", CROSS_ENTROPY_NAME, X(6, 4), LABELS(6)),
        case("ce_sum", CROSS_ENTROPY_NAME, X(5, 3), LABELS(5), reduction="sum"),
        case("ce_ignore", CROSS_ENTROPY_NAME, X(7, 4), LABELS(7), ignore_index=1),
    ),
)

MSE = OpDef(
    name=MSE_NAME,
    onnx=False,
    convert=convert_mse,
    forward=mse_forward,
    backward=mse_backward,
    loss_scale=mse_scale,
    cases=(case("mse", MSE_NAME, X(4, 3), LABELS(4, 3, dtype="float32")),),
)

DEFINITIONS = (CROSS_ENTROPY, MSE)
