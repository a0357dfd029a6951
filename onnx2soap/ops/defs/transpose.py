"""Transpose: output axis ``i`` reads input axis ``perm[i]``, so every input axis is an
identity map of the dim that indexes its output axis and every dim splits freely.

Also the few helpers the layout ops (Squeeze/Unsqueeze, Slice/Split, Expand, Pad) share:
whether a tensor carries the batch axis, and reading integer constant inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from onnx2soap.ir import Operand, Tensor, identity
from onnx2soap.ops.base import SAVES_NOTHING, OpDef, X, case
from onnx2soap.ops.context import NodeContext, axis_names, make_op

# --- shared by the layout ops --------------------------------------------------------------


# Tensors whose axis 0 is the batch: the data, the labels and what ops compute from them.
def carries_batch(t: Tensor) -> bool:
    """Computed from a data input: axis 0 started as the batch. Weights, constants and
    what is computed from them alone have none, so any layout change is fine on them."""
    return t.batched


def int_values(ctx: NodeContext, i: int, what: str) -> tuple[int, ...]:
    """Integer constant input ``i`` (a 1-D tensor, or a scalar) as Python ints."""
    value = ctx.constant(i)
    if value.dtype.kind not in "iu" or value.ndim > 1:
        raise ctx.fail(
            f"{what} (input {i}) must be a 1-D integer tensor, got {value.dtype} "
            f"{list(value.shape)}"
        )
    return tuple(int(v) for v in value.reshape(-1))


def normalized_axes(ctx: NodeContext, axes: Sequence[int], rank: int, what: str) -> tuple[int, ...]:
    """``axes`` made non-negative (in their given order); out of range or repeated refused."""
    if any(not -rank <= a < rank for a in axes):
        raise ctx.fail(
            f"{what} {list(axes)} out of range for rank {rank} (accepted: [-{rank}, {rank - 1}])"
        )
    found = tuple(a + rank if a < 0 else a for a in axes)
    if len(set(found)) != len(found):
        raise ctx.fail(f"{what} {list(axes)} name an axis twice")
    return found


# --- Transpose -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransposeAttrs:
    perm: tuple[int, ...]  # output axis i is input axis perm[i]

    @property
    def inverse(self) -> tuple[int, ...]:
        inv = [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            inv[p] = i
        return tuple(inv)


def convert(ctx: NodeContext, *, perm=None):
    x = ctx.tensor(0)
    rank = len(x.shape)
    perm = tuple(reversed(range(rank))) if perm is None else tuple(int(p) for p in perm)
    if sorted(perm) != list(range(rank)):
        raise ctx.fail(f"perm {list(perm)} is not a permutation of the {rank} axes")
    # The batch axis may move (an RNN's [time, batch, ...] layout): the dims' kinds
    # follow it through the access maps, and splits stay exact whatever axis it is on.
    attrs = TransposeAttrs(perm)
    out = tuple(x.shape[p] for p in perm)
    dims = list(zip(axis_names(rank), out, strict=True))
    # Input axis a is output axis inverse[a]: the dim of that output axis indexes it.
    axes = tuple(identity(attrs.inverse[a]) for a in range(rank))
    return make_op(ctx, [Operand(x.name, axes)], attrs, dims, range(rank), 0)


def forward(xp, attrs: TransposeAttrs, inputs, args):
    return xp.transpose(inputs[0], attrs.perm).copy()


def backward(xp, attrs: TransposeAttrs, inputs, output, grad_output, args):
    return (xp.transpose(grad_output, attrs.inverse).copy(),)


TRANSPOSE = OpDef(
    moves_values=True,
    name="Transpose",
    versions=(13, 21, 23, 24, 25),
    convert=convert,
    forward=forward,
    backward=backward,
    saves=SAVES_NOTHING,  # the inverse permutation of the gradient
    cases=(
        case("transpose_nhwc", "Transpose", X(2, 3, 4, 5), perm=[0, 2, 3, 1]),
        case("transpose_swap_last", "Transpose", X(3, 4, 2), perm=[0, 2, 1]),
        case("transpose_identity", "Transpose", X(2, 3), perm=[0, 1]),
        case("transpose_5d", "Transpose", X(2, 2, 3, 1, 4), perm=[0, 4, 1, 3, 2]),
        case("transpose_rank1_default", "Transpose", X(5)),
    ),
)

DEFINITIONS = (TRANSPOSE,)
