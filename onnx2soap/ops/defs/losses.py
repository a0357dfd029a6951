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
from onnx2soap.ops.base import LABELS, SAVES_INPUTS, OpDef, X, case, owned
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


# The cross-entropy's passes over the scores (max, shift, exp, sum; the backward's shift,
# exp, scale) run over blocks of rows of about this many scores (1 MiB of float32): a
# block stays in a core's L2 cache from its first pass to its last, so the scores come
# from memory once, not once a pass (a GPT-2 step's 1024 x 50,257 logits on one CPU
# thread: the forward 2.2x, the backward 1.6x faster). A GPU's passes run at its memory's
# bandwidth anyway: its blocks are only so large that a GPT's logits take a few launches.
BLOCK_SCORES, GPU_BLOCK_SCORES = 1 << 18, 1 << 24


def _block_rows(xp, classes: int) -> int:
    """Rows of ``classes`` scores a block holds (one at least)."""
    block = BLOCK_SCORES if xp.__name__ == "numpy" else GPU_BLOCK_SCORES
    return max(1, block // max(classes, 1))


def _row_blocks(xp, *arrays):
    """The arrays, the scores first ([..., C]) and each with the scores' rows ([..., k],
    C-contiguous), in blocks of ``_block_rows`` rows viewed as [rows, k]; scores whose
    rows do not follow one another in memory (ONNX's class axis 1 moved last) as one
    block, as they are."""
    if not arrays[0].flags.c_contiguous:
        yield arrays
        return
    flat = [a.reshape(-1, a.shape[-1]) for a in arrays]  # views: every array is C-ordered
    step = _block_rows(xp, arrays[0].shape[-1])
    for lo in range(0, flat[0].shape[0], step):
        yield tuple(a[lo : lo + step] for a in flat)


def _log_sum_exp(xp, scores, in_place: bool = False):
    """Each row's log Σ exp over the last axis (keepdims), stable: the row max is
    subtracted before exp, so exp never overflows. Block by block (``_row_blocks``): a
    block's shifted scores, exponentiated in place, live in one scratch block (the whole
    scores where they are one block), or, ``in_place``, in the scores themselves (the
    same values)."""
    lse = xp.empty((*scores.shape[:-1], 1), dtype=scores.dtype)
    scratch = None
    for block, into in _row_blocks(xp, scores, lse):
        if in_place:
            shifted = block
        else:
            if scratch is None:
                scratch = xp.empty(block.shape, dtype=block.dtype)
            shifted = scratch[: block.shape[0]]
        top = block.max(axis=-1, keepdims=True)
        xp.subtract(block, top, out=shifted)
        total = xp.exp(shifted, out=shifted).sum(axis=-1, keepdims=True)
        into[...] = top + xp.log(total)
    return lse


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


def _scores_owned(xp, attrs: LossAttrs, scores, args) -> bool:
    """Whether the kernels may work in the scores (``OpDef.overwrites``): the step's own
    float32 copy, its classes laid out as rows (the backward's gradient is made there)."""
    return owned(args, 0) and xp.moveaxis(scores, attrs.class_axis, -1).flags.c_contiguous


def cross_entropy_forward(xp, attrs: LossAttrs, inputs, args):
    """Σ over counted rows of logsumexp(row) - row[label]. Each row's logsumexp is left
    in the stash for the backward; where the scores are the step's own copy, it is made
    in them (the label's score taken first)."""
    scores, labels = inputs
    last = xp.moveaxis(scores, attrs.class_axis, -1)
    index, counted = _picked(xp, attrs, labels, last.shape[-1])
    chosen = xp.take_along_axis(last, index, axis=-1)  # a copy: the row's label's score
    lse = _log_sum_exp(xp, last, _scores_owned(xp, attrs, scores, args))
    if args.stash is not None:  # the executor keeps it for the backward
        args.stash["lse"] = lse
    total = ((lse - chosen) * counted).sum()
    return xp.asarray(total / args.loss_scale, dtype=scores.dtype)


def cross_entropy_backward(xp, attrs: LossAttrs, inputs, output, grad_output, args):
    """softmax(row) - onehot(label), on counted rows, times the loss's scale: the softmax
    made in place in the one array returned (the scores themselves where they are the
    step's own copy), from the forward's logsumexp where it was kept, the label's 1
    taken off where it lies."""
    scores, labels = inputs
    last = xp.moveaxis(scores, attrs.class_axis, -1)
    classes = last.shape[-1]
    index, counted = _picked(xp, attrs, labels, classes)
    scale = _scale(xp, grad_output, args, scores.dtype)
    lse = args.stash.get("lse") if args.stash is not None else None
    if lse is None:
        lse = _log_sum_exp(xp, last)
    if _scores_owned(xp, attrs, scores, args):
        grad = last
    else:
        grad = xp.empty(last.shape, dtype=last.dtype)  # rows contiguous: viewed as [rows, C]
    factor = counted * scale
    for rows_in, rows_lse, rows_factor, rows_out in _row_blocks(xp, last, lse, factor, grad):
        xp.subtract(rows_in, rows_lse, out=rows_out)
        xp.exp(rows_out, out=rows_out)
        rows_out *= rows_factor
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
    """The forward's logsumexp holds a block of shifted scores, exponentiated in place
    (``BLOCK_SCORES``, as numpy runs it; all of them where the class axis is not the last
    one; none where it works in the step's own copy: ``overwrites``); the backward reads
    the forward's logsumexp from the stash and holds nothing beside the gradient it
    returns (measured under tracemalloc: tests/ops/test_losses.py). A GPU's blocks are
    larger (``GPU_BLOCK_SCORES``: 64 MiB of float32 at most), unpriced."""
    scores = shapes[0]
    total = math.prod(scores)
    classes = scores[attrs.class_axis]
    if attrs.class_axis != len(scores) - 1 or classes == 0:
        return total * itemsize, 0
    rows = min(total // classes, max(1, BLOCK_SCORES // classes))
    return rows * classes * itemsize, 0


CROSS_ENTROPY = OpDef(
    name=CROSS_ENTROPY_NAME,
    versions=(13,),
    convert=convert_cross_entropy,
    forward=cross_entropy_forward,
    backward=cross_entropy_backward,
    saves=SAVES_INPUTS,  # the scores and the labels, not the loss
    loss_scale=cross_entropy_scale,
    workspace=cross_entropy_workspace,
    stashes=True,  # each row's logsumexp, from the forward to the backward (not priced)
    overwrites=frozenset({0}),  # the scores' float32 copy under mixed precision
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
