"""Unary elementwise activations and math functions.

Every op here reads one float tensor and writes one of the same shape, point by point:
the loop nest is ``elementwise``, so every dim splits. Kernels use only functions numpy
and cupy share, Python-float constants (a numpy float64 scalar would promote a float32
array to float64) and stable forms (no ``exp`` of a large positive argument, even in a
branch ``where`` discards). Where a function has a kink the backward takes PyTorch's
subgradient, and the cases draw their data away from it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from onnx2soap.ops.base import (
    SAVES_INPUTS,
    SAVES_NOTHING,
    SAVES_OUTPUT,
    CaseInput,
    InputKind,
    NoAttrs,
    OpDef,
    Sample,
    Saved,
    X,
    case,
    output_copies,
)
from onnx2soap.ops.context import NodeContext, elementwise, float_attribute, text

# --- erf ---------------------------------------------------------------------------------

_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_SQRT_PI = math.sqrt(math.pi)
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

# Below this |x| erf is the everywhere-convergent series of positive terms (Abramowitz &
# Stegun 7.1.6); above it, 1 - erfc from erfc's continued fraction (A&S 7.1.14). Both
# term counts give |error| < 1e-15 on float64 against mpmath (checked on [-8, 8]); the
# switch point balances them: the series needs more terms as |x| grows, the fraction fewer.
_ERF_SWITCH = 2.5
_ERF_SERIES_TERMS = 40
_ERFC_FRACTION_DEPTH = 30


def _erf_portable(xp, x):
    """erf in float64 from elementwise arithmetic and exp only (numpy has no erf). The
    terms and products are made in place, in the order the expressions they stand for
    evaluate (the same values): five arrays of x's size at most, not a dozen."""
    a = xp.abs(x)
    # Each branch runs on its own clamped copy so that neither overflows nor divides by 0.
    s = xp.minimum(a, _ERF_SWITCH)
    z = 2.0 * s
    z *= s
    term = s.copy()
    total = s.copy()
    for n in range(1, _ERF_SERIES_TERMS + 1):
        term *= z  # term * z / (2n + 1)
        term /= 2 * n + 1
        total += term
    xp.negative(s, out=term)  # series: 2/sqrt(pi) * exp(-s * s) * total
    term *= s
    xp.exp(term, out=term)
    term *= _TWO_OVER_SQRT_PI
    total *= term
    del s, z, term
    c = xp.maximum(a, _ERF_SWITCH)
    f = c.copy()
    for k in range(_ERFC_FRACTION_DEPTH, 0, -1):
        xp.divide(0.5 * k, f, out=f)  # c + (k / 2) / f
        f += c
    f *= _SQRT_PI  # tail: 1 - exp(-c * c) / (sqrt(pi) * f)
    xp.negative(c, out=c)
    c *= xp.negative(c)
    xp.exp(c, out=c)
    c /= f
    del f
    xp.subtract(1.0, c, out=c)
    magnitude = xp.where(a < _ERF_SWITCH, total, c)
    del a, total, c
    return xp.where(x < 0, -magnitude, magnitude)


# The portable series runs on this many elements at a time: it holds about 6 float64
# arrays of what it works on (13 before its terms were made in place; 27 float32 tiles'
# worth over a whole tile, once the largest temporary of a GPT step on CPU ranks);
# chunked, a fixed 3 MiB at most.
ERF_CHUNK = 1 << 16


def _erf(xp, x, scale: float = 1.0):
    """erf(x · scale) in x's dtype, accurate to ~1e-15 (computed in float64). cupy has a
    native erf (cupyx.scipy.special, no scipy needed); numpy gets the portable series,
    ``ERF_CHUNK`` elements at a time (elementwise: the same values as over the whole
    tile), each chunk scaled as it is taken (the float32 products ``x * scale`` gives,
    without a tile of them)."""
    if xp.__name__ == "cupy":
        with contextlib.suppress(ImportError):  # an older cupy: the portable series
            from cupyx.scipy.special import erf

            return erf(x * scale if scale != 1.0 else x)
    out = xp.empty(x.shape, dtype=x.dtype)
    flat, into = x.reshape(-1), out.reshape(-1)
    for i in range(0, flat.size, ERF_CHUNK):
        chunk = flat[i : i + ERF_CHUNK]
        if scale != 1.0:
            chunk = chunk * scale
        into[i : i + ERF_CHUNK] = _erf_portable(xp, chunk.astype(xp.float64))
    return out


