"""Element- and tuple-indexed gathers and scatters: GatherElements, GatherND,
ScatterElements and ScatterND.

Indices are constants (kept in the op's attributes, each task slicing its part by the
output tile's global origin) or int64 tensors computed at run time (an operand). They
take no gradient.

Loop nests. An axis indexed by data-dependent positions cannot be split from the
reading side, so it is read ``Whole``; every other axis is an identity and splits:

- GatherElements: the dims are the indices' axes (the output's). ``data`` is read whole
  along ``axis`` and one-to-one along the others; the indices one-to-one.
- GatherND: the dims are the indices' leading axes and data's trailing ones (the output's).
  ``data``'s ``batch_dims`` axes are identities of the indices' leading dims, its ``k``
  indexed axes are read whole, its trailing axes identities of the trailing dims. The
  indices' last axis (the index tuples) is read whole.
- ScatterElements / ScatterND: the dims are ``data``'s axes (the output's), ``data`` read
  one-to-one. A task must apply every update whose index falls in its tile, so the
  updates and indices are read whole along the scattered axes (ScatterElements: ``axis``;
  ScatterND: the index tuples' axes) and one-to-one along the others; the kernel keeps
  the updates whose targets lie in the task's tile (by ``TaskArgs.origin``) and sends
  the others to a dummy slot. So every output dim splits, exactly.

Duplicate indices with ``reduction='none'`` are undefined in ONNX: constant ones are
refused; run-time ones are resolved as onnxruntime's CPU kernel and numpy's assignment
do, the last update in the indices' row-major order wins (and alone takes a gradient).
Conflicting updates always write the same output element, which one task owns, so
the winner does not depend on the split. min/max/mul reductions are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np

from onnx2soap.ir import Affine, AxisMap, Operand, Tensor, Whole, identity
from onnx2soap.ops.base import C, CaseInput, InputKind, OpDef, Saved, W, X, case
from onnx2soap.ops.context import NodeContext, axis_names, make_op, one_kind, text
from onnx2soap.ops.kernel_util import scatter_add

# --- shared -------------------------------------------------------------------------------


class Reduction(Enum):
    NONE = "none"
    ADD = "add"


def _ids(*shape: int) -> CaseInput:
    """Run-time indices: the graph's (int64) data input."""
    return CaseInput(InputKind.DATA, tuple(shape), None, "int64")


