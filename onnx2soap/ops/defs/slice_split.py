"""Slice and Split: a box of the input, read through offset (and, for Slice, strided)
access maps.

Output index ``j`` of a sliced axis reads input index ``start + j * step``: the map
``Affine(((d, step),), start)``. A task's buffer then starts at its first output's
element, so the kernel takes every ``step``-th element of its buffer from index 0 and
needs no global coordinate. Only positive steps: a negative step reverses the axis,
which no map with positive coefficients expresses.

Split has one output per part; the converter returns one op per named output, each a
copy of its part (an offset identity map along the axis).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx2soap.ir import Affine, AxisMap, Operand, Tensor, identity
from onnx2soap.ops.base import NONE, SAVES_NOTHING, C, OpDef, X, case
from onnx2soap.ops.context import NodeContext, axis_names, make_op
from onnx2soap.ops.defs.transpose import int_values, normalized_axes
from onnx2soap.ops.kernel_util import strided


@dataclass(frozen=True)
class SliceAttrs:
    steps: tuple[int, ...]  # per input axis, all positive (1 where not sliced)


@dataclass(frozen=True)
class _Range:
    """One axis of a box: ``count`` elements from ``start``, ``step`` apart."""

    start: int
    count: int
    step: int = 1


def _box_op(
    ctx: NodeContext,
    x: Tensor,
    ranges: dict[int, _Range],
    *,
    output: str | None = None,
    name: str | None = None,
):
    """The op that copies the box ``ranges`` (per axis; whole axes elsewhere) of ``x``."""
    rank = len(x.shape)
    box = [ranges.get(a, _Range(0, s)) for a, s in enumerate(x.shape)]
    empty = [a for a, r in enumerate(box) if r.count < 1]
    if empty:
        raise ctx.fail(f"the output would be empty along axes {empty} (input {list(x.shape)})")
    dims = list(zip(axis_names(rank), (r.count for r in box), strict=True))
    axes: list[AxisMap] = []
    for a, r in enumerate(box):
        axes.append(identity(a) if r == _Range(0, x.shape[a]) else Affine(((a, r.step),), r.start))
    attrs = SliceAttrs(tuple(r.step for r in box))
    operands = [Operand(x.name, tuple(axes))]
    return make_op(ctx, operands, attrs, dims, range(rank), 0, output=output, name=name)


# --- Slice -------------------------------------------------------------------------------------


def _slice_range(ctx: NodeContext, size: int, start: int, end: int, step: int) -> _Range:
    """The elements ``start:end:step`` select of an axis of ``size``, clamped as the spec
    says (negative values count from the end; INT_MAX and INT_MIN are clamped too)."""
    if step == 0:
        raise ctx.fail("a step of 0 is invalid")
    if step < 0:
        raise ctx.fail(
            f"step {step} reverses the axis; only positive steps are supported (a reversed "
            "read has no access map)"
        )
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, 0), size)
    return _Range(start, max(0, math.ceil((end - start) / step)), step)


def convert_slice(ctx: NodeContext):
    x = ctx.tensor(0)
    rank = len(x.shape)
    starts = int_values(ctx, 1, "starts")
    ends = int_values(ctx, 2, "ends")
    axes = ctx.optional_constant(3)
    steps = ctx.optional_constant(4)
    axes_ = int_values(ctx, 3, "axes") if axes is not None else tuple(range(len(starts)))
    steps_ = int_values(ctx, 4, "steps") if steps is not None else (1,) * len(starts)
    if not len(starts) == len(ends) == len(axes_) == len(steps_):
        raise ctx.fail(
            f"starts {list(starts)}, ends {list(ends)}, axes {list(axes_)} and steps "
            f"{list(steps_)} must have the same length"
        )
    sliced = normalized_axes(ctx, axes_, rank, "axes")
    ranges = {
        a: _slice_range(ctx, x.shape[a], s, e, st)
        for a, s, e, st in zip(sliced, starts, ends, steps_, strict=True)
    }
    return _box_op(ctx, x, ranges)


def slice_forward(xp, attrs: SliceAttrs, inputs, args):
    # The buffer starts at the tile's first element: every step-th from index 0.
    index = tuple(strided(0, n, s) for n, s in zip(args.out_shape, attrs.steps, strict=True))
    return inputs[0][index].copy()


def slice_backward(xp, attrs: SliceAttrs, inputs, output, grad_output, args):
    index = tuple(strided(0, n, s) for n, s in zip(args.out_shape, attrs.steps, strict=True))
    x = inputs[0]  # its shape and dtype alone (Saved)
    grad = xp.zeros(x.shape, dtype=x.dtype)  # the skipped elements (steps > 1) take none
    grad[index] = grad_output
    return (grad,)


# --- Split -------------------------------------------------------------------------------------


def _split_sizes(ctx: NodeContext, size: int, parts: int, num_outputs) -> tuple[int, ...]:
    given = len(ctx.inputs) > 1 and (ctx.inputs[1] is not None or ctx.is_constant(1))
    if given and num_outputs is not None:
        raise ctx.fail("give either the 'split' input or the num_outputs attribute, not both")
    if given:
        sizes = int_values(ctx, 1, "split")
        if len(sizes) != parts or any(s < 0 for s in sizes) or sum(sizes) != size:
            raise ctx.fail(
                f"split {list(sizes)} must be {parts} non-negative sizes summing to the axis "
                f"size {size}"
            )
        return sizes
    if num_outputs is not None:
        if num_outputs != parts:
            raise ctx.fail(f"num_outputs={num_outputs} but the node has {parts} outputs")
        # The spec: equal parts of ceil(size / n), the last one smaller if need be.
        chunk = -(-size // parts)
        last = size - chunk * (parts - 1)
        if last < 0:
            raise ctx.fail(f"an axis of size {size} cannot be split into {parts} parts of {chunk}")
        return (chunk,) * (parts - 1) + (last,)
    if size % parts:
        raise ctx.fail(f"an axis of size {size} does not split into {parts} equal parts")
    return (size // parts,) * parts


def convert_split(ctx: NodeContext, *, axis=0, num_outputs=None):
    x = ctx.tensor(0)
    rank = len(x.shape)
    (axis,) = normalized_axes(ctx, (axis,), rank, "axis")
    sizes = _split_sizes(ctx, x.shape[axis], len(ctx.outputs), num_outputs)
    ops, offset = [], 0
    for k, (out, size) in enumerate(zip(ctx.outputs, sizes, strict=True)):
        if out:  # an omitted output ('') is simply not computed
            part = {axis: _Range(offset, size)}
            ops.append(_box_op(ctx, x, part, output=out, name=f"{ctx.name}:{k}"))
        offset += size
    return tuple(ops)


def split_forward(xp, attrs, inputs, args):
    return inputs[0].copy()  # the buffer is the part


def split_backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output.copy(),)


SLICE = OpDef(
    moves_values=True,
    name="Slice",
    versions=(13,),
    convert=convert_slice,
    forward=slice_forward,
    backward=slice_backward,
    saves=SAVES_NOTHING,
    cases=(
        case("slice_middle", "Slice", X(2, 6, 5), C([1, 1]), C([5, 4]), C([1, 2])),
        case(
            "slice_steps",
            "Slice",
            X(2, 7, 9),
            C([1, 0]),
            C([7, 9]),
            C([1, 2]),
            C([2, 3]),
        ),
        case(
            "slice_negative",
            "Slice",
            X(2, 5, 6),
            C([-4, -5]),
            C([-1, 2**63 - 1]),
            C([-2, -1]),
            C([1, 2]),
        ),
        # ends past the axis and starts below -size are clamped
        case("slice_clamped", "Slice", X(3, 4, 5), C([-100, 2]), C([100, 1000]), C([1, 2])),
        # axes omitted: starts/ends apply to axes 0, 1, ... (axis 0 kept whole)
        case("slice_axes_omitted", "Slice", X(2, 6), C([0, 1]), C([2, 5])),
        case(
            "slice_axes_omitted_steps",
            "Slice",
            X(2, 8, 3),
            C([0, 1]),
            C([2**63 - 1, 8]),
            NONE,
            C([1, 3]),
        ),
    ),
)

SPLIT = OpDef(
    moves_values=True,
    name="Split",
    versions=(13, 18),
    convert=convert_split,
    forward=split_forward,
    backward=split_backward,
    saves=SAVES_NOTHING,
    # The op test harness builds one-output nodes: one part, the whole axis.
    cases=(
        case("split_one_part", "Split", X(2, 4, 3), axis=1),
        case("split_sizes", "Split", X(2, 3, 5), C([5]), axis=-1),
        case("split_num_outputs", "Split", X(2, 6), axis=1, num_outputs=1, opset=18),
        case("split_batch_whole", "Split", X(3, 2)),
    ),
)

DEFINITIONS = (SLICE, SPLIT)