def _erf_derivative(xp, x):
    """d erf / dx = 2/sqrt(pi) exp(-x^2), exactly (finite differences check against it)."""
    return _TWO_OVER_SQRT_PI * xp.exp(-x * x)


# --- converters ---------------------------------------------------------------------------


def _unary(ctx: NodeContext, attrs: object, flops: int):
    t = ctx.tensor(0)
    if not t.dtype.is_float:
        raise ctx.fail(f"input is {t.dtype.value}; only float tensors are supported")
    return elementwise(ctx, [t], attrs, flops)


def _finite(ctx: NodeContext, **values: float) -> None:
    for name, v in values.items():
        if not math.isfinite(v):
            raise ctx.fail(f"attribute {name}={v} must be finite")


def _float32(v: float) -> float:
    """An ONNX float attribute's default as the float32 the spec stores (what onnxruntime
    computes with), so an absent attribute and an explicit default give the same op."""
    return float(np.float32(v))


@dataclass(frozen=True)
class AlphaAttrs:
    alpha: float


@dataclass(frozen=True)
class AlphaBetaAttrs:
    alpha: float
    beta: float


@dataclass(frozen=True)
class SeluAttrs:
    alpha: float
    gamma: float


class GeluApproximation(Enum):
    NONE = "none"
    TANH = "tanh"


_GELU_TANH_SCALE = math.sqrt(2.0 / math.pi)
_GELU_TANH_CUBIC = 0.044715


@dataclass(frozen=True)
class GeluAttrs:
    approximate: GeluApproximation
    # the tanh form's constants: ONNX's exact ones, or (the importer's fusion of a
    # composite GELU, ``importer/gelu.py``) the ones the file's chain wrote
    tanh_scale: float = _GELU_TANH_SCALE
    cubic: float = _GELU_TANH_CUBIC


# --- Relu, Identity, Neg -------------------------------------------------------------------


def convert_relu(ctx: NodeContext):
    return _unary(ctx, NoAttrs(), 1)


def relu_forward(xp, attrs, inputs, args):
    return xp.maximum(inputs[0], 0)


def relu_backward(xp, attrs, inputs, output, grad_output, args):
    # The subgradient at 0 is 0 (as in PyTorch and ORT training).
    return (grad_output * (inputs[0] > 0),)


def convert_identity(ctx: NodeContext):
    return elementwise(ctx, [ctx.tensor(0)], NoAttrs(), 0)


def identity_forward(xp, attrs, inputs, args):
    return inputs[0].copy()


def identity_backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output.copy() if inputs[0].dtype.kind == "f" else None,)


def convert_neg(ctx: NodeContext):
    return _unary(ctx, NoAttrs(), 1)


def neg_forward(xp, attrs, inputs, args):
    return -inputs[0]


def neg_backward(xp, attrs, inputs, output, grad_output, args):
    return (-grad_output,)


# --- Sigmoid, Swish, HardSigmoid, HardSwish, Tanh --------------------------------------


def convert_sigmoid(ctx: NodeContext):
    return _unary(ctx, NoAttrs(), 4)


def sigmoid_forward(xp, attrs, inputs, args):
    x = inputs[0]
    e = xp.exp(-xp.abs(x))  # never overflows
    return xp.where(x >= 0, 1 / (1 + e), e / (1 + e))


def sigmoid_backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output * output * (1 - output),)


