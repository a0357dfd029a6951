"""Gather: rows of ``data`` picked by integer ``indices`` along ``axis``: an embedding
lookup (data a weight, indices token ids) or a selection by constant indices.

Every axis of ``data`` but the gathered one is read one-to-one, so a lookup splits over
the ids' axes (the batch, the positions) and over the embedding width. With ids read at
run time, the gathered axis (the vocabulary) is a reduction dim ``v`` that splits too,
Megatron-style: each task looks up the ids that fall in its rows and writes zeros for the
others, and the partial tiles are summed (``LoopNest.partial_dims``). The backward
scatters the gradient rows back into the task's rows, repeated ids accumulating.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from onnx2soap.ir import Affine, AxisMap, Operand, TensorRole, Whole, identity
from onnx2soap.ops.base import C, CaseInput, InputKind, OpDef, Saved, W, X, case, output_copies
from onnx2soap.ops.context import NodeContext, make_op
from onnx2soap.ops.kernel_util import scatter_add

_COMPUTED = (TensorRole.ACTIVATION, TensorRole.INPUT)  # data read at run time


@dataclass(frozen=True)
class GatherAttrs:
    axis: int  # non-negative
    size: int  # data's extent along axis: negative ids wrap by it
    indices: tuple[int, ...] | None = None  # constant indices, flattened; None: an operand
    indices_shape: tuple[int, ...] = ()
    vocabulary: int | None = None  # the dim ``v`` of the gathered axis, when it splits
    # Constant indices that are a grid (offset + sum of coef * coordinate): the gathered
    # axis is read through that affine map, each task its own rows.
    grid: bool = False


def _grid(value: np.ndarray, size: int) -> tuple[tuple[tuple[int, int], ...], int] | None:
    """Constant indices equal to ``offset + sum(coef * coordinate)`` over their axes, each
    coef positive: ((index axis, coef), ...) and the offset; None if they are not."""
    v = np.where(value < 0, value + size, value)
    if v.ndim == 0:
        return None
    offset = int(v[(0,) * v.ndim])
    terms = []
    for m, n in enumerate(v.shape):
        if n > 1:
            step = int(v[tuple(int(a == m) for a in range(v.ndim))]) - offset
            if step < 0:
                return None
            if step:
                terms.append((m, step))
    if not terms:
        return None
    grid = sum(
        c * np.arange(v.shape[m]).reshape([-1 if a == m else 1 for a in range(v.ndim)])
        for m, c in terms
    )
    return (tuple(terms), offset) if np.array_equal(v, offset + grid + 0 * v) else None


def convert(ctx: NodeContext, *, axis=0):
    data = ctx.operand(0)  # an integer constant too, picked by ids computed at run time
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
    kept = range(len(dims))
    gathered: AxisMap = Whole()
    fitted = _grid(value, size) if ids is None and data.role in _COMPUTED else None
    if fitted is not None:
        # a grid of rows (legacy exports write mask[:, None, None, :] as a Gather of the
        # flattened mask at i * T + j): each task reads its rows, the batch traced through
        terms, offset = fitted
        gathered = Affine(tuple((axis + m, c) for m, c in terms), offset)
        attrs = replace(attrs, grid=True)
    if ids is not None and data.dtype.is_float:
        # the vocabulary: a reduction whose partial lookups are summed (ids gathered from
        # ids gain nothing by it, and their tiles would be summed at int64 width)
        vocabulary = len(dims)
        dims.append(("v", size))
        gathered = identity(vocabulary)
        attrs = replace(attrs, vocabulary=vocabulary)
    data_axes = (
        *(identity(i) for i in range(axis)),
        gathered,
        *(identity(axis + k + i) for i in range(rank - axis - 1)),
    )
    operands = [Operand(data.name, data_axes)]
    if ids is not None:
        operands.append(Operand(ids.name, tuple(identity(axis + i) for i in range(k))))
    op = make_op(ctx, operands, attrs, dims, kept, 1)
    if attrs.vocabulary is None:
        return op
    vocab = (attrs.vocabulary,)
    return replace(op, nest=replace(op.nest, partial_dims=vocab, free_dims=vocab))


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


def _rows(xp, attrs: GatherAttrs, inputs, args):
    """(ids made local to the task's rows, which of them fall in its rows): all of them,
    unless the vocabulary is split."""
    ids = _indices(xp, attrs, inputs, args)
    if attrs.grid:  # the buffer starts at the task's first (and smallest) row
        return ids - ids.reshape(-1)[0], None
    if attrs.vocabulary is None or not args.box:
        return ids, None
    lo, hi = args.box[attrs.vocabulary]
    local = ids - lo
    mine = (local >= 0) & (local < hi - lo)
    return xp.where(mine, local, 0), mine


def _as_output(mine, attrs: GatherAttrs, rank: int):
    """The ids' mask shaped to broadcast against the output (or its gradient)."""
    before, after = attrs.axis, rank - attrs.axis - mine.ndim
    return mine.reshape((1,) * before + mine.shape + (1,) * after)


def forward(xp, attrs: GatherAttrs, inputs, args):
    ids, mine = _rows(xp, attrs, inputs, args)
    out = xp.take(inputs[0], ids, axis=attrs.axis)
    if mine is not None:  # other tasks' rows: zeros, for the partial sums (where, not a
        # product: an inf in the row standing in for them must not become NaN)
        out = xp.where(_as_output(mine, attrs, out.ndim), out, 0).astype(out.dtype)
    return out


def backward(xp, attrs: GatherAttrs, inputs, output, grad_output, args):
    data = inputs[0]
    if data.dtype.kind != "f":  # integers picked: no gradient
        return (None,) if attrs.indices is not None else (None, None)
    ids, mine = _rows(xp, attrs, inputs, args)
    if mine is not None:
        mask = _as_output(mine, attrs, grad_output.ndim)
        grad_output = xp.where(mask, grad_output, 0).astype(grad_output.dtype)
    k, a = ids.ndim, attrs.axis
    # grad_output is lead + ids + trail: bring the ids' axes first, flattened, and the
    # gathered axis of the gradient first too, then add each row where its id points.
    g = xp.moveaxis(grad_output, tuple(range(a, a + k)), tuple(range(k)))
    g = g.reshape(-1, *g.shape[k:])
    # data's shape and dtype alone (Saved): the gradient in data's layout, seen with the
    # gathered axis first
    grad = xp.zeros(data.shape, dtype=data.dtype)
    scatter_add(xp, xp.moveaxis(grad, a, 0), ids.reshape(-1), g)
    grads = [grad]
    if attrs.indices is None:
        grads.append(None)
    return tuple(grads)


def id_bound(op, operand: int, tensors) -> int | None:
    """Token ids index the data's gathered axis: valid ones are below its extent."""
    return op.attrs.size if operand == 1 else None


def _ids(*shape: int) -> CaseInput:
    return CaseInput(InputKind.DATA, tuple(shape), None, "int64")


GATHER = OpDef(
    moves_values=True,  # integers picked keep the bound of whoever reads them
    name="Gather",
    versions=(13,),
    convert=convert,
    forward=forward,
    backward=backward,
    workspace=output_copies(2.2, 2.2),
    saves=Saved(inputs=(1,), output=False),  # the ids (an operand); data's shape only
    id_bound=id_bound,
    cases=(
        # an embedding: a weight [vocabulary, width] read by token ids [batch, positions]
        case("gather_embedding", "Gather", W(7, 4), _ids(3, 5)),
        case("gather_embedding_1d_ids", "Gather", W(6, 3), _ids(4)),
        case("gather_weight_axis1", "Gather", W(3, 6), _ids(2, 2), axis=1),
        # constant indices into the data: a time step, two channels (negative wraps)
        case("gather_const_step", "Gather", X(2, 5, 3), C(2), axis=1),
        case("gather_const_channels", "Gather", X(3, 4, 2), C([3, -4, 1]), axis=-2),
        # a grid of rows, i * 4 + j + 1: each task reads its own
        case(
            "gather_const_grid",
            "Gather",
            X(13, 2),
            C([i * 4 + j + 1 for i in range(3) for j in range(2)], shape=(3, 1, 2)),
        ),
        case("gather_const_range", "Gather", X(2, 6), C([1, 2, 3, 4]), axis=1),
        # integers picked by ids: a table of positions or token types
        case(
            "gather_int_constant_by_ids", "Gather", C([5, -2, 0, 9, 3]), _ids(3, 4), output="int64"
        ),
    ),
)

DEFINITIONS = (GATHER,)
