"""CastLike: Cast to the element type of a second input (what the dynamo exporter writes
for ``type_as``, and around GroupNorm's affine parameters).

The importer folds a CastLike of a constant before conversion; what reaches here casts a
tensor computed at run time (or a weight). Only the element type of input 1 matters, its
values are never read, so the op's one operand is input 0 and it runs Cast's kernels:
float to float is the identity on the run's float dtype, ids or masks to float give the
run's float dtype, ids to integers stay ids, ids to bool become 0/1. Floats to integers
are refused, as for Cast (the gradient would be cut).

The target type is read from input 1: a constant's own numpy dtype (a bool constant is
bool), or a tensor's IR dtype. The IR has no bools (masks are 0/1 ids), so a run-time
target that is a bool mask reads as ids: casting ids to it keeps their values, which is
the cast only for 0/1 ids.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from onnx2soap.ir import DType
from onnx2soap.ops.base import SAVES_NOTHING, C, CaseInput, InputKind, OpDef, W, X, case
from onnx2soap.ops.context import NodeContext, elementwise, text
from onnx2soap.ops.defs.clip_pow_cast import (
    ROUND_MODES,
    CastAttrs,
    CastTarget,
    cast_backward,
    cast_forward,
)


def _target(ctx: NodeContext) -> np.dtype:
    """The element type input 1 has, as a numpy dtype."""
    if ctx.is_constant(1):
        return np.asarray(ctx.constants[1]).dtype
    t = ctx.tensor(1)
    return np.dtype(t.dtype.value)


def convert(ctx: NodeContext, *, saturate=1, round_mode="up"):
    # saturate and round_mode only concern float8/float4 targets, refused below; they are
    # still checked against the spec.
    if saturate not in (0, 1):
        raise ctx.fail(f"saturate={saturate}; accepted: 0, 1")
    if text(round_mode) not in ROUND_MODES:
        raise ctx.fail(f"round_mode='{text(round_mode)}'; accepted: {', '.join(ROUND_MODES)}")
    x = ctx.tensor(0)
    target = _target(ctx)
    if target in (np.dtype(np.float32), np.dtype(np.float64)):
        kind = CastTarget.FLOAT
    elif target.kind in "iu" and not x.dtype.is_float:
        kind = CastTarget.IDS
    elif target.kind == "b" and not x.dtype.is_float:
        kind = CastTarget.MASK
    else:
        raise ctx.fail(
            f"cast of {x.dtype.value} like a {target} tensor is not supported: accepted are "
            "casts like float32 or float64 (the run's float dtype), and of ids or masks "
            "like integers or bools (floats to integers would cut the gradient)"
        )
    dtype = DType.FLOAT32 if kind is CastTarget.FLOAT and not x.dtype.is_float else None
    return replace(elementwise(ctx, [x], CastAttrs(kind), 0), dtype=dtype)


def _ids(*shape: int) -> CaseInput:
    """An int64 data input (ids, or a mask read as ids)."""
    return CaseInput(InputKind.DATA, tuple(shape), None, "int64")


CAST_LIKE = OpDef(
    moves_values=True,
    name="CastLike",
    versions=(15, 19, 21, 23, 24, 25),
    convert=convert,
    forward=cast_forward,
    backward=cast_backward,
    saves=SAVES_NOTHING,  # the input's dtype only
    cases=(
        case("castlike_float", "CastLike", X(2, 3, 4), C(0.0, dtype="float32")),
        # the run computes in one float dtype: a cast to double is the identity there
        case("castlike_double", "CastLike", X(3, 5), C([0.0], dtype="float64"), output="float64"),
        # like a tensor (its type read from the IR): the data cast like a weight
        case("castlike_like_weight", "CastLike", X(2, 3, 4), W(1), opset=19),
        case("castlike_ids_to_float", "CastLike", _ids(2, 5), C(0.0, dtype="float32")),
        case("castlike_ids_to_ids", "CastLike", _ids(3, 4), C([7]), output="int64", opset=21),
        case("castlike_ids_to_bool", "CastLike", _ids(3, 4), C([1.0], dtype="bool"), output="bool"),
    ),
)

DEFINITIONS = (CAST_LIKE,)