def _normalize_axis(ctx: NodeContext, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ctx.fail(f"axis {axis} is out of range for data of rank {rank}")
    return axis + rank if axis < 0 else axis


def _index_input(ctx: NodeContext, i: int) -> tuple[Tensor | None, np.ndarray | None]:
    """(the run-time indices tensor, None) or (None, the constant indices)."""
    t = ctx.inputs[i] if i < len(ctx.inputs) else None
    if t is not None:
        if t.dtype.is_float:
            raise ctx.fail(f"indices '{t.name}' are {t.dtype.value}; integers are needed")
        return t, None
    value = np.asarray(ctx.constant(i))
    if value.dtype.kind not in "iu":
        raise ctx.fail(f"indices must be integers, got {value.dtype}")
    return None, value.astype(np.int64)


def _check_range(ctx: NodeContext, value: np.ndarray, size: int, what: str) -> None:
    bad = (value < -size) | (value >= size)
    if bad.any():
        raise ctx.fail(f"{what} {value[bad][:8].tolist()} out of range [-{size}, {size})")


def _check_within(ctx: NodeContext, shape, data_shape, axis: int) -> None:
    """Element-wise indices: on every axis but ``axis`` position p pairs with data's p."""
    if len(shape) != len(data_shape):
        raise ctx.fail(f"indices {list(shape)} and data {list(data_shape)} differ in rank")
    if any(s > d for i, (s, d) in enumerate(zip(shape, data_shape, strict=True)) if i != axis):
        raise ctx.fail(
            f"indices {list(shape)} exceed data {list(data_shape)} on an axis other than {axis}"
        )


def _reduction(ctx: NodeContext, reduction) -> Reduction:
    name = text(reduction)
    try:
        return Reduction(name)
    except ValueError:
        raise ctx.fail(
            f"reduction '{name}' is not supported (its gradient is not a plain "
            "selection); accepted: 'none', 'add'"
        ) from None


def _wrap(xp, ids, size):
    """ONNX: negative indices count from the end."""
    return xp.where(ids < 0, ids + size, ids)


def _constant(attrs_indices, shape, window) -> np.ndarray:
    """The part of constant indices a task reads: ``window`` is (start, count) per
    leading axis (numpy's slicing clips it to the indices); the rest whole."""
    full = np.asarray(attrs_indices, dtype=np.int64).reshape(shape)
    return full[tuple(slice(o, o + n) for o, n in window)]


def _flat(xp, coords, shape):
    """Row-major flat index of broadcastable per-axis ``coords`` in ``shape``."""
    flat = 0
    for c, s in zip(coords, shape, strict=True):
        flat = flat * s + c
    return flat


def _grid(xp, shape, axis):
    """Per axis of ``shape``, its coordinate array shaped to broadcast along the others."""
    ones = [1] * len(shape)
    return [
        xp.arange(n, dtype=np.int64).reshape([*ones[:i], n, *ones[i + 1 :]])
        for i, n in enumerate(shape)
    ]


def _last_writers(xp, dest, dummy: int):
    """Per update (flat, row-major), whether it is the last one writing its destination:
    the one ``reduction='none'`` keeps. Keys are unique, so any sort order is the same."""
    count = dest.size
    if count == 0:
        return xp.zeros(0, dtype=bool)
    key = dest * count + xp.arange(count, dtype=np.int64)
    order = xp.argsort(key)
    ranked = dest[order]
    last = xp.concatenate([ranked[1:] != ranked[:-1], xp.ones(1, dtype=bool)])
    winner = xp.zeros(count, dtype=bool)
    winner[order] = last  # a permutation: every index once
    return winner & (dest != dummy)


def _apply(xp, how: Reduction, data, rows, dest, dummy: int):
    """``data`` (the tile) viewed as ``dummy`` rows, with ``rows[i]`` written (or added)
    at row ``dest[i]``; rows sent to the dummy row are dropped."""
    width = data.size // dummy
    table = xp.concatenate([data.reshape(dummy, width), xp.zeros((1, width), data.dtype)])
    rows = rows.reshape(dest.size, width).astype(data.dtype)
    if how is Reduction.ADD:
        scatter_add(xp, table, dest, rows)
    else:  # the last writer of each row alone: a destination written once
        keep = _last_writers(xp, dest, dummy)
        table[xp.where(keep, dest, dummy)] = rows
    return table[:dummy].reshape(data.shape)


def _apply_grads(xp, how: Reduction, grad_output, dest, dummy: int):
    """(gradient of the tile's data, of the rows) for ``_apply``."""
    width = grad_output.size // dummy
    table = grad_output.reshape(dummy, width)
    table = xp.concatenate([table, xp.zeros((1, width), table.dtype)])  # the dummy row: no gradient
    picked = table[dest]
    if how is Reduction.ADD:
        return grad_output.copy(), picked
    keep = _last_writers(xp, dest, dummy)
    picked = picked * keep.reshape(-1, 1)
    table[dest] = 0  # overwritten elements: no gradient back to data
    return table[:dummy].reshape(grad_output.shape), picked


# The backwards read the indices where they are an operand (input 1), and only the shapes
# and dtypes of data and updates. Constant indices are no operand: a scatter's input 1 is
# then its updates, kept needlessly (one Saved serves every node of the op type).
_SAVES_INDICES = Saved(inputs=(1,), output=False)


def _float_grad(buffer, grad):
    """Integer operands (ids gathered or scattered) take no gradient."""
    return grad if buffer.dtype.kind == "f" else None


# --- GatherElements -------------------------------------------------------------------------


@dataclass(frozen=True)
class GatherElementsAttrs:
    axis: int  # non-negative
    size: int  # data's extent along axis: negative indices wrap by it
    indices: tuple[int, ...] | None = None  # constant indices, flattened; None: an operand
    indices_shape: tuple[int, ...] = ()


def convert_gather_elements(ctx: NodeContext, *, axis=0):
    data = ctx.operand(0)  # an integer constant too (RoBERTa's token types, by position)
    rank = len(data.shape)
    if rank == 0:
        raise ctx.fail("data must have rank >= 1")
    axis = _normalize_axis(ctx, axis, rank)
    ids, value = _index_input(ctx, 1)
    shape = ids.shape if ids is not None else tuple(value.shape)
    _check_within(ctx, shape, data.shape, axis)
    size = data.shape[axis]
    attrs = GatherElementsAttrs(axis, size, indices_shape=shape)
    if value is not None:
        _check_range(ctx, value, size, "indices")
        attrs = GatherElementsAttrs(axis, size, tuple(int(v) for v in value.ravel()), shape)
    # the output's dims are the indices' axes; data's `axis` is read at data-dependent
    # positions: whole, while the output dim along it still splits (the indices' axis)
    data_axes: tuple[AxisMap, ...] = tuple(
        Whole() if i == axis else identity(i) for i in range(rank)
    )
    operands = [Operand(data.name, data_axes)]
    if ids is not None:
        operands.append(Operand(ids.name, tuple(identity(i) for i in range(rank))))
    dims = list(zip(axis_names(rank), shape, strict=True))
    return make_op(ctx, operands, attrs, dims, range(rank), 1)


def _gather_elements_ids(xp, attrs: GatherElementsAttrs, inputs, args):
    if attrs.indices is None:
        ids = inputs[1]
    else:
        window = zip(args.origin, args.out_shape, strict=True)
        ids = xp.asarray(_constant(attrs.indices, attrs.indices_shape, window))
    return _wrap(xp, ids, attrs.size)


def forward_gather_elements(xp, attrs: GatherElementsAttrs, inputs, args):
    ids = _gather_elements_ids(xp, attrs, inputs, args)
    return xp.take_along_axis(inputs[0], ids, axis=attrs.axis)


def backward_gather_elements(xp, attrs: GatherElementsAttrs, inputs, output, grad_output, args):
    data = inputs[0]
    ids = _gather_elements_ids(xp, attrs, inputs, args)
    coords = _grid(xp, ids.shape, attrs.axis)
    coords[attrs.axis] = ids
    flat = xp.broadcast_to(_flat(xp, coords, data.shape), ids.shape)
    grad = xp.zeros(data.size, dtype=data.dtype)
    scatter_add(xp, grad, flat.reshape(-1), grad_output.reshape(-1).astype(data.dtype))
    grads = [_float_grad(data, grad.reshape(data.shape))]
    if attrs.indices is None:
        grads.append(None)
    return tuple(grads)


def id_bound_gather_elements(op, operand: int, tensors) -> int | None:
    return op.attrs.size if operand == 1 else None


GATHER_ELEMENTS = OpDef(
    moves_values=True,  # integers picked keep the bound of whoever reads them
    name="GatherElements",
    versions=(13,),
    convert=convert_gather_elements,
    forward=forward_gather_elements,
    backward=backward_gather_elements,
    saves=_SAVES_INDICES,
    id_bound=id_bound_gather_elements,
    cases=(
        case(
            "gatherelements_const_axis1",
            "GatherElements",
            X(3, 4, 2),
            C([3, 0, -1, 2, 1, 1, 0, -4, 2, 3, 0, 0], shape=(3, 2, 2)),
            axis=1,
        ),
        case(
            "gatherelements_const_axis0_negative",
            "GatherElements",
            X(4, 3),
            C([0, 3, -1, 2, 2, 1], shape=(2, 3)),
            axis=-2,
        ),
        case("gatherelements_ids_axis1", "GatherElements", W(3, 5), _ids(3, 4), axis=1),
        case("gatherelements_ids_axis0", "GatherElements", W(4, 3, 2), _ids(5, 2, 2)),
        # integers picked by computed positions (RoBERTa's token types, by position id)
        case(
            "gatherelements_int_constant_by_ids",
            "GatherElements",
            C([4, 0, -3, 2, 9, 1, 5, 5, 7, -1, 0, 3], shape=(2, 6)),
            _ids(2, 3),
            axis=1,
            output="int64",
        ),
    ),
)


# --- GatherND -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatherNDAttrs:
    batch_dims: int
    sizes: tuple[int, ...]  # data's extents along the k indexed axes
    indices: tuple[int, ...] | None = None  # constant indices, flattened; None: an operand
    indices_shape: tuple[int, ...] = ()
    # Per index component: the lookup axis whose coordinate it is everywhere (constant
    # indices that are a grid: ``mask[:, None, None, :]`` written as a GatherND), or None.
    aligned: tuple[int | None, ...] = ()


def _aligned(value: np.ndarray, sizes: tuple[int, ...]) -> tuple[int | None, ...]:
    """For each component of constant index tuples, the lookup axis (of the same extent
    as the data axis it indexes) whose coordinate it equals everywhere, if one does."""
    lead, used, found = value.shape[:-1], set(), []
    for j, size in enumerate(sizes):
        component = np.where(value[..., j] < 0, value[..., j] + size, value[..., j])
        hit = None
        for m, n in enumerate(lead):
            grid = np.arange(n).reshape([n if a == m else 1 for a in range(len(lead))])
            if m not in used and n == size and (component == grid).all():
                hit = m
                used.add(m)
                break
        found.append(hit)
    return tuple(found)


def convert_gather_nd(ctx: NodeContext, *, batch_dims=0):
    data = ctx.operand(0)
    ids, value = _index_input(ctx, 1)
    shape = ids.shape if ids is not None else tuple(value.shape)
    r, q, b = len(data.shape), len(shape), batch_dims
    if r < 1 or q < 1:
        raise ctx.fail(f"data {list(data.shape)} and indices {list(shape)} need rank >= 1")
    if not 0 <= b < min(r, q):
        raise ctx.fail(f"batch_dims {b} must be in [0, {min(r, q)})")
    if data.shape[:b] != shape[:b]:
        raise ctx.fail(
            f"the first {b} axes of data {list(data.shape)} and indices {list(shape)} differ"
        )
    k = shape[-1]
    if not 1 <= k <= r - b:
        raise ctx.fail(f"indices' last axis {k} must be in [1, {r - b}] (rank {r}, batch {b})")
    sizes = tuple(data.shape[b : b + k])
    attrs = GatherNDAttrs(b, sizes, indices_shape=shape)
    if value is not None:
        for j, size in enumerate(sizes):
            _check_range(ctx, value[..., j], size, f"indices into axis {b + j}")
        flat = tuple(int(v) for v in value.ravel())
        attrs = GatherNDAttrs(b, sizes, flat, shape, _aligned(value, sizes))
    lead, trail = shape[:-1], data.shape[b + k :]
    dims = [
        *(("n" if i == 0 else f"i{i}", s) for i, s in enumerate(lead)),
        *(("d" if i == 0 else f"d{i}", s) for i, s in enumerate(trail)),
    ]
    # An indexed axis is read at data-dependent positions, whole; one a grid component
    # reads at its lookup coordinate is an identity of that lookup dim, and splits.
    aligned = attrs.aligned or (None,) * k
    data_axes = (
        *(identity(i) for i in range(b)),
        *(Whole() if m is None else identity(m) for m in aligned),
        *(identity(q - 1 + i) for i in range(len(trail))),
    )
    operands = [Operand(data.name, data_axes)]
    if ids is not None:  # the index tuples' axis is read whole
        operands.append(Operand(ids.name, (*(identity(i) for i in range(q - 1)), Whole())))
    return make_op(ctx, operands, attrs, dims, range(len(dims)), 1)


def _gather_nd_rows(xp, attrs: GatherNDAttrs, inputs, args):
    """(the shape of data as [batch * indexed positions, trailing], the flat row of each
    output in it, the tile's [batch, lookups, trailing] shape), from data's shape alone:
    the backward reads no values of data (Saved)."""
    data = inputs[0]
    b, k = attrs.batch_dims, len(attrs.sizes)
    q = len(attrs.indices_shape)
    if attrs.indices is None:
        ids = inputs[1]
    else:
        window = zip(args.origin[: q - 1], args.out_shape[: q - 1], strict=True)
        ids = xp.asarray(_constant(attrs.indices, attrs.indices_shape, window))
    batch = math.prod(ids.shape[:b])
    lookups = math.prod(ids.shape[b:-1])
    trail = math.prod(data.shape[b + k :])
    # the buffer's extents: whole indexed axes, or the task's part of an aligned one
    extents = data.shape[b : b + k]
    positions = math.prod(extents)
    ids = ids.reshape(batch, lookups, k)
    aligned = attrs.aligned or (None,) * k
    coords = [
        _wrap(xp, ids[..., j], size) - (0 if m is None else args.origin[m])
        for j, (size, m) in enumerate(zip(attrs.sizes, aligned, strict=True))
    ]
    within = _flat(xp, coords, extents)
    rows = xp.arange(batch, dtype=np.int64).reshape(batch, 1) * positions + within
    return (batch * positions, trail), rows.reshape(-1), (batch, lookups, trail)


def forward_gather_nd(xp, attrs: GatherNDAttrs, inputs, args):
    table_shape, rows, _ = _gather_nd_rows(xp, attrs, inputs, args)
    return inputs[0].reshape(table_shape)[rows].reshape(args.out_shape)


def backward_gather_nd(xp, attrs: GatherNDAttrs, inputs, output, grad_output, args):
    data = inputs[0]
    table_shape, rows, (batch, lookups, trail) = _gather_nd_rows(xp, attrs, inputs, args)
    grad = xp.zeros(table_shape, dtype=data.dtype)
    values = grad_output.reshape(batch * lookups, trail).astype(data.dtype)
    scatter_add(xp, grad, rows, values)
    grads = [_float_grad(data, grad.reshape(data.shape))]
    if attrs.indices is None:
        grads.append(None)
    return tuple(grads)


def id_bound_gather_nd(op, operand: int, tensors) -> int | None:
    """Valid run-time tuples: every component below the smallest indexed extent."""
    return min(op.attrs.sizes) if operand == 1 else None


GATHER_ND = OpDef(
    moves_values=True,
    name="GatherND",
    versions=(13,),
    convert=convert_gather_nd,
    forward=forward_gather_nd,
    backward=backward_gather_nd,
    saves=_SAVES_INDICES,
    id_bound=id_bound_gather_nd,
    cases=(
        # whole elements: k == rank
        case(
            "gathernd_const_elements",
            "GatherND",
            X(3, 4),
            C([0, 1, 2, -1, 1, 3, -3, 0], shape=(2, 2, 2)),
        ),
        # slices: k < rank, trailing axes split
        case("gathernd_const_slices", "GatherND", X(4, 3, 2), C([3, -1, 0, 2], shape=(2, 2, 1))),
        # batch_dims: the batch axis stays an identity (and splits)
        case(
            "gathernd_const_batch",
            "GatherND",
            X(2, 3, 4, 2),
            C([0, 1, 2, 3, 1, 0, -1, -1, 2, 0, 0, 2], shape=(2, 3, 2)),
            batch_dims=1,
        ),
        # a grid: mask[:, None, None, :] as the dynamo exporter writes it (RoBERTa's)
        case(
            "gathernd_const_grid",
            "GatherND",
            X(2, 3),
            C([i for a in range(2) for t in range(3) for i in (a, t)], shape=(2, 1, 3, 2)),
        ),
        case(
            "gathernd_const_grid_swapped",
            "GatherND",
            X(3, 4, 2),
            C([i for t in range(4) for a in range(3) for i in (a, t)], shape=(4, 3, 2)),
        ),
        case("gathernd_ids", "GatherND", W(3, 4, 2), _ids(3, 2, 2)),
        case("gathernd_ids_batch", "GatherND", W(3, 4, 5), _ids(3, 2, 1), batch_dims=1),
    ),
)


# --- ScatterElements ------------------------------------------------------------------------


@dataclass(frozen=True)
class ScatterElementsAttrs:
    axis: int  # non-negative
    size: int  # data's extent along axis: negative indices wrap by it
    reduction: Reduction
    indices: tuple[int, ...] | None = None  # constant indices, flattened; None: an operand
    indices_shape: tuple[int, ...] = ()


def convert_scatter_elements(ctx: NodeContext, *, axis=0, reduction="none"):
    data, updates = ctx.operand(0), ctx.operand(2)
    one_kind(ctx, [data, updates], "data and updates")
    rank = len(data.shape)
    if rank == 0:
        raise ctx.fail("data must have rank >= 1")
    axis = _normalize_axis(ctx, axis, rank)
    how = _reduction(ctx, reduction)
    ids, value = _index_input(ctx, 1)
    shape = ids.shape if ids is not None else tuple(value.shape)
    if updates.shape != shape:
        raise ctx.fail(f"updates {list(updates.shape)} and indices {list(shape)} differ")
    _check_within(ctx, shape, data.shape, axis)
    size = data.shape[axis]
    attrs = ScatterElementsAttrs(axis, size, how, indices_shape=shape)
    if value is not None:
        _check_range(ctx, value, size, "indices")
        if how is Reduction.NONE:
            targets = np.stack(np.indices(shape), axis=-1).reshape(-1, rank)
            targets[:, axis] = np.where(value < 0, value + size, value).ravel()
            if len(np.unique(targets, axis=0)) != len(targets):
                raise ctx.fail("duplicate indices with reduction 'none' are undefined in ONNX")
        attrs = ScatterElementsAttrs(axis, size, how, tuple(int(v) for v in value.ravel()), shape)
    # updates (and indices) are read whole along `axis`: the task keeps those whose index
    # falls in its tile; along the other axes position p updates output p (the buffer,
    # clipped to the updates, starts at the tile's origin)
    update_axes = tuple(Whole() if i == axis else identity(i) for i in range(rank))
    operands = [Operand(data.name, tuple(identity(i) for i in range(rank)))]
    if ids is not None:
        operands.append(Operand(ids.name, update_axes))
    operands.append(Operand(updates.name, update_axes))
    dims = list(zip(axis_names(rank), data.shape, strict=True))
    return make_op(ctx, operands, attrs, dims, range(rank), 1)


def _scatter_elements_dest(xp, attrs: ScatterElementsAttrs, inputs, args):
    """Per update (flat), its flat position in the task's tile, or the dummy slot (the
    tile's size) for those another task applies."""
    updates = inputs[-1]
    a = attrs.axis
    if attrs.indices is None:
        ids = inputs[1]
    else:
        window = [(o, n) for o, n in zip(args.origin, args.out_shape, strict=True)]
        window[a] = (0, attrs.indices_shape[a])
        ids = xp.asarray(_constant(attrs.indices, attrs.indices_shape, window))
    local = _wrap(xp, ids, attrs.size) - args.origin[a]
    mine = (local >= 0) & (local < args.out_shape[a])
    coords = _grid(xp, updates.shape, a)
    coords[a] = xp.where(mine, local, 0)
    dummy = math.prod(args.out_shape)
    flat = xp.broadcast_to(_flat(xp, coords, args.out_shape), updates.shape)
    return xp.where(mine, flat, dummy).reshape(-1), dummy


def forward_scatter_elements(xp, attrs: ScatterElementsAttrs, inputs, args):
    data, updates = inputs[0], inputs[-1]
    dest, dummy = _scatter_elements_dest(xp, attrs, inputs, args)
    return _apply(xp, attrs.reduction, data, updates.reshape(-1), dest, dummy)


def backward_scatter_elements(xp, attrs: ScatterElementsAttrs, inputs, output, grad_output, args):
    data, updates = inputs[0], inputs[-1]
    dest, dummy = _scatter_elements_dest(xp, attrs, inputs, args)
    grad_data, grad_updates = _apply_grads(xp, attrs.reduction, grad_output, dest, dummy)
    grads = [_float_grad(data, grad_data.astype(data.dtype))]
    if attrs.indices is None:
        grads.append(None)
    grads.append(_float_grad(updates, grad_updates.reshape(updates.shape).astype(updates.dtype)))
    return tuple(grads)


def id_bound_scatter_elements(op, operand: int, tensors) -> int | None:
    return op.attrs.size if operand == 1 and op.attrs.indices is None else None


SCATTER_ELEMENTS = OpDef(
    moves_values=True,  # data and updates; the indices have a bound of their own
    name="ScatterElements",
    versions=(13, 16, 18),
    convert=convert_scatter_elements,
    forward=forward_scatter_elements,
    backward=backward_scatter_elements,
    saves=_SAVES_INDICES,
    id_bound=id_bound_scatter_elements,
    cases=(
        case(
            "scatterelements_const_axis1",
            "ScatterElements",
            X(3, 5),
            C([4, 0, -2, 1, 3, 0, 2, 4], shape=(2, 4)),
            W(2, 4),
            axis=1,
        ),
        case(
            "scatterelements_const_axis0_opset13",
            "ScatterElements",
            X(4, 3, 2),
            C([3, 0, 1, -4, 2, 3, 1, 1, 0, 2, 3, 0], shape=(2, 3, 2)),
            W(2, 3, 2),
            opset=13,
        ),
        case(
            "scatterelements_const_add_duplicates",
            "ScatterElements",
            X(3, 4),
            C([1, 1, 3, 1, 0, 0, 2, 2, 3], shape=(3, 3)),
            W(3, 3),
            axis=-1,
            reduction="add",
            opset=18,
        ),
        # run-time indices (duplicates likely: the last writer wins), data a weight
        case("scatterelements_ids", "ScatterElements", W(3, 6), _ids(3, 4), W(3, 4), axis=1),
        case(
            "scatterelements_ids_add",
            "ScatterElements",
            W(4, 3),
            _ids(5, 2),
            W(5, 2),
            reduction="add",
            opset=16,
        ),
        # label ids: the start id written into column 0 (T5's shift-right)
        case(
            "scatterelements_ids_const_updates",
            "ScatterElements",
            _ids(3, 5),
            C([0, 0, 0], shape=(3, 1)),
            C([7, 7, 7], shape=(3, 1)),
            axis=1,
            output="int64",
        ),
    ),
)


# --- ScatterND ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScatterNDAttrs:
    sizes: tuple[int, ...]  # data's extents along the k indexed (leading) axes
    reduction: Reduction
    indices: tuple[int, ...] | None = None  # constant indices, flattened; None: an operand
    indices_shape: tuple[int, ...] = ()
    # Constant indices [[o], [o + 1], ...] (a slice assignment, ``x[o:o + n] = u``): the
    # first row the updates write; None otherwise.
    run: int | None = None


def _run_start(value: np.ndarray, sizes: tuple[int, ...]) -> int | None:
    """Where constant indices of shape [n, 1] write consecutive rows from, if they do."""
    if value.ndim != 2 or value.shape[1] != 1:
        return None
    rows = np.where(value < 0, value + sizes[0], value).ravel()
    if (rows != rows[0] + np.arange(len(rows))).any():
        return None
    return int(rows[0])


def convert_scatter_nd(ctx: NodeContext, *, reduction="none"):
    # data and updates: floats, or integers (T5's and BART's shift-right writes the label
    # ids into a constant of zeros), an integer constant among them as an operand
    data, updates = ctx.operand(0), ctx.operand(2)
    one_kind(ctx, [data, updates], "data and updates")
    how = _reduction(ctx, reduction)
    ids, value = _index_input(ctx, 1)
    shape = ids.shape if ids is not None else tuple(value.shape)
    r, q = len(data.shape), len(shape)
    if r < 1 or q < 1:
        raise ctx.fail(f"data {list(data.shape)} and indices {list(shape)} need rank >= 1")
    k = shape[-1]
    if not 1 <= k <= r:
        raise ctx.fail(f"indices' last axis {k} must be in [1, {r}]")
    want = (*shape[:-1], *data.shape[k:])
    if updates.shape != want:
        raise ctx.fail(f"updates {list(updates.shape)} must be {list(want)}")
    sizes = tuple(data.shape[:k])
    attrs = ScatterNDAttrs(sizes, how, indices_shape=shape)
    if value is not None:
        for j, size in enumerate(sizes):
            _check_range(ctx, value[..., j], size, f"indices into axis {j}")
        if how is Reduction.NONE:
            tuples = np.where(value < 0, value + np.array(sizes), value).reshape(-1, k)
            if len(np.unique(tuples, axis=0)) != len(tuples):
                raise ctx.fail("duplicate indices with reduction 'none' are undefined in ONNX")
        run = _run_start(value, sizes)
        attrs = ScatterNDAttrs(sizes, how, tuple(int(v) for v in value.ravel()), shape, run)
    # the updates' lookup axes (and all of the indices) are read whole: the task keeps the
    # tuples that fall in its tile; their trailing axes are data's trailing ones. A slice
    # assignment reads its updates row for row instead (a shifted copy of data's axis 0),
    # so the batch, if it is there, goes on through it.
    lookups = q - 1
    trailing = tuple(identity(k + i) for i in range(r - k))
    update_axes: tuple[AxisMap, ...] = (*(Whole() for _ in range(lookups)), *trailing)
    if attrs.run is not None:
        update_axes = (Affine(((0, 1),), -attrs.run), *trailing)
    operands = [Operand(data.name, tuple(identity(i) for i in range(r)))]
    if ids is not None:
        operands.append(Operand(ids.name, tuple(Whole() for _ in range(q))))
    operands.append(Operand(updates.name, update_axes))
    dims = list(zip(axis_names(r), data.shape, strict=True))
    return make_op(ctx, operands, attrs, dims, range(r), 1)


def _scatter_nd_dest(xp, attrs: ScatterNDAttrs, inputs, args):
    """Per index tuple, the flat row (over the tile's first k axes) it writes, or the
    dummy row for tuples another task applies."""
    k = len(attrs.sizes)
    tile = args.out_shape[:k]
    if attrs.run is not None:  # the buffer holds the updates rows that land in the tile
        first = min(max(args.origin[0] - attrs.run, 0), len(attrs.indices))
        rows = inputs[-1].shape[0]
        return xp.arange(rows, dtype=np.int64) + (first + attrs.run - args.origin[0]), tile[0]
    if attrs.indices is None:
        ids = inputs[1]
    else:
        ids = xp.asarray(np.asarray(attrs.indices, dtype=np.int64))
    ids = ids.reshape(-1, k)
    locals_ = [_wrap(xp, ids[:, j], size) - args.origin[j] for j, size in enumerate(attrs.sizes)]
    mine = xp.ones(ids.shape[0], dtype=bool)
    for c, n in zip(locals_, tile, strict=True):
        mine = mine & (c >= 0) & (c < n)
    coords = [xp.where(mine, c, 0) for c in locals_]
    dummy = math.prod(tile)
    return xp.where(mine, _flat(xp, coords, tile), dummy), dummy


def forward_scatter_nd(xp, attrs: ScatterNDAttrs, inputs, args):
    data, updates = inputs[0], inputs[-1]
    dest, dummy = _scatter_nd_dest(xp, attrs, inputs, args)
    return _apply(xp, attrs.reduction, data, updates, dest, dummy)


def backward_scatter_nd(xp, attrs: ScatterNDAttrs, inputs, output, grad_output, args):
    data, updates = inputs[0], inputs[-1]
    dest, dummy = _scatter_nd_dest(xp, attrs, inputs, args)
    grad_data, grad_updates = _apply_grads(xp, attrs.reduction, grad_output, dest, dummy)
    grads = [_float_grad(data, grad_data.astype(data.dtype))]
    if attrs.indices is None:
        grads.append(None)
    grads.append(_float_grad(updates, grad_updates.reshape(updates.shape).astype(updates.dtype)))
    return tuple(grads)


def id_bound_scatter_nd(op, operand: int, tensors) -> int | None:
    return min(op.attrs.sizes) if operand == 1 and op.attrs.indices is None else None


SCATTER_ND = OpDef(
    moves_values=True,  # data and updates; the indices have a bound of their own
    name="ScatterND",
    versions=(13, 16, 18),
    convert=convert_scatter_nd,
    forward=forward_scatter_nd,
    backward=backward_scatter_nd,
    saves=_SAVES_INDICES,
    id_bound=id_bound_scatter_nd,
    cases=(
        # whole elements: k == rank
        case(
            "scatternd_const_elements",
            "ScatterND",
            X(3, 4),
            C([0, 1, 2, -1, 1, 3], shape=(3, 2)),
            W(3),
        ),
        # slices: k < rank; the trailing axes split on both sides
        case(
            "scatternd_const_slices",
            "ScatterND",
            X(4, 3, 2),
            C([3, -4, 2], shape=(3, 1)),
            W(3, 3, 2),
            opset=13,
        ),
        case(
            "scatternd_const_add_duplicates",
            "ScatterND",
            X(3, 2, 2),
            C([1, 0, 1, 1, -2, 0, 2, 1], shape=(4, 2)),
            W(4, 2),
            reduction="add",
            opset=16,
        ),
        # updates the data input, data a weight
        case(
            "scatternd_const_updates_data",
            "ScatterND",
            W(5, 2),
            C([4, 1], shape=(2, 1)),
            X(2, 2),
            opset=18,
        ),
        # run-time indices (duplicates likely: the last writer wins)
        case("scatternd_ids", "ScatterND", W(4, 3), _ids(3, 1), W(3, 3)),
        case("scatternd_ids_add", "ScatterND", W(3, 4), _ids(2, 3, 2), W(2, 3), reduction="add"),
        # slice assignments (consecutive rows, ``x[1:4] = u``): updates read row for row
        case("scatternd_slice_assign", "ScatterND", X(5, 3), C([1, 2, 3], shape=(3, 1)), W(3, 3)),
        case(
            "scatternd_slice_assign_data_updates",
            "ScatterND",
            W(6, 2),
            C([-4, -3, -2, -1], shape=(4, 1)),
            X(4, 2),
            reduction="add",
            opset=16,
        ),
        # label ids shifted one place along into zeros (T5's and BART's shift-right)
        case(
            "scatternd_ids_into_int_constant",
            "ScatterND",
            C([0] * 12, shape=(4, 3)),
            C([1, 2, 3], shape=(3, 1)),
            _ids(3, 3),
            output="int64",
        ),
    ),
)

DEFINITIONS = (GATHER_ELEMENTS, GATHER_ND, SCATTER_ELEMENTS, SCATTER_ND)
