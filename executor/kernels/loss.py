"""SoftmaxCrossEntropyLoss and mean squared error: one task's partial loss.

A task holds some samples. Its forward is the sum of their per-sample losses divided by
``args.loss_scale``, the divisor of the *whole* batch's reduction (labels kept for a
cross-entropy mean, elements for an MSE mean, 1 for sum), so the executor sums partial
losses across tasks and gets the loss of the batch. ``attrs.reduction`` is therefore not
read here: the executor has folded it into ``loss_scale``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from executor.kernels.base import Array, TaskArgs
from onnx2soap.ir import LossAttrs


def _log_softmax(xp, scores: Array) -> Array:
    """Stable: the row max is subtracted before exp, so exp never overflows and the
    logsumexp term is >= 0."""
    shifted = scores - scores.max(axis=1, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))


def _targets(xp, attrs: LossAttrs, labels: Array, classes: int) -> tuple[Array, Array]:
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


def _scale(xp, grad_output: Array, args: TaskArgs, dtype) -> Array:
    """d(partial loss)/d(sum of per-sample losses), in the scores' dtype: a 0-d array is
    not a weak scalar under NEP 50 and would otherwise promote float32 gradients."""
    return xp.asarray(grad_output / args.loss_scale, dtype=dtype)


@dataclass(frozen=True)
class SoftmaxCrossEntropyKernel:
    def forward(self, xp, attrs: LossAttrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        scores, labels = inputs
        onehot, _ = _targets(xp, attrs, labels, scores.shape[1])
        total = -(_log_softmax(xp, scores) * onehot).sum()
        return xp.asarray(total / args.loss_scale, dtype=scores.dtype)

    def backward(self, xp, attrs: LossAttrs, inputs, output, grad_output, args):
        scores, labels = inputs
        onehot, keep = _targets(xp, attrs, labels, scores.shape[1])
        softmax = xp.exp(_log_softmax(xp, scores))
        return (softmax * keep - onehot) * _scale(xp, grad_output, args, scores.dtype), None


@dataclass(frozen=True)
class MeanSquaredErrorKernel:
    def forward(self, xp, attrs: LossAttrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        pred, target = inputs
        diff = pred - target
        return xp.asarray((diff * diff).sum() / args.loss_scale, dtype=pred.dtype)

    def backward(self, xp, attrs: LossAttrs, inputs, output, grad_output, args):
        pred, target = inputs
        return (pred - target) * (2 * _scale(xp, grad_output, args, pred.dtype)), None
