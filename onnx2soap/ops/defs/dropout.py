"""Dropout and RandomUniformLike: random ops whose draws do not depend on the plan.

Both draw from ``onnx2soap.ops.random_bits``: the value of an output element is a hash of
the op's ``RandomKey`` (seed, step, op index), the node's ``seed`` attribute and the
element's global index, so any split computes exactly what one task does and N ranks
train like one device. The kernels are pure: the backward recomputes Dropout's mask from
the same key instead of storing it. Both are elementwise loop nests (every dim splits).

Without a key (``TaskArgs.random`` None: a forward-only inference run, not training)
Dropout is the identity, as ``torch.nn.Dropout`` in eval mode, whatever training_mode says;
RandomUniformLike still has to produce values, so it draws from the fixed key
``RandomKey(0, 0, 0)`` (and its seed attribute): inference is deterministic, but two
RandomUniformLike nodes without distinct seeds then draw the same values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from onnx2soap.ir import DType
from onnx2soap.ops.base import NONE, SAVES_NOTHING, C, OpDef, RandomKey, X, case, output_copies
from onnx2soap.ops.context import NodeContext, elementwise
from onnx2soap.ops.random_bits import float_stream, uniform

# --- Dropout ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DropoutAttrs:
    ratio: float  # in [0, 1)
    training: bool  # the training_mode input
    seed: int | None  # the node's seed attribute: a stream of its own


def _scalar(ctx: NodeContext, i: int, what: str) -> np.ndarray | None:
    """Optional input ``i`` as a one-element constant, None if omitted. A float constant
    arrives both as a CONSTANT tensor and as a value: it is read here as an attribute,
    never made an operand; anything computed at run time is refused."""
    value = ctx.optional_constant(i)
    if value is None:
        return None
    if value.size != 1:
        raise ctx.fail(f"{what} (input {i}) must be a scalar, got shape {list(value.shape)}")
    return value.reshape(())


def _ratio(ctx: NodeContext) -> float:
    value = _scalar(ctx, 1, "ratio")
    if value is None:
        return 0.5
    if value.dtype.kind != "f":
        raise ctx.fail(f"ratio is {value.dtype}; the spec wants a float scalar")
    ratio = float(value)
    if not 0.0 <= ratio < 1.0:  # NaN fails too
        raise ctx.fail(f"ratio={ratio}; accepted: 0 <= ratio < 1")
    return ratio


def _training(ctx: NodeContext) -> bool:
    value = _scalar(ctx, 2, "training_mode")
    if value is None:
        return False
    if value.dtype != np.bool_:
        raise ctx.fail(f"training_mode is {value.dtype}; the spec wants a bool scalar")
    return bool(value)


def convert_dropout(ctx: NodeContext, *, seed=None):
    data = ctx.tensor(0)
    if not data.dtype.is_float:
        raise ctx.fail(f"data is {data.dtype.value}; only float tensors are supported")
    attrs = DropoutAttrs(_ratio(ctx), _training(ctx), None if seed is None else int(seed))
    # Multiply by the mask and the scale; the hash's integer work is not counted as FLOPs.
    return elementwise(ctx, [data], attrs, 2 if _drops(attrs) else 0)


def _drops(attrs: DropoutAttrs) -> bool:
    return attrs.training and attrs.ratio > 0


def _scaled_mask(xp, attrs: DropoutAttrs, args, dtype) -> object | None:
    """mask / (1 - ratio) for the tile, in ``dtype``; None where Dropout is the identity."""
    if not _drops(attrs) or args.random is None:
        return None
    stream = 0 if attrs.seed is None else attrs.seed
    u = uniform(xp, args.random, args.origin, args.out_shape, args.full_shape, stream=stream)
    keep = u >= attrs.ratio  # kept with probability 1 - ratio
    return (keep * (1.0 / (1.0 - attrs.ratio))).astype(dtype)


def dropout_forward(xp, attrs, inputs, args):
    x = inputs[0]
    scale = _scaled_mask(xp, attrs, args, x.dtype)
    return x.copy() if scale is None else x * scale


def dropout_backward(xp, attrs, inputs, output, grad_output, args):
    scale = _scaled_mask(xp, attrs, args, grad_output.dtype)
    return (grad_output.copy() if scale is None else grad_output * scale,)


# --- RandomUniformLike ----------------------------------------------------------------------

_ONNX_DTYPES = {1: DType.FLOAT32, 11: DType.FLOAT64}  # TensorProto.FLOAT, DOUBLE


@dataclass(frozen=True)
class RandomUniformAttrs:
    low: float
    high: float
    stream: int  # from the seed attribute (0 if absent)


# Used when not training (no key from the runtime): inference stays deterministic.
INFERENCE_KEY = RandomKey(seed=0, step=0, op=0)


def convert_random_uniform_like(ctx: NodeContext, *, dtype=None, high=1.0, low=0.0, seed=None):
    shape_of = ctx.tensor(0)
    if not shape_of.dtype.is_float:
        raise ctx.fail(
            f"input is {shape_of.dtype.value}; only a float input (whose dtype the output takes) "
            "is supported"
        )
    if dtype is not None:
        if dtype not in _ONNX_DTYPES:
            raise ctx.fail(f"dtype={dtype}; accepted: 1 (FLOAT), 11 (DOUBLE) or absent")
        if _ONNX_DTYPES[dtype] is not shape_of.dtype:
            raise ctx.fail(
                f"dtype={dtype} ({_ONNX_DTYPES[dtype].value}) differs from the input's "
                f"{shape_of.dtype.value}; only the input's dtype is supported (Cast after it)"
            )
    low, high = float(low), float(high)
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise ctx.fail(f"low={low}, high={high}; accepted: finite low <= high")
    attrs = RandomUniformAttrs(low, high, float_stream(seed))
    # The output does not read the input's values, only its shape: the operand is there
    # for the output's shape and dtype; its gradient is zero.
    return elementwise(ctx, [shape_of], attrs, 2)


def random_uniform_like_forward(xp, attrs, inputs, args):
    key = args.random if args.random is not None else INFERENCE_KEY
    u = uniform(xp, key, args.origin, args.out_shape, args.full_shape, stream=attrs.stream)
    return (attrs.low + (attrs.high - attrs.low) * u).astype(inputs[0].dtype)


def random_uniform_like_backward(xp, attrs, inputs, output, grad_output, args):
    # The output does not depend on the input's values: the exact derivative is zero.
    x = inputs[0]
    return (xp.zeros(x.shape, dtype=x.dtype),)  # its shape and dtype alone: SAVES_NOTHING


# --- definitions ----------------------------------------------------------------------------

_TRUE = C(1, dtype="bool")
_FALSE = C(0, dtype="bool")

DROPOUT = OpDef(
    name="Dropout",
    versions=(13, 22),  # 22 only adds types
    convert=convert_dropout,
    forward=dropout_forward,
    backward=dropout_backward,
    saves=SAVES_NOTHING,  # the mask is drawn again from the step's key
    workspace=output_copies(5, 5),
    cases=(
        # Identities (ORT-comparable): no optionals, training_mode False, ratio 0.
        case("dropout_inference", "Dropout", X(2, 3, 4)),
        case("dropout_training_false", "Dropout", X(3, 5), C(0.5, dtype="float32"), _FALSE),
        case("dropout_ratio0", "Dropout", X(2, 3, 4), C(0.0, dtype="float32"), _TRUE, opset=13),
        # Random: training_mode True.
        case(
            "dropout_train",
            "Dropout",
            X(2, 3, 4),
            C(0.3, dtype="float32"),
            _TRUE,
            deterministic=False,
        ),
        case("dropout_train_default_ratio", "Dropout", X(3, 5), NONE, _TRUE, deterministic=False),
        case(
            "dropout_train_seed",
            "Dropout",
            X(4, 6),
            NONE,
            _TRUE,
            opset=22,
            seed=5,
            deterministic=False,
        ),
    ),
)

RANDOM_UNIFORM_LIKE = OpDef(
    name="RandomUniformLike",
    versions=(1, 22),  # 22 only adds bfloat16
    convert=convert_random_uniform_like,
    forward=random_uniform_like_forward,
    backward=random_uniform_like_backward,
    saves=SAVES_NOTHING,
    cases=(
        case("random_uniform_like", "RandomUniformLike", X(2, 3, 4), deterministic=False),
        case(
            "random_uniform_like_attrs",
            "RandomUniformLike",
            X(4, 1, 3),
            opset=22,
            dtype=1,
            low=-2.0,
            high=0.5,
            seed=3.0,
            deterministic=False,
        ),
    ),
)

DEFINITIONS = (DROPOUT, RANDOM_UNIFORM_LIKE)