def convert_swish(ctx: NodeContext, *, alpha=1.0):
    """ONNX's alpha, or the float64 tensor the importer's fusion of ``x · sigmoid(c · x)``
    writes (the chain's constant, exact)."""
    alpha = float_attribute(alpha)
    _finite(ctx, alpha=alpha)
    return _unary(ctx, AlphaAttrs(alpha), 6)


def _sigmoid_scaled(xp, alpha: float, x):
    """sigmoid(alpha · x) as a fresh array, holding at most two tiles and a mask besides
    x: e = exp(-|alpha · x|) made in place, then e / (1 + e), or 1 / (1 + e) where
    alpha · x >= 0 (Sigmoid's stable form: no exp of a positive number)."""
    e = xp.abs(x)
    e *= -abs(alpha)
    xp.exp(e, out=e)
    denominator = e + 1
    e[x >= 0 if alpha >= 0 else x <= 0] = 1.0
    e /= denominator
    return e


def swish_forward(xp, attrs, inputs, args):
    y = _sigmoid_scaled(xp, attrs.alpha, inputs[0])
    y *= inputs[0]
    return y


def swish_backward(xp, attrs, inputs, output, grad_output, args):
    # d/dx [x s(ax)] = s (1 + a x (1 - s)), s = sigmoid(a x): from x alone, so x is all
    # the backward keeps (where Sigmoid and Mul kept s and x). In place: one tile beside s.
    x = inputs[0]
    s = _sigmoid_scaled(xp, attrs.alpha, x)
    slope = 1 - s
    slope *= x
    if attrs.alpha != 1.0:
        slope *= attrs.alpha
    slope += 1
    slope *= s
    del s
    slope *= grad_output
    return (slope,)


# The spec's float defaults, as the float32 values ONNX stores.
_HARD_SIGMOID_ALPHA = _float32(0.2)
_LEAKY_RELU_ALPHA = _float32(0.01)
_SELU_ALPHA = _float32(1.67326319217681884765625)
_SELU_GAMMA = _float32(1.05070102214813232421875)


def convert_hard_sigmoid(ctx: NodeContext, *, alpha=_HARD_SIGMOID_ALPHA, beta=0.5):
    _finite(ctx, alpha=alpha, beta=beta)
    return _unary(ctx, AlphaBetaAttrs(float(alpha), float(beta)), 3)


def hard_sigmoid_forward(xp, attrs, inputs, args):
    return xp.clip(attrs.alpha * inputs[0] + attrs.beta, 0, 1)


def hard_sigmoid_backward(xp, attrs, inputs, output, grad_output, args):
    # alpha inside the linear part, 0 where clamped; at the two kinks 0 (PyTorch's
    # hardsigmoid_backward uses the open interval too).
    t = attrs.alpha * inputs[0] + attrs.beta
    return (grad_output * ((t > 0) & (t < 1)) * attrs.alpha,)


def convert_hard_swish(ctx: NodeContext):
    return _unary(ctx, NoAttrs(), 5)


def hard_swish_forward(xp, attrs, inputs, args):
    x = inputs[0]
    return x * xp.clip(x / 6 + 0.5, 0, 1)


def hard_swish_backward(xp, attrs, inputs, output, grad_output, args):
    # PyTorch's subgradient: 0 below -3, x/3 + 1/2 on [-3, 3], 1 above.
    x = inputs[0]
    middle = grad_output * ((x >= -3) & (x <= 3)) * (x / 3 + 0.5)
    return (middle + grad_output * (x > 3),)


def convert_tanh(ctx: NodeContext):
    return _unary(ctx, NoAttrs(), 4)


def tanh_forward(xp, attrs, inputs, args):
    return xp.tanh(inputs[0])


def tanh_backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output * (1 - output * output),)


# --- LeakyRelu, Elu, Selu, Softplus ---------------------------------------------------------


def convert_leaky_relu(ctx: NodeContext, *, alpha=_LEAKY_RELU_ALPHA):
    _finite(ctx, alpha=alpha)
    return _unary(ctx, AlphaAttrs(float(alpha)), 2)


