"""Gather: rows of ``data`` picked by integer ``indices`` along ``axis``: an embedding
lookup (data a weight, indices token ids) or a selection by constant indices.

The gathered axis of ``data`` is read whole (which row a task needs depends on the ids'
values), every other axis one-to-one: so the lookup splits over the ids' axes (the
batch, the positions) and over the embedding width, and a task holds the whole
vocabulary of its width slice. The backward scatters the gradient rows back, repeated
ids accumulating. Splitting the vocabulary itself (Megatron-style partial lookups
summed) is a split along a reduction: not done yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx2soap.ir import Operand, Whole, identity
from onnx2soap.ops.base import C, CaseInput, InputKind, OpDef, W, X, case
from onnx2soap.ops.context import NodeContext, make_op
from onnx2soap.ops.kernel_util import scatter_add


@dataclass(frozen=True)
class GatherAttrs:
    axis: int  # non-negative
    size: int  # data's extent along axis: negative ids wrap by it
    indices: tuple[int, ...] | None = None  # constant indices, flattened; None: an operand
    indices_shape: tuple[int, ...] = ()


def convert(ctx: NodeContext, *, axis=0):
    data = ctx.tensor(0)
    rank = len(data.shape)
    if not -rank <= axis < rank:
        raise ctx.fail(f"axis {axis} is out of range for data of rank {rank}")
    axis = axis + rank if axis < 0 else axis
    size = data.shape[axis]
    ids = ctx.inputs[1] if len(ctx.inputs) > 1 else None
    if ids is None:  # constant indices: part of the op
        value = np.asarray(ctx.constant(1))
        if value.dtype.kind not in "iu":
            raise ctx.fail(f"indices must be integers, got {value.dtype}")
        if ((value < -size) | (value >= size)).any():
            raise ctx.fail(f"indices {value.ravel()[:8].tolist()} out of range [-{size}, {size})")
        index_shape = tuple(value.shape)
        attrs = GatherAttrs(axis, size, tuple(int(v) for v in value.ravel()), index_shape)
    else:
        if ids.dtype.is_float:
            raise ctx.fail(f"indices '{ids.name}' are {ids.dtype.value}; integers are needed")
        index_shape = ids.shape
        attrs = GatherAttrs(axis, size)
    k = len(index_shape)
    lead = [(f"a{i}", s) for i, s in enumerate(data.shape[:axis])]
    picked = [("n" if i == 0 else f"i{i}", s) for i, s in enumerate(index_shape)]
    trail = [("d" if i == 0 else f"d{i}", s) for i, s in enumerate(data.shape[axis + 1 :])]
    dims = [*lead, *picked, *trail]
    data_axes = (
        *(identity(i) for i in range(axis)),
        Whole(),
        *(identity(axis + k + i) for i in range(rank - axis - 1)),
    )
    operands = [Operand(data.name, data_axes)]
    if ids is not None:
        operands.append(Operand(ids.name, tuple(identity(axis + i) for i in range(k))))
    return make_op(ctx, operands, attrs, dims, range(len(dims)), 1)


def _indices(xp, attrs: GatherAttrs, inputs, args):
    """The task's ids: its region of the ids operand, or its part of the constant ids
    (the output tile's index axes, placed by its global origin)."""
    if attrs.indices is not None:
        full = np.asarray(attrs.indices, dtype=np.int64).reshape(attrs.indices_shape)
        a, k = attrs.axis, len(attrs.indices_shape)
        window = zip(args.origin[a : a + k], args.out_shape[a : a + k], strict=True)
        ids = xp.asarray(full[tuple(slice(o, o + n) for o, n in window)])
    else:
        ids = inputs[1]
    return xp.where(ids < 0, ids + attrs.size, ids)  # ONNX: negative ids count from the end


def forward(xp, attrs: GatherAttrs, inputs, args):
    return xp.take(inputs[0], _indices(xp, attrs, inputs, args), axis=attrs.axis)


def backward(xp, attrs: GatherAttrs, inputs, output, grad_output, args):
    data = inputs[0]
    ids = _indices(xp, attrs, inputs, args)
    k, a = ids.ndim, attrs.axis
    # grad_output is lead + ids + trail: bring the ids' axes first, flattened, and the
    # gathered axis of the gradient first too, then add each row where its id points.
    g = xp.moveaxis(grad_output, tuple(range(a, a + k)), tuple(range(k)))
    g = g.reshape(-1, *g.shape[k:])
    grad = xp.zeros_like(xp.moveaxis(data, a, 0))
    scatter_add(xp, grad, ids.reshape(-1), g)
    grads = [xp.ascontiguousarray(xp.moveaxis(grad, 0, a))]
    if attrs.indices is None:
        grads.append(None)
    return tuple(grads)


def id_bound(op, operand: int, tensors) -> int | None:
    """Token ids index the data's gathered axis: valid ones are below its extent."""
    return op.attrs.size if operand == 1 else None


def _ids(*shape: int) -> CaseInput:
    return CaseInput(InputKind.DATA, tuple(shape), None, "int64")


GATHER = OpDef(
    name="Gather",
    versions=(13,),
    convert=convert,
    forward=forward,
    backward=backward,
    id_bound=id_bound,
    cases=(
        # an embedding: a weight [vocabulary, width] read by token ids [batch, positions]
        case("gather_embedding", "Gather", W(7, 4), _ids(3, 5)),
        case("gather_embedding_1d_ids", "Gather", W(6, 3), _ids(4)),
        case("gather_weight_axis1", "Gather", W(3, 6), _ids(2, 2), axis=1),
        # constant indices into the data: a time step, two channels (negative wraps)
        case("gather_const_step", "Gather", X(2, 5, 3), C(2), axis=1),
        case("gather_const_channels", "Gather", X(3, 4, 2), C([3, -4, 1]), axis=-2),
    ),
)

DEFINITIONS = (GATHER,)
