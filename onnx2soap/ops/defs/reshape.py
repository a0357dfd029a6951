"""Flatten and Reshape: re-layouts, pure data movement, split as far as the layout allows.

The input and output shapes are cut into groups of consecutive axes with equal
products. Per group:

- one axis to one axis: an identity;
- one axis split into several ([N, T, H*D] -> [N, T, H, D], attention's heads): the
  input axis is ``Affine(h * D + d)``; only the outer output dim may split (the inner
  ones have a granule of their whole size), so every task reads one contiguous range;
- several axes merged into one ([N, T, H, D] -> [N, T, H*D]): the output dim splits in
  whole multiples of the inner axes (its granule); the outer input axis is a ``Grouped``
  map of it, the inner ones are read whole;
- anything else: read whole, not split.

Every task's buffer is then exactly its tile's data in C order, so the kernel is a
reshape of the local buffer. Copies, so outputs never alias inputs.
"""

from __future__ import annotations

import math
from dataclasses import replace

from onnx2soap.ir import (
    Affine,
    AxisMap,
    Broadcast,
    Grouped,
    IterDim,
    Operand,
    Whole,
    identity,
)
from onnx2soap.ops.base import C, NoAttrs, OpDef, X, case
from onnx2soap.ops.context import NodeContext, make_op

Group = tuple[tuple[int, ...], tuple[int, ...]]  # (input axes, output axes)


def axis_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[Group]:
    """Consecutive input and output axes with equal products; a size-1 axis alone is a
    group of its own (read by ``Broadcast`` or written as a size-1 dim)."""
    groups: list[Group] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j == len(dst) or dst[j] != 1):
            groups.append(((i,), ()))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i == len(src) or src[i] != 1):
            groups.append(((), (j,)))
            j += 1
            continue
        a, b, ps, pd = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                a.append(i)
                ps *= src[i]
                i += 1
            else:
                b.append(j)
                pd *= dst[j]
                j += 1
        groups.append((tuple(a), tuple(b)))
    return groups


def relayout(ctx: NodeContext, out: tuple[int, ...]):
    """The op moving ``ctx.tensor(0)`` into shape ``out`` (same element count)."""
    x = ctx.tensor(0)
    if 0 in x.shape or 0 in out:
        raise ctx.fail(f"reshaping {list(x.shape)} to {list(out)}: empty tensors are not supported")
    names = ["n", *(f"r{i}" for i in range(1, len(out)))][: len(out)]
    dims = [IterDim(name, size) for name, size in zip(names, out, strict=True)]
    axes: list[AxisMap] = [Whole()] * len(x.shape)
    for ins, outs in axis_groups(x.shape, out):
        if not outs:
            axes[ins[0]] = Broadcast()
        elif not ins:
            continue  # a new size-1 output axis
        elif len(ins) == 1 and len(outs) == 1:
            axes[ins[0]] = identity(outs[0])
        elif len(ins) == 1:  # a split: the outer dim splits, the inner ones never
            strides = [math.prod(out[o + 1 : outs[-1] + 1]) for o in outs]
            axes[ins[0]] = Affine(tuple(zip(outs, strides, strict=True)), 0)
            for o in outs[1:]:
                dims[o] = replace(dims[o], granule=dims[o].size)
        elif len(outs) == 1:  # a merge: the output dim splits in whole inner blocks
            inner = math.prod(x.shape[a] for a in ins[1:])
            dims[outs[0]] = replace(dims[outs[0]], granule=inner)
            axes[ins[0]] = Grouped(dim=outs[0], out_per_group=inner, in_per_group=1)
        else:  # neither: read whole, never split
            for o in outs:
                dims[o] = replace(dims[o], granule=dims[o].size)
    op = make_op(
        ctx,
        [Operand(x.name, tuple(axes))],
        NoAttrs(),
        [(d.name, d.size) for d in dims],
        range(len(out)),
        0,
    )
    return replace(op, nest=replace(op.nest, dims=tuple(dims)))