def leaky_relu_forward(xp, attrs, inputs, args):
    x = inputs[0]
    return xp.where(x >= 0, x, attrs.alpha * x)


def leaky_relu_backward(xp, attrs, inputs, output, grad_output, args):
    # PyTorch: slope 1 where x > 0, alpha elsewhere (0 included).
    return (xp.where(inputs[0] > 0, grad_output, attrs.alpha * grad_output),)


def convert_elu(ctx: NodeContext, *, alpha=1.0):
    _finite(ctx, alpha=alpha)
    return _unary(ctx, AlphaAttrs(float(alpha)), 3)


def _expm1_negative(xp, x):
    """exp(min(x, 0)) - 1: the negative branch, evaluated without overflow for any x."""
    return xp.expm1(xp.minimum(x, 0))


def elu_forward(xp, attrs, inputs, args):
    x = inputs[0]
    return xp.where(x > 0, x, attrs.alpha * _expm1_negative(xp, x))


def elu_backward(xp, attrs, inputs, output, grad_output, args):
    # PyTorch: 1 where x > 0, alpha * exp(x) elsewhere (0 included).
    x = inputs[0]
    negative = grad_output * (attrs.alpha * xp.exp(xp.minimum(x, 0)))
    return (xp.where(x > 0, grad_output, negative),)


def convert_selu(ctx: NodeContext, *, alpha=_SELU_ALPHA, gamma=_SELU_GAMMA):
    _finite(ctx, alpha=alpha, gamma=gamma)
    return _unary(ctx, SeluAttrs(float(alpha), float(gamma)), 4)


def selu_forward(xp, attrs, inputs, args):
    x = inputs[0]
    negative = attrs.alpha * _expm1_negative(xp, x)
    return attrs.gamma * xp.where(x > 0, x, negative)


def selu_backward(xp, attrs, inputs, output, grad_output, args):
    x = inputs[0]
    negative = grad_output * (attrs.alpha * xp.exp(xp.minimum(x, 0)))
    return (attrs.gamma * xp.where(x > 0, grad_output, negative),)


def convert_softplus(ctx: NodeContext):
    return _unary(ctx, NoAttrs(), 4)


def softplus_forward(xp, attrs, inputs, args):
    # log(1 + e^x) = max(x, 0) + log(1 + e^-|x|): no overflow, no loss for large |x|.
    x = inputs[0]
    return xp.maximum(x, 0) + xp.log1p(xp.exp(-xp.abs(x)))


def softplus_backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output * sigmoid_forward(xp, attrs, inputs, args),)


# --- Sqrt, Exp, Log, Reciprocal -------------------------------------------------------------


def convert_sqrt(ctx: NodeContext):
    return _unary(ctx, NoAttrs(), 1)


def sqrt_forward(xp, attrs, inputs, args):
    return xp.sqrt(inputs[0])


def sqrt_backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output / (2 * output),)


def convert_exp(ctx: NodeContext):
    return _unary(ctx, NoAttrs(), 1)


def exp_forward(xp, attrs, inputs, args):
    return xp.exp(inputs[0])


def exp_backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output * output,)


def convert_log(ctx: NodeContext):
    return _unary(ctx, NoAttrs(), 1)


def log_forward(xp, attrs, inputs, args):
    return xp.log(inputs[0])


def log_backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output / inputs[0],)


def convert_reciprocal(ctx: NodeContext):
    return _unary(ctx, NoAttrs(), 1)


def reciprocal_forward(xp, attrs, inputs, args):
    return 1 / inputs[0]


def reciprocal_backward(xp, attrs, inputs, output, grad_output, args):
    return (-grad_output * output * output,)


# --- Erf, Gelu ------------------------------------------------------------------------------


def convert_erf(ctx: NodeContext):
    return _unary(ctx, NoAttrs(), 20)


def erf_forward(xp, attrs, inputs, args):
    return _erf(xp, inputs[0])


def erf_backward(xp, attrs, inputs, output, grad_output, args):
    return (grad_output * _erf_derivative(xp, inputs[0]),)


