"""What LayerNormalization and RMSNormalization share: X normalized over the axes
``[axis, rank)``, their attribute checks, X's access maps and those of a parameter
(Scale, B) that varies along the normalized axes only.

Every output point depends on the whole of the normalized axes, so X reads each of them
with ``Whole(dims=(d,))``: the dim stays kept (the output indexes it one to one) but is
hidden, hence never split. A parameter reads the same dims with identity maps: they are
then *parameter* dims, still unsplittable because X hides them. Every leading axis (the
batch first) is an identity of X and splits freely; a parameter is size 1 there
(broadcast).
"""

from __future__ import annotations

import math

from onnx2soap.ir import AxisMap, Broadcast, Operand, Tensor, Whole, identity
from onnx2soap.ops.context import NodeContext

STASH_FLOAT = 1  # TensorProto.FLOAT: the statistics computed in float


def normalized_axis(ctx: NodeContext, x: Tensor, axis: int, epsilon: float, stash_type) -> int:
    """``axis`` made non-negative, after refusing by name what the op cannot compute: X
    not a float tensor of rank >= 2, an axis out of range, an epsilon that is not a
    finite number >= 0, a ``stash_type`` other than 1 (what exporters write: the
    statistics are computed in the run's float dtype)."""
    rank = len(x.shape)
    if not x.dtype.is_float:
        raise ctx.fail(f"X is {x.dtype.value}; a float tensor is needed")
    if rank < 2:
        raise ctx.fail(
            f"X {list(x.shape)} has rank {rank}: the only axis is the batch, which cannot be "
            "normalized over (rank >= 2 required)"
        )
    if not -rank <= axis < rank:
        raise ctx.fail(
            f"axis {axis} is out of range for rank {rank} (accepted: [-{rank}, {rank - 1}])"
        )
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ctx.fail(f"epsilon {epsilon} must be a finite number >= 0")
    if stash_type != STASH_FLOAT:
        raise ctx.fail(f"stash_type {stash_type} is not supported; accepted: 1 (float)")
    return axis + rank if axis < 0 else axis


def x_operand(x: Tensor, axis: int) -> Operand:
    """X: the normalized axes hidden (``Whole``), the leading ones identities."""
    axes: tuple[AxisMap, ...] = tuple(
        Whole(dims=(d,)) if d >= axis else identity(d) for d in range(len(x.shape))
    )
    return Operand(x.name, axes)


def param_operand(
    ctx: NodeContext, what: str, i: int, t: Tensor, x_shape: tuple[int, ...], axis: int
) -> Operand:
    """Parameter ``what`` (input ``i``): unidirectionally broadcastable to X, non-trivial
    only along the normalized axes (identity maps of X's dims there)."""
    if not t.dtype.is_float:
        raise ctx.fail(f"{what} (input {i}) is {t.dtype.value}; a float tensor is needed")
    rank = len(x_shape)
    if len(t.shape) > rank:
        raise ctx.fail(f"{what} {list(t.shape)} has a higher rank than X {list(x_shape)}")
    lead = rank - len(t.shape)
    axes: list[AxisMap] = []
    for k, size in enumerate(t.shape):
        d = lead + k
        if size not in (1, x_shape[d]):
            raise ctx.fail(
                f"{what} {list(t.shape)} does not broadcast to X {list(x_shape)} (axis {d})"
            )
        if d < axis and size != 1:
            raise ctx.fail(
                f"{what} {list(t.shape)} varies along axis {d}, before the normalized axes "
                f"[{axis}, {rank}); only the normalized axes may carry it"
            )
        axes.append(Broadcast() if size == 1 and x_shape[d] != 1 else identity(d))
    return Operand(t.name, tuple(axes))