def convert_flatten(ctx: NodeContext, *, axis=1):
    x = ctx.tensor(0)
    rank = len(x.shape)
    if not -rank <= axis <= rank:
        raise ctx.fail(f"axis={axis} is out of range for rank {rank} (accepted: [-{rank}, {rank}])")
    axis = axis + rank if axis < 0 else axis
    return relayout(ctx, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


def _reshaped(ctx: NodeContext, source: tuple[int, ...], shape: list[int], allowzero: int):
    if allowzero and 0 in shape and -1 in shape:
        raise ctx.fail(f"shape {shape} has both 0 and -1, which allowzero=1 forbids")
    if any(s == 0 and i >= len(source) for i, s in enumerate(shape)) and not allowzero:
        raise ctx.fail(f"shape {shape} copies (0) an axis the input {list(source)} lacks")
    out = [source[i] if s == 0 and not allowzero else s for i, s in enumerate(shape)]
    if out.count(-1) > 1 or any(s < -1 for s in out):
        raise ctx.fail(f"shape {shape} is not a valid Reshape target")
    known = math.prod(s for s in out if s != -1)
    if -1 in out:
        if known == 0 or math.prod(source) % known:
            raise ctx.fail(f"cannot reshape {list(source)} to {shape}")
        out[out.index(-1)] = math.prod(source) // known
    if math.prod(out) != math.prod(source):
        raise ctx.fail(f"cannot reshape {list(source)} ({math.prod(source)} elements) to {shape}")
    return tuple(out)


def convert_reshape(ctx: NodeContext, *, allowzero=0):
    value = ctx.constant(1)
    if value.dtype.kind not in "iu" or value.ndim != 1:
        raise ctx.fail(
            f"the shape input must be a 1-D int64 tensor, got {value.dtype} {list(value.shape)}"
        )
    shape = [int(s) for s in value]
    detail = ""
    if shape and shape[0] not in (0, -1):
        detail = (
            f" (its shape input {shape} fixes the batch at {shape[0]}: export with a dynamic "
            f"batch axis, or plan with --batch {shape[0]})"
        )
    x = ctx.tensor(0)
    out = _reshaped(ctx, x.shape, shape, allowzero)
    if detail and x.batched and ctx.is_literal(1) and out[0] != x.shape[0]:
        # A literal first entry other than the batch: the model was exported for one
        # batch size, and reshaping at another would mix samples.
        raise ctx.fail(f"input {list(x.shape)} becomes {list(out)}{detail}")
    return relayout(ctx, out)


def forward(xp, attrs, inputs, args):
    return inputs[0].reshape(args.out_shape).copy()


def backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output.reshape(inputs[0].shape).copy(),)


FLATTEN = OpDef(
    moves_values=True,
    name="Flatten",
    versions=(13, 21, 23, 24, 25),
    convert=convert_flatten,
    forward=forward,
    backward=backward,
    cases=(
        case("flatten", "Flatten", X(2, 3, 4, 5)),
        case("flatten_negative_axis", "Flatten", X(2, 3, 4), axis=-2),
        case("flatten_axis2_merges_batch", "Flatten", X(2, 3, 4), axis=2),
        case("flatten_axis0", "Flatten", X(3, 2, 2), axis=0),
    ),
)

RESHAPE = OpDef(
    moves_values=True,
    name="Reshape",
    versions=(13, 14, 19, 21, 23, 24, 25),
    convert=convert_reshape,
    forward=forward,
    backward=backward,
    cases=(
        case("reshape", "Reshape", X(2, 3, 4, 5), C([0, -1, 5])),
        # attention's heads: [N, T, H*D] <-> [N, T, H, D]
        case("reshape_split_heads", "Reshape", X(2, 3, 12), C([0, 0, 3, 4])),
        case("reshape_merge_heads", "Reshape", X(2, 3, 3, 4), C([0, 0, -1])),
        case("reshape_tokens_to_rows", "Reshape", X(2, 3, 4), C([-1, 4])),
        case("reshape_size_one_axes", "Reshape", X(2, 1, 6), C([2, 3, 1, 2])),
        case("reshape_regroup", "Reshape", X(2, 6, 4), C([2, 4, 6])),
    ),
)

DEFINITIONS = (FLATTEN, RESHAPE)