def convert_gelu(ctx: NodeContext, *, approximate="none", tanh_scale=None, cubic=None):
    """ONNX's attribute, and two of onnx2soap's own the importer's fusion writes (as
    float64 tensors: the constants of the chain it replaced)."""
    name = text(approximate)
    try:
        mode = GeluApproximation(name)
    except ValueError:
        raise ctx.fail(f"approximate='{name}'; accepted: 'none', 'tanh'") from None
    attrs = GeluAttrs(
        mode,
        _GELU_TANH_SCALE if tanh_scale is None else float_attribute(tanh_scale),
        _GELU_TANH_CUBIC if cubic is None else float_attribute(cubic),
    )
    return _unary(ctx, attrs, 24 if mode is GeluApproximation.NONE else 8)


# The tanh form's chain of passes runs over chunks of this many elements on a CPU: a
# chunk and its temporaries stay in a core's L2 cache from the chain's first pass to its
# last, so the tile is read from memory once, not once a pass (a GPT-2 step's [1024, 2048]
# MLP tiles on one CPU thread: the forward 2.3x, the backward 2.8x faster than passes over
# the whole tile).
# A GPU streams every pass at its memory's bandwidth: its chunks (16 MiB of float32) are
# only so large that a tile takes few launches and their temporaries stay bounded.
TANH_GELU_CHUNK, GPU_TANH_GELU_CHUNK = 1 << 15, 1 << 22


def _tanh_gelu_chunks(xp, *arrays):
    """Matching chunks of same-shaped arrays, flat (views of the C-contiguous ones: the
    arrays written must be), and the chunk's size."""
    chunk = TANH_GELU_CHUNK if xp.__name__ == "numpy" else GPU_TANH_GELU_CHUNK
    flat = [a.reshape(-1) for a in arrays]
    size = flat[0].size
    return ([f[lo : lo + chunk] for f in flat] for lo in range(0, size, chunk)), min(chunk, size)


def _tanh_term(xp, attrs, x, out):
    """tanh(tanh_scale · (x + cubic · x³)) into ``out``, each product in the
    expression's order."""
    t = xp.multiply(attrs.cubic, x, out=out)
    t *= x
    t *= x
    t += x
    t *= attrs.tanh_scale
    return xp.tanh(t, out=t)


def _tanh_gelu_forward(xp, attrs, x):
    """0.5 x (1 + tanh(...)), chunk by chunk (``TANH_GELU_CHUNK``), in the array it
    returns; 0.5 x in one chunk beside it."""
    out = xp.empty(x.shape, dtype=x.dtype)
    chunks, size = _tanh_gelu_chunks(xp, x, out)
    half = xp.empty(size, dtype=x.dtype)
    for xs, ys in chunks:
        t = _tanh_term(xp, attrs, xs, ys)
        t += 1
        t *= xp.multiply(0.5, xs, out=half[: xs.size])
    return out


def _tanh_gelu_backward(xp, attrs, x, grad_output):
    """dy · (0.5 (1 + t) + 0.5 x (1 - t²) · tanh_scale (1 + 3 cubic x²)), t the forward's
    tanh, chunk by chunk in the array it returns; three chunks beside it."""
    out = xp.empty(x.shape, dtype=x.dtype)
    chunks, size = _tanh_gelu_chunks(xp, x, grad_output, out)
    inner, square, term = (xp.empty(size, dtype=x.dtype) for _ in range(3))
    for xs, gs, slope in chunks:
        n = xs.size
        t = _tanh_term(xp, attrs, xs, slope)
        d_inner = xp.multiply(3 * attrs.cubic, xs, out=inner[:n])
        d_inner *= xs
        d_inner += 1
        d_inner *= attrs.tanh_scale
        fall = xp.multiply(t, t, out=square[:n])
        xp.subtract(1, fall, out=fall)
        second = xp.multiply(0.5, xs, out=term[:n])
        second *= fall
        second *= d_inner
        t += 1
        t *= 0.5
        t += second
        t *= gs
    return out


