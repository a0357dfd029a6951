"""Flatten and Reshape: batch-preserving re-layouts, pure data movement.

A reshaping op reads whole samples (every non-batch axis is mapped ``Whole``), so a
C-order reshape of the local buffer is the reshape of the tensor's rows. Copies, so
outputs never alias inputs.
"""

from __future__ import annotations

import math

from onnx2soap.ir import Operand, Whole, identity
from onnx2soap.ops.base import C, NoAttrs, OpDef, X, case
from onnx2soap.ops.context import NodeContext, make_op


def batch_preserving(ctx: NodeContext, out: tuple[int, ...], detail: str = ""):
    x = ctx.tensor(0)
    if not out or out[0] != x.shape[0]:
        raise ctx.fail(
            f"only batch-preserving reshapes are supported: input {list(x.shape)} becomes "
            f"{list(out)}{detail}"
        )
    dims = [("n", out[0]), *((f"r{i}", s) for i, s in enumerate(out[1:], start=1))]
    # Samples keep their identity; everything else is re-laid out within a sample, so
    # a task reads whole samples.
    merged = tuple(range(1, len(out)))
    axes = (identity(0), *(Whole(dims=merged) for _ in x.shape[1:]))
    return make_op(ctx, [Operand(x.name, axes)], NoAttrs(), dims, range(len(out)), 0)


def convert_flatten(ctx: NodeContext, *, axis=1):
    x = ctx.tensor(0)
    rank = len(x.shape)
    if not -rank <= axis <= rank:
        raise ctx.fail(f"axis={axis} is out of range for rank {rank} (accepted: [-{rank}, {rank}])")
    if (axis + rank if axis < 0 else axis) != 1:
        raise ctx.fail(f"axis={axis} merges or splits the batch axis; only axis=1 is supported")
    return batch_preserving(ctx, (x.shape[0], math.prod(x.shape[1:])))


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
    out = _reshaped(ctx, ctx.tensor(0).shape, shape, allowzero)
    return batch_preserving(ctx, out, detail)


def forward(xp, attrs, inputs, args):
    return inputs[0].reshape(args.out_shape).copy()


def backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output.reshape(inputs[0].shape).copy(),)


FLATTEN = OpDef(
    name="Flatten",
    versions=(13, 21, 23, 24, 25),
    convert=convert_flatten,
    forward=forward,
    backward=backward,
    cases=(
        case("flatten", "Flatten", X(2, 3, 4, 5)),
        case("flatten_negative_axis", "Flatten", X(2, 3, 4), axis=-2),
    ),
)

RESHAPE = OpDef(
    name="Reshape",
    versions=(13, 14, 19, 21, 23, 24, 25),
    convert=convert_reshape,
    forward=forward,
    backward=backward,
    cases=(case("reshape", "Reshape", X(2, 3, 4, 5), C([0, -1, 5])),),
)

DEFINITIONS = (FLATTEN, RESHAPE)
