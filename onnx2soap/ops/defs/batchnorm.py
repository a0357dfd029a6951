"""BatchNormalization: per-channel affine with batch statistics (training_mode=1) or with
the running statistics (training_mode=0).

training_mode=1 (what the legacy exporter writes in TRAINING mode) normalizes with the
mean and biased variance over the batch and spatial axes. Those axes are ``sync_dims``:
a plan may split them, and the tasks that share channels then combine their partial
statistics before finishing: forward, each task's (count, mean, sum of squared
deviations) merged in task order by Chan's parallel formula, which is as stable as two
passes (sum x and sum x^2 would cancel catastrophically for a channel whose mean is
large next to its spread, and N ranks would then differ from one device); backward,
the sums of dy and dy*xhat. Any split computes what one device does. The running
statistics are state: each task that holds channels writes
``momentum * running + (1 - momentum) * batch`` (ONNX's convention, so 0.9 where torch
says 0.1; the variance is the biased one, as the spec says, where torch
keeps the unbiased one). training_mode=0 reads mean and variance as constants: every
axis splits freely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from onnx2soap.ir import Binding, Operand, identity
from onnx2soap.ops.base import OpDef, Sample, Saved, Statistics, W, X, case, output_copies
from onnx2soap.ops.context import NodeContext, axis_names, make_op


@dataclass(frozen=True)
class BatchNormAttrs:
    epsilon: float
    momentum: float
    training: bool


def convert(ctx: NodeContext, *, epsilon=1e-5, momentum=0.9, training_mode=0):
    x = ctx.tensor(0)
    params = [ctx.tensor(i) for i in range(1, 5)]
    rank = len(x.shape)
    if rank < 2:
        raise ctx.fail(f"X {list(x.shape)} needs a channel axis (rank >= 2)")
    channels = x.shape[1]
    for i, t in enumerate(params, start=1):
        if t.shape != (channels,):
            raise ctx.fail(f"input {i} '{t.name}' is {list(t.shape)}; expected [{channels}]")
    if training_mode not in (0, 1):
        raise ctx.fail(f"training_mode must be 0 or 1, got {training_mode}")
    if not (math.isfinite(epsilon) and epsilon > 0) or not 0 <= momentum <= 1:
        raise ctx.fail(f"epsilon {epsilon} must be > 0 and momentum {momentum} in [0, 1]")
    if len([o for o in ctx.outputs[1:] if o]) and not training_mode:
        raise ctx.fail(
            "running statistics outputs without training_mode=1 (before opset 14 there is "
            "no training_mode: re-export with opset_version >= 14 to train BatchNorm)"
        )
    binding = Binding.STATE if training_mode else Binding.CONSTANT
    per_channel = (identity(1),)
    operands = [
        Operand(x.name, tuple(identity(i) for i in range(rank))),
        Operand(params[0].name, per_channel),
        Operand(params[1].name, per_channel),
        Operand(params[2].name, per_channel, binding=binding),
        Operand(params[3].name, per_channel, binding=binding),
    ]
    dims = list(zip(axis_names(rank), x.shape, strict=True))
    attrs = BatchNormAttrs(float(epsilon), float(momentum), bool(training_mode))
    op = make_op(ctx, operands, attrs, dims, range(rank), 4)
    if not training_mode:
        return op
    # The batch and spatial dims carry the statistics: per channel, three numbers forward
    # (count, mean, squared deviations) and two backward (sum dy, sum dy * xhat).
    sync = (0, *range(2, rank))
    nest = replace(op.nest, flops_per_point=8, sync_dims=sync, sync_values=(3, 2))
    return replace(op, nest=nest)


def _axes(x) -> tuple[int, ...]:
    return (0, *range(2, x.ndim))


def _channel(v, x):
    """A per-channel vector shaped to broadcast against ``x``."""
    return v.reshape(1, -1, *(1 for _ in range(x.ndim - 2)))


def _count(args) -> int:
    """Elements per channel in the whole tensor (every task's share together)."""
    return math.prod(args.full_shape) // args.full_shape[1]


def _moments(xp, x, args, attrs: BatchNormAttrs, mean_in, var_in):
    """(mean, biased variance) per channel: the batch's (combined statistics) or the
    running ones."""
    if not attrs.training:
        return mean_in, var_in
    return args.stats[0], args.stats[1]


def _normalized(xp, attrs, inputs, args):
    x, _, _, mean_in, var_in = inputs
    mean, var = _moments(xp, x, args, attrs, mean_in, var_in)
    inv = 1 / xp.sqrt(var + attrs.epsilon)
    return (x - _channel(mean, x)) * _channel(inv, x), inv


def forward(xp, attrs: BatchNormAttrs, inputs, args):
    x, scale, bias = inputs[0], inputs[1], inputs[2]
    xhat, _ = _normalized(xp, attrs, inputs, args)
    return xhat * _channel(scale, x) + _channel(bias, x)


def backward(xp, attrs: BatchNormAttrs, inputs, output, grad_output, args):
    x, scale = inputs[0], inputs[1]
    axes = _axes(x)
    xhat, inv = _normalized(xp, attrs, inputs, args)
    grad_scale = (grad_output * xhat).sum(axis=axes)
    grad_bias = grad_output.sum(axis=axes)
    gain = _channel(scale * inv, x)
    if attrs.training:
        count = _count(args)
        sum_dy, sum_dy_xhat = args.grad_stats[0], args.grad_stats[1]
        centered = (
            grad_output - _channel(sum_dy / count, x) - xhat * _channel(sum_dy_xhat / count, x)
        )
        grad_x = gain * centered
    else:
        grad_x = gain * grad_output
    return grad_x, grad_scale, grad_bias, None, None


def partial_forward(xp, attrs, inputs, args):
    """(count, mean, sum of squared deviations) of the task's tile, per channel."""
    x = inputs[0]
    axes = _axes(x)
    count = x.size // x.shape[1]
    mean = x.mean(axis=axes) if count else xp.zeros(x.shape[1], dtype=x.dtype)
    deviations = ((x - _channel(mean, x)) ** 2).sum(axis=axes)
    return xp.stack([xp.full_like(mean, count), mean, deviations])


def combine_forward(xp, partials):
    """Chan et al.'s pairwise update, task by task in the group's order: (mean, biased
    variance) per channel."""
    count, mean, m2 = partials[0][0], partials[0][1], partials[0][2]
    for part in partials[1:]:
        n_b, mean_b, m2_b = part[0], part[1], part[2]
        total = count + n_b
        safe = xp.maximum(total, 1)
        delta = mean_b - mean
        mean = mean + delta * (n_b / safe)
        m2 = m2 + m2_b + delta * delta * (count * n_b / safe)
        count = total
    return xp.stack([mean, m2 / xp.maximum(count, 1)])


def combine_backward(xp, partials):
    return partials.sum(axis=0)


def partial_backward(xp, attrs, inputs, output, grad_output, args):
    xhat, _ = _normalized(xp, attrs, inputs, args)
    axes = _axes(grad_output)
    return xp.stack([grad_output.sum(axis=axes), (grad_output * xhat).sum(axis=axes)])


def update_state(xp, attrs: BatchNormAttrs, inputs, args):
    x, mean_in, var_in = inputs[0], inputs[3], inputs[4]
    mean, var = _moments(xp, x, args, attrs, mean_in, var_in)
    m = attrs.momentum
    return ((3, mean_in * m + mean * (1 - m)), (4, var_in * m + var * (1 - m)))


def _bn(id: str, shape, training: int, sample: Sample = Sample.NORMAL, **attrs):
    c = shape[1]
    return case(
        id,
        "BatchNormalization",
        X(*shape),
        W(c),
        W(c),
        W(c),
        W(c),
        opset=15,
        sample=sample,
        training_mode=training,
        extra_outputs=2 if training else 0,
        **attrs,
    )


BATCH_NORMALIZATION = OpDef(
    name="BatchNormalization",
    versions=(9, 14, 15),
    convert=convert,
    forward=forward,
    backward=backward,
    workspace=output_copies(2.2, 2.2),
    # x and the scale (xhat is recomputed), the running statistics it normalizes with in
    # inference; the backward's partial sums read the same. Not the bias, nor y.
    saves=Saved(inputs=(0, 1, 3, 4), output=False),
    statistics=Statistics(
        forward=partial_forward,
        backward=partial_backward,
        combine_forward=combine_forward,
        combine_backward=combine_backward,
        update=update_state,
    ),
    cases=(
        _bn("bn_train_2d", (4, 3, 5, 4), 1),
        _bn("bn_train_1d_eps", (5, 2, 6), 1, epsilon=1e-3, momentum=0.8),
        _bn("bn_train_fc", (6, 4), 1),
        # Positive draws: the running variance must be.
        _bn("bn_inference_2d", (3, 3, 4, 5), 0, sample=Sample.POSITIVE),
        _bn("bn_inference_3d", (2, 2, 3, 2, 3), 0, sample=Sample.POSITIVE, epsilon=0.01),
    ),
)

DEFINITIONS = (BATCH_NORMALIZATION,)