def gelu_forward(xp, attrs, inputs, args):
    x = inputs[0]
    if attrs.approximate is GeluApproximation.TANH:
        return _tanh_gelu_forward(xp, attrs, x)
    # 0.5 x (1 + erf(x / sqrt 2)), made in place in erf's fresh output, each product's
    # operands in the expression's order (a NaN's sign follows the first)
    out = _erf(xp, x, _SQRT_HALF)
    out += 1
    return xp.multiply(0.5 * x, out, out=out)


def gelu_backward(xp, attrs, inputs, output, grad_output, args):
    x = inputs[0]
    if attrs.approximate is GeluApproximation.TANH:
        return (_tanh_gelu_backward(xp, attrs, x, grad_output),)
    # d/dx [x Phi(x)] = Phi(x) + x phi(x), phi the standard normal density: each term
    # made in place in erf's fresh output, in the order the products evaluate.
    slope = _erf(xp, x, _SQRT_HALF)
    slope += 1
    slope *= 0.5
    density = x * -0.5
    density *= x
    xp.exp(density, out=density)
    density *= _INV_SQRT_2PI
    xp.multiply(x, density, out=density)
    slope += density
    del density
    return (xp.multiply(grad_output, slope, out=slope),)


# --- definitions ----------------------------------------------------------------------------


def _op(name, versions, convert, forward, backward, *cases, saves: Saved, workspace=None) -> OpDef:
    """``saves``: what the backward reads (``Saved``): the input where the derivative is
    a function of x, the output where it is one of y (Sigmoid, Tanh, Exp, ...)."""
    return OpDef(
        name=name,
        versions=versions,
        convert=convert,
        forward=forward,
        backward=backward,
        cases=cases,
        workspace=workspace,
        saves=saves,
    )


def _erf_scratch(n: int) -> int:
    """The portable series' float64 arrays over a chunk (``ERF_CHUNK``): tracemalloc
    measured 6.0 of the chunk's elements x 8 bytes (the chunk in float64 and five made
    from it), above the output, on tiles of 400 to 2 M elements."""
    return 6 * 8 * min(n, ERF_CHUNK)


def _erf_workspace(attrs, shapes, out_shape, itemsize: int) -> tuple[int, int]:
    """Forward: the series' scratch; backward: exp(-x^2) over the tile."""
    n = math.prod(out_shape)
    return _erf_scratch(n), n * itemsize


def _gelu_workspace(attrs, shapes, out_shape, itemsize: int) -> tuple[int, int]:
    """Exact Gelu runs the portable erf in both passes, on x/sqrt(2) a chunk at a time,
    into the array it returns: beside it, the series' scratch and the scaled chunk, or
    later one tile (0.5 x forward, the density's terms backward) (tracemalloc, numpy,
    tiles of 400 to 2 M elements). The tanh form, in the tile's dtype: a chunk forward,
    three backward (``TANH_GELU_CHUNK``, as numpy runs it; a GPU's chunks are larger,
    ``GPU_TANH_GELU_CHUNK``: 16 MiB of float32 each at most, unpriced)."""
    n = math.prod(out_shape)
    if attrs.approximate is GeluApproximation.TANH:
        chunk = min(n, TANH_GELU_CHUNK) * itemsize
        return chunk, 3 * chunk
    held = max(_erf_scratch(n) + min(n, ERF_CHUNK) * itemsize, n * itemsize)
    return held, held


# numpy casts an operand of another dtype (Relu's boolean mask) through a buffer of this
# many elements as a ufunc runs (``np.getbufsize()``'s default)
UFUNC_BUFFER = 8192


def _relu_workspace(attrs, shapes, out_shape, itemsize: int) -> tuple[int, int]:
    """Backward: the mask x > 0, a byte an element, and numpy's buffer casting it to the
    gradient's dtype as it multiplies (tracemalloc, 1 k to 1 M elements)."""
    n = math.prod(out_shape)
    return 0, n + min(n, UFUNC_BUFFER) * itemsize


