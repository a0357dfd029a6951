"""Clip, Pow and Cast: elementwise ops whose extra inputs are parameters, not operands.

Clip's ``min``/``max`` and Pow's exponent must be constants known when the model is
loaded (Constant nodes, folded expressions or constant initializers): they are read into
the op's attributes, so the loop nest has the data tensor as its only operand. A bound or
exponent computed at run time (or a trainable weight there) is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np
import onnx

from onnx2soap.ir import DType
from onnx2soap.ops.base import (
    NONE,
    SAVES_INPUTS,
    SAVES_NOTHING,
    C,
    CaseInput,
    InputKind,
    OpDef,
    Sample,
    X,
    case,
)
from onnx2soap.ops.context import NodeContext, elementwise, text


def _data(ctx: NodeContext):
    t = ctx.tensor(0)
    if not t.dtype.is_float:
        raise ctx.fail(f"input is {t.dtype.value}; only float tensors are supported")
    return t


def _scalar_constant(ctx: NodeContext, i: int, what: str) -> np.ndarray | None:
    """Input ``i`` as a one-element constant, None if omitted. Read from ``constants``
    first: a constant may also be listed as a (constant) tensor in ``inputs``."""
    if ctx.is_constant(i):
        value = np.asarray(ctx.constants[i])
        if value.size != 1:
            raise ctx.fail(f"{what} must hold one value, got shape {list(value.shape)}")
        if value.dtype.kind not in "fiu":
            raise ctx.fail(f"{what} has dtype {value.dtype}; a number is needed")
        return value
    if i >= len(ctx.inputs) or ctx.inputs[i] is None:
        return None
    raise ctx.fail(
        f"{what} ('{ctx.inputs[i].name}') is a tensor computed at run time or a trainable "
        "weight; only a constant known when the model is loaded is supported"
    )


# --- Clip ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipAttrs:
    """The bounds; None where the input is omitted (no bound on that side)."""

    min: float | None
    max: float | None


def convert_clip(ctx: NodeContext):
    x = _data(ctx)
    bounds = []
    for i, what in ((1, "min"), (2, "max")):
        value = _scalar_constant(ctx, i, what)
        bound = None if value is None else float(value.reshape(()))
        if bound is not None and math.isnan(bound):
            raise ctx.fail(f"{what} is NaN")
        bounds.append(bound)
    return elementwise(ctx, [x], ClipAttrs(*bounds), 2)


def clip_forward(xp, attrs, inputs, args):
    # min(max(x, lo), hi): where lo > hi every value becomes hi, as the spec says.
    y = inputs[0]
    if attrs.min is not None:
        y = xp.maximum(y, attrs.min)
    if attrs.max is not None:
        y = xp.minimum(y, attrs.max)
    return y.copy() if y is inputs[0] else y


def clip_backward(xp, attrs, inputs, output, grad_output, args):
    # PyTorch's clamp subgradient: 1 where min <= x <= max (bounds included), else 0.
    # With min > max the mask is empty: the output is the constant max.
    x = inputs[0]
    grad = grad_output.copy()
    if attrs.min is not None:
        grad = grad * (x >= attrs.min)
    if attrs.max is not None:
        grad = grad * (x <= attrs.max)
    return (grad,)


# --- Pow -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PowAttrs:
    exponent: float


def convert_pow(ctx: NodeContext):
    x = _data(ctx)
    value = _scalar_constant(ctx, 1, "the exponent")
    if value is None:
        raise ctx.fail("the exponent (input 1) is required")
    if value.ndim > len(x.shape):
        # Broadcasting would add axes to the output: not a pointwise power of x any more.
        raise ctx.fail(
            f"the exponent has rank {value.ndim}, more than the base's {len(x.shape)}; "
            "a scalar exponent is supported"
        )
    exponent = float(value.reshape(()))
    if not math.isfinite(exponent):
        raise ctx.fail(f"the exponent is {exponent}; a finite constant is supported")
    flops = 1 if exponent in (0.0, 1.0, 2.0) else 4
    return elementwise(ctx, [x], PowAttrs(exponent), flops)


def _power(x, p: float):
    """x ** p, by multiplications for the small whole exponents (GELU's x³): numpy's
    pow of a float exponent is ten times slower than two products."""
    if p in (2.0, 3.0, 4.0):
        y = x * x
        if p == 3.0:
            y *= x
        elif p == 4.0:
            y *= y
        return y
    return x**p


def pow_forward(xp, attrs, inputs, args):
    return _power(inputs[0], attrs.exponent)


def pow_backward(xp, attrs, inputs, output, grad_output, args):
    p = attrs.exponent
    if p == 0:  # x^0 is 1 everywhere, x = 0 included
        return (xp.zeros_like(grad_output),)
    if p == 1:
        return (grad_output.copy(),)
    factor = _power(inputs[0], p - 1)
    factor *= p
    factor *= grad_output
    return (factor,)


# --- Cast ------------------------------------------------------------------------------

_FLOAT_TARGETS = {onnx.TensorProto.FLOAT: "FLOAT", onnx.TensorProto.DOUBLE: "DOUBLE"}
ROUND_MODES = ("up", "down", "nearest")


def convert_cast(ctx: NodeContext, *, to=None, saturate=1, round_mode="up"):
    # saturate and round_mode only concern float8/float4 targets, refused below; they are
    # still checked against the spec.
    if to is None:
        raise ctx.fail("attribute 'to' is required")
    if saturate not in (0, 1):
        raise ctx.fail(f"saturate={saturate}; accepted: 0, 1")
    if text(round_mode) not in ROUND_MODES:
        raise ctx.fail(f"round_mode='{text(round_mode)}'; accepted: {', '.join(ROUND_MODES)}")
    x = ctx.tensor(0)
    if to in _FLOAT_TARGETS:
        # ids or a mask to float (an attention mask); float to float is the identity
        target = CastTarget.FLOAT
    elif to in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and not x.dtype.is_float:
        target = CastTarget.IDS  # ids stay int64 in the IR
    elif to == onnx.TensorProto.BOOL and not x.dtype.is_float:
        target = CastTarget.MASK
    else:
        known = to in onnx.TensorProto.DataType.values()
        name = onnx.TensorProto.DataType.Name(to) if known else to
        raise ctx.fail(
            f"cast of {x.dtype.value} to {name} is not supported: accepted are casts to "
            "FLOAT or DOUBLE (the run's float dtype), and of ids or masks to INT64, INT32 "
            "or BOOL (floats to integers would cut the gradient)"
        )
    dtype = DType.FLOAT32 if target is CastTarget.FLOAT and not x.dtype.is_float else None
    op = elementwise(ctx, [x], CastAttrs(target), 0)
    return replace(op, dtype=dtype)


class CastTarget(Enum):
    FLOAT = "float"  # the run's float dtype
    IDS = "ids"  # int64
    MASK = "mask"  # 0/1 ids (the IR has no bools)


@dataclass(frozen=True)
class CastAttrs:
    target: CastTarget


def cast_forward(xp, attrs: CastAttrs, inputs, args):
    # The executor runs the whole model in one float dtype (float32 or float64), so a cast
    # between FLOAT and DOUBLE is the identity on the run's dtype: no rounding happens.
    x = inputs[0]
    if attrs.target is CastTarget.FLOAT:
        return x.astype(x.dtype if x.dtype.kind == "f" else args.float_dtype)
    if attrs.target is CastTarget.MASK:
        return (x != 0).astype(x.dtype)
    return x.copy()


def cast_backward(xp, attrs: CastAttrs, inputs, output, grad_output, args):
    if inputs[0].dtype.kind != "f":
        return (None,)  # ids take no gradient
    return (grad_output.copy(),)


# --- definitions ---------------------------------------------------------------------


def _ids(*shape: int) -> CaseInput:
    """An int64 data input (a mask or ids)."""
    return CaseInput(InputKind.DATA, tuple(shape), None, "int64")


def _f(values: float) -> CaseInput:
    """A float32 constant input."""
    return C(values, dtype="float32")


CLIP = OpDef(
    name="Clip",
    versions=(13,),
    convert=convert_clip,
    forward=clip_forward,
    backward=clip_backward,
    saves=SAVES_INPUTS,  # x against the bounds
    # Bounds away from where a finite-difference step could cross them (or, at 0, data
    # drawn away from 0).
    cases=(
        case("clip_min_max", "Clip", X(2, 3, 4), _f(-0.5), _f(0.8)),
        case("clip_relu6", "Clip", X(3, 5), _f(0.0), _f(6.0), sample=Sample.AWAY_FROM_ZERO),
        case("clip_min_only", "Clip", X(2, 6), _f(0.3)),
        case("clip_max_only", "Clip", X(2, 6), NONE, _f(-0.2)),
        case("clip_no_bounds", "Clip", X(2, 3)),
        case("clip_min_above_max", "Clip", X(3, 4), _f(1.0), _f(-1.0)),
    ),
)

POW = OpDef(
    name="Pow",
    versions=(13, 15),  # 15 adds bfloat16 types
    convert=convert_pow,
    forward=pow_forward,
    backward=pow_backward,
    saves=SAVES_INPUTS,
    cases=(
        case("pow_square", "Pow", X(2, 3, 4), _f(2.0)),
        case("pow_int_exponent", "Pow", X(3, 4), C(3)),
        case("pow_sqrt", "Pow", X(2, 5), _f(0.5), sample=Sample.POSITIVE),
        case("pow_negative", "Pow", X(3, 4), _f(-1.5), sample=Sample.POSITIVE),
        case("pow_one_element", "Pow", X(2, 3, 4), C([3.0], dtype="float32"), opset=15),
        case("pow_zero", "Pow", X(2, 3), _f(0.0), opset=15),
    ),
)

CAST = OpDef(
    # ids cast to ids keep their values (and so the bound of whoever reads them)
    moves_values=True,
    name="Cast",
    versions=(13, 19, 21, 23, 24, 25, 28),
    convert=convert_cast,
    forward=cast_forward,
    backward=cast_backward,
    saves=SAVES_NOTHING,  # the input's dtype only
    # floats to the run's float dtype, ids to ids: the input itself
    passes_input=lambda attrs: attrs.target is not CastTarget.MASK,
    # The harness declares a float32 output, so every case casts to FLOAT.
    cases=(
        case("cast_ids_to_float", "Cast", _ids(2, 5), to=onnx.TensorProto.FLOAT),
        case("cast_ids_to_bool", "Cast", _ids(3, 4), to=onnx.TensorProto.BOOL, output="bool"),
        case("cast_float", "Cast", X(2, 3, 4), opset=13, to=onnx.TensorProto.FLOAT),
        case("cast_float_opset19", "Cast", X(3, 5), opset=19, to=onnx.TensorProto.FLOAT),
        # onnxruntime refuses saturate (given) on a cast to a non-float8 type.
        case("cast_float_opset21", "Cast", X(2, 5), opset=21, to=onnx.TensorProto.FLOAT),
    ),
)

DEFINITIONS = (CLIP, POW, CAST)
