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
- anything else ([T, N, E] -> [T, N*H, D], nn.MultiheadAttention's heads beside a
  time-major batch): the outer axes split together, in the largest blocks that hold
  whole rows of both sides: with ``g = gcd(outer input axis, outer output axis)``, the
  outer output dim splits in multiples of ``output / g`` (its granule), each reading
  ``input / g`` rows of the outer input axis (a ``Grouped`` map); the inner axes are read
  whole and never split. A block of outer rows is one contiguous run of the group's
  elements on both sides, since their products are equal.

Every task's buffer is then exactly its tile's data in C order, so the kernel is a
reshape of the local buffer. Copies, so outputs never alias inputs.
"""

from __future__ import annotations

import math
from dataclasses import replace

from onnx2soap.errors import ModelError
from onnx2soap.ir import (
    Affine,
    AxisMap,
    BatchAt,
    Broadcast,
    Grouped,
    IterDim,
    Operand,
    Whole,
    identity,
)
from onnx2soap.ops.base import SAVES_NOTHING, C, NoAttrs, OpDef, X, case
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


def _lands(src: tuple[int, ...], dst: tuple[int, ...], ins, outs, a: int) -> tuple[int, int] | None:
    """(output axis, stride) where input axis ``a`` of the group (ins, outs) lands whole:
    the output digit of the group's flat index that holds all of the axis's values."""
    stride = math.prod(src[b] for b in ins if b > a)
    for o in outs:
        inner = math.prod(dst[p] for p in outs if p > o)
        if stride % inner == 0 and stride * src[a] <= inner * dst[o]:
            return o, stride // inner
    return None


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
            for a in ins[1:]:  # read whole; where their values land traces the batch
                axes[a] = Whole(within=_lands(x.shape, out, ins, outs, a))
        else:  # neither ([T, N, E] -> [T, N*H, D]): the outer axes split together
            outer, rest = x.shape[ins[0]], out[outs[0]]
            common = math.gcd(outer, rest)
            dims[outs[0]] = replace(dims[outs[0]], granule=rest // common)
            axes[ins[0]] = Grouped(outs[0], rest // common, outer // common)
            for a in ins[1:]:
                axes[a] = Whole(within=_lands(x.shape, out, ins, outs, a))
            for o in outs[1:]:
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


def _landing(source: tuple[int, ...], out: tuple[int, ...], at: BatchAt, batch: int) -> int | None:
    """The output axis the batch lands on when ``source`` (its batch at ``at``) is
    reshaped to ``out``: the axis whose digit of the group's flat index holds the batch
    whole, wherever it is (a time-major [T, N, E] to [T, N*H, D] puts it in axis 1, a
    merge behind the time steps [T*N, E] in axis 0); None where no one axis holds it."""
    for ins, outs in axis_groups(source, out):
        if at.axis not in ins:
            continue
        stride = at.stride * math.prod(source[a] for a in ins if a > at.axis)
        for j in outs:
            inner = math.prod(out[o] for o in outs if o > j)
            if stride % inner == 0 and stride * batch <= inner * out[j]:
                return j
        return None
    return None


def _follows_the_batch(
    ctx: NodeContext, source: tuple[int, ...], shape: list[int], allowzero: int, at: BatchAt
) -> bool:
    """Whether the target ``shape`` reshapes ``source`` alike at any batch: with the batch
    doubled, the output changes only where the batch lands, by the same factor."""
    batch = ctx.batch
    scaled = tuple(2 * n if a == at.axis else n for a, n in enumerate(source))
    try:
        out, doubled = (
            _reshaped(ctx, source, shape, allowzero),
            _reshaped(ctx, scaled, shape, allowzero),
        )
    except ModelError:
        return False
    j = _landing(scaled, doubled, at, 2 * batch)
    want = tuple(2 * n if a == j else n for a, n in enumerate(out))
    return j is not None and doubled == want


def _export_batch(
    ctx: NodeContext, source: tuple[int, ...], shape: list[int], allowzero: int, at: BatchAt
) -> int | None:
    """The batch the literal ``shape`` was likely written for: the first at which the
    batch lands alone on an output axis (the file's entry there is the batch), else the
    first at which it lands whole at all (merged with the heads, say); None if none up
    to 4096."""
    size, landed = source[at.axis], None
    for b in range(1, 4097):
        if b == ctx.batch or (size * b) % ctx.batch:
            continue
        resized = tuple(size * b // ctx.batch if a == at.axis else n for a, n in enumerate(source))
        try:
            out = _reshaped(ctx, resized, shape, allowzero)
        except ModelError:
            continue
        j = _landing(resized, out, at, b)
        if j is not None and out[j] == b:
            return b
        landed = landed or (b if j is not None else None)
    return landed


def _fixed_batch(ctx: NodeContext, shape: list[int], exported: int | None) -> str:
    hint = f" at {exported}" if exported else ""
    plan = f", or plan with --batch {exported}" if exported else ""
    return (
        f"its shape input {shape}, written in the file, fixes the batch{hint}: export with a "
        f"dynamic batch axis{plan}"
    )


def convert_reshape(ctx: NodeContext, *, allowzero=0):
    value = ctx.constant(1)
    if value.dtype.kind not in "iu" or value.ndim != 1:
        raise ctx.fail(
            f"the shape input must be a 1-D int64 tensor, got {value.dtype} {list(value.shape)}"
        )
    shape = [int(s) for s in value]
    x = ctx.tensor(0)
    try:
        out = _reshaped(ctx, x.shape, shape, allowzero)
    except ModelError as e:
        if not ctx.is_literal(1) or not x.batched:
            raise
        # where the batch lies is unknown past a merge behind the time steps ([T*N, E])
        where = sorted(ctx.batch_at(0), key=lambda a: a.axis)
        exported = _export_batch(ctx, x.shape, shape, allowzero, where[0]) if where else None
        raise ctx.fail(f"input {list(x.shape)}: {_fixed_batch(ctx, shape, exported)}") from e
    # A shape folded from Shape nodes at the bound batch is right by construction; one the
    # file states was made for the export's batch. Without a -1 its element count pins
    # the batch: the file was exported at this very batch. With one, it must follow the
    # batch wherever the batch lies (time-major layouts put it on axis 1), or at least
    # keep the samples apart here, the batch landing whole on one axis (a file exported
    # at this batch does).
    fixed = [
        at
        for at in (ctx.batch_at(0) if ctx.is_literal(1) and -1 in shape else ())
        if not _follows_the_batch(ctx, x.shape, shape, allowzero, at)
        and _landing(x.shape, out, at, ctx.batch) is None
    ]
    if fixed:
        exported = _export_batch(ctx, x.shape, shape, allowzero, fixed[0])
        raise ctx.fail(
            f"input {list(x.shape)} becomes {list(out)}, the samples mixed at another batch: "
            f"{_fixed_batch(ctx, shape, exported)}"
        )
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
    saves=SAVES_NOTHING,  # the input's shape only
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
    saves=SAVES_NOTHING,  # the input's shape only
    cases=(
        case("reshape", "Reshape", X(2, 3, 4, 5), C([0, -1, 5])),
        # attention's heads: [N, T, H*D] <-> [N, T, H, D]
        case("reshape_split_heads", "Reshape", X(2, 3, 12), C([0, 0, 3, 4])),
        case("reshape_merge_heads", "Reshape", X(2, 3, 3, 4), C([0, 0, -1])),
        case("reshape_tokens_to_rows", "Reshape", X(2, 3, 4), C([-1, 4])),
        case("reshape_size_one_axes", "Reshape", X(2, 1, 6), C([2, 3, 1, 2])),
        # [6, 4] -> [4, 6]: the outer axes split together, in blocks of gcd 2
        case("reshape_regroup", "Reshape", X(2, 6, 4), C([2, 4, 6])),
        # nn.MultiheadAttention beside a time-major batch: [T, N, H*D] <-> [T, N*H, D]
        case("reshape_time_major_heads", "Reshape", X(3, 2, 12), C([0, -1, 3])),
        case("reshape_time_major_back", "Reshape", X(3, 8, 3), C([3, 2, 12])),
    ),
)

DEFINITIONS = (FLATTEN, RESHAPE)