AWAY = Sample.AWAY_FROM_ZERO
POSITIVE = Sample.POSITIVE

RELU = _op(
    "Relu",
    (13, 14),
    convert_relu,
    relu_forward,
    relu_backward,
    case("relu", "Relu", X(2, 3, 4), sample=AWAY),
    saves=SAVES_INPUTS,  # x > 0
    workspace=_relu_workspace,
)

IDENTITY = replace(
    _op(
        "Identity",
        (13, 14, 16, 19, 21, 23, 24, 25),
        convert_identity,
        identity_forward,
        identity_backward,
        case("identity", "Identity", X(3, 4)),
        case(
            "identity_ids",
            "Identity",
            CaseInput(InputKind.DATA, (3, 5), None, "int64"),
            output="int64",
        ),
        saves=SAVES_NOTHING,  # the input's dtype only
    ),
    moves_values=True,  # ids copied keep the bound of whoever reads them
    passes_input=lambda attrs: True,
)

NEG = _op(
    "Neg",
    (13,),
    convert_neg,
    neg_forward,
    neg_backward,
    case("neg", "Neg", X(2, 3, 4)),
    saves=SAVES_NOTHING,
)

SIGMOID = _op(
    "Sigmoid",
    (13,),
    convert_sigmoid,
    sigmoid_forward,
    sigmoid_backward,
    case("sigmoid", "Sigmoid", X(2, 3, 4)),
    case("sigmoid_2d", "Sigmoid", X(4, 6)),
    saves=SAVES_OUTPUT,  # y (1 - y)
    workspace=output_copies(3.8, 2.2),
)

SWISH = _op(
    "Swish",
    (24,),
    convert_swish,
    swish_forward,
    swish_backward,
    case("swish", "Swish", X(2, 3, 4), opset=24),
    case("swish_alpha", "Swish", X(3, 5), opset=24, alpha=0.7),
    case("swish_negative_alpha", "Swish", X(4, 3), opset=24, alpha=-1.5),
    saves=SAVES_INPUTS,
    workspace=output_copies(1.3, 1.3),  # exp(-|ax|)'s denominator and mask (tracemalloc)
)

# 22 only adds bfloat16 to the types of HardSigmoid, HardSwish, Elu, Selu and Softplus.
HARD_SIGMOID = _op(
    "HardSigmoid",
    (6, 22),
    convert_hard_sigmoid,
    hard_sigmoid_forward,
    hard_sigmoid_backward,
    # Kinks at x = -beta/alpha and (1 - beta)/alpha: +-2.5 by default, -1.2 and 0.8 below;
    # a normal sample lands within a finite-difference step of them with odds ~1e-6.
    case("hard_sigmoid", "HardSigmoid", X(2, 3, 4)),
    case("hard_sigmoid_attrs", "HardSigmoid", X(3, 5), alpha=0.5, beta=0.6),
    case("hard_sigmoid_opset22", "HardSigmoid", X(2, 5), opset=22, alpha=0.3, beta=0.4),
    saves=SAVES_INPUTS,
)

HARD_SWISH = _op(
    "HardSwish",
    (14, 22),
    convert_hard_swish,
    hard_swish_forward,
    hard_swish_backward,
    # Kinks at +-3, where a normal sample rarely lands within a finite-difference step.
    case("hard_swish", "HardSwish", X(2, 3, 4), opset=17),
    case("hard_swish_opset22", "HardSwish", X(3, 7), opset=22),
    saves=SAVES_INPUTS,
)

TANH = _op(
    "Tanh",
    (13,),
    convert_tanh,
    tanh_forward,
    tanh_backward,
    case("tanh", "Tanh", X(2, 3, 4)),
    saves=SAVES_OUTPUT,  # 1 - y^2
)

LEAKY_RELU = _op(
    "LeakyRelu",
    (6, 16),
    convert_leaky_relu,
    leaky_relu_forward,
    leaky_relu_backward,
    case("leaky_relu", "LeakyRelu", X(2, 3, 4), sample=AWAY),
    case("leaky_relu_alpha", "LeakyRelu", X(3, 5), sample=AWAY, alpha=0.2),
    case("leaky_relu_opset13", "LeakyRelu", X(4, 3), opset=13, sample=AWAY, alpha=-0.5),
    saves=SAVES_INPUTS,  # x > 0 (y > 0 is not that for a negative alpha)
)

ELU = _op(
    "Elu",
    (6, 22),
    convert_elu,
    elu_forward,
    elu_backward,
    case("elu", "Elu", X(2, 3, 4), sample=AWAY),
    case("elu_alpha", "Elu", X(3, 5), sample=AWAY, alpha=0.3),
    case("elu_opset22", "Elu", X(2, 5), opset=22, sample=AWAY, alpha=2.0),
    saves=SAVES_INPUTS,
)

SELU = _op(
    "Selu",
    (6, 22),
    convert_selu,
    selu_forward,
    selu_backward,
    case("selu", "Selu", X(2, 3, 4), sample=AWAY),
    case("selu_attrs", "Selu", X(3, 5), sample=AWAY, alpha=1.5, gamma=0.8),
    case("selu_opset22", "Selu", X(2, 5), opset=22, sample=AWAY),
    saves=SAVES_INPUTS,
)

SOFTPLUS = _op(
    "Softplus",
    (1, 22),
    convert_softplus,
    softplus_forward,
    softplus_backward,
    case("softplus", "Softplus", X(2, 3, 4)),
    case("softplus_opset22", "Softplus", X(3, 5), opset=22),
    saves=SAVES_INPUTS,  # sigmoid(x)
)

SQRT = _op(
    "Sqrt",
    (13,),
    convert_sqrt,
    sqrt_forward,
    sqrt_backward,
    case("sqrt", "Sqrt", X(2, 3, 4), sample=POSITIVE),
    saves=SAVES_OUTPUT,  # 1 / (2 y)
)

EXP = _op(
    "Exp",
    (13,),
    convert_exp,
    exp_forward,
    exp_backward,
    case("exp", "Exp", X(2, 3, 4)),
    saves=SAVES_OUTPUT,
)

LOG = _op(
    "Log",
    (13,),
    convert_log,
    log_forward,
    log_backward,
    case("log", "Log", X(2, 3, 4), sample=POSITIVE),
    saves=SAVES_INPUTS,  # 1 / x
)

RECIPROCAL = _op(
    "Reciprocal",
    (13,),
    convert_reciprocal,
    reciprocal_forward,
    reciprocal_backward,
    case("reciprocal", "Reciprocal", X(2, 3, 4), sample=POSITIVE),
    case("reciprocal_signed", "Reciprocal", X(3, 5), sample=AWAY),
    saves=SAVES_OUTPUT,  # -y^2
)

ERF = _op(
    "Erf",
    (13,),
    convert_erf,
    erf_forward,
    erf_backward,
    case("erf", "Erf", X(2, 3, 4)),
    case("erf_2d", "Erf", X(6, 7)),
    saves=SAVES_INPUTS,
    workspace=_erf_workspace,
)

GELU = _op(
    "Gelu",
    (20,),
    convert_gelu,
    gelu_forward,
    gelu_backward,
    case("gelu", "Gelu", X(2, 3, 4), opset=20),
    case("gelu_tanh", "Gelu", X(3, 5), opset=20, approximate="tanh"),
    case("gelu_none_explicit", "Gelu", X(4, 3), opset=20, approximate="none"),
    saves=SAVES_INPUTS,
    workspace=_gelu_workspace,
)

DEFINITIONS = (
    RELU,
    IDENTITY,
    NEG,
    SIGMOID,
    SWISH,
    HARD_SIGMOID,
    HARD_SWISH,
    TANH,
    LEAKY_RELU,
    ELU,
    SELU,
    SOFTPLUS,
    SQRT,
    EXP,
    LOG,
    RECIPROCAL,
    ERF,
    GELU,
)
