"""The plan-independent random bits, and the random ops built on them.

The bits of an element depend only on the key and the element's global index: any tiling
of a tensor draws what the whole tensor draws, on numpy as on cupy. They are SplitMix64's
outputs (checked against a plain Python SplitMix64), look uniform, and differ between
keys. Dropout and RandomUniformLike use them as their docstrings say, and their
converters refuse what the spec does not allow or onnx2soap does not support.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx2soap.errors import ModelError
from onnx2soap.ir import DType, Tensor, TensorRole
from onnx2soap.ops.base import RandomKey, TaskArgs
from onnx2soap.ops.context import NodeContext
from onnx2soap.ops.defs.dropout import (
    INFERENCE_KEY,
    DropoutAttrs,
    RandomUniformAttrs,
    convert_dropout,
    convert_random_uniform_like,
    dropout_backward,
    dropout_forward,
    random_uniform_like_backward,
    random_uniform_like_forward,
)
from onnx2soap.ops.random_bits import bits, float_stream, key_hash, uniform
from tests.optional import cupy_or_skip

KEY = RandomKey(seed=7, step=3, op=2)
MASK = (1 << 64) - 1


def _splitmix64(seed: int, count: int) -> list[int]:
    """The textbook generator (Steele et al. 2014), one Python integer at a time."""
    out, state = [], seed
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def _whole(shape, key=KEY, stream=0):
    return uniform(np, key, (0,) * len(shape), shape, shape, stream=stream)


# --- the bits -----------------------------------------------------------------------------


def test_bits_are_splitmix64_seeded_with_the_key_hash() -> None:
    shape = (3, 4, 5)
    got = bits(np, KEY, (0, 0, 0), shape, shape, stream=11)
    want = _splitmix64(key_hash(KEY, 11), math.prod(shape))
    assert got.dtype == np.uint64 and got.shape == shape
    assert [int(v) for v in got.ravel()] == want


def test_uniform_is_the_top_53_bits() -> None:
    shape = (6, 7)
    z = bits(np, KEY, (0, 0), shape, shape)
    u = _whole(shape)
    assert u.dtype == np.float64 and u.shape == shape
    assert np.array_equal(u, (z >> np.uint64(11)).astype(np.float64) / 2.0**53)
    assert ((u >= 0) & (u < 1)).all()


@st.composite
def _tilings(draw):
    """A shape and, per axis, sorted cut points that split it into tiles."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    cuts = []
    for size in shape:
        inner = draw(st.lists(st.integers(1, size - 1), max_size=3)) if size > 1 else []
        cuts.append(sorted({0, size, *inner}))
    return shape, cuts


@settings(max_examples=60, deadline=None)
@given(tiling=_tilings(), seed=st.integers(-(2**63), 2**64 - 1), step=st.integers(0, 10**6))
def test_any_tiling_draws_what_the_whole_tensor_draws(tiling, seed, step) -> None:
    shape, cuts = tiling
    key = RandomKey(seed, step, op=5)
    whole = _whole(shape, key)
    assembled = np.full(shape, np.nan)
    for corner in np.ndindex(*(len(c) - 1 for c in cuts)):
        lo = tuple(c[i] for c, i in zip(cuts, corner, strict=True))
        hi = tuple(c[i + 1] for c, i in zip(cuts, corner, strict=True))
        tile = tuple(h - low for low, h in zip(lo, hi, strict=True))
        region = tuple(slice(low, h) for low, h in zip(lo, hi, strict=True))
        assembled[region] = uniform(np, key, lo, tile, shape)
    assert np.array_equal(assembled, whole)  # bit for bit, no tolerance


def test_a_tile_depends_only_on_the_global_index() -> None:
    """The same global element in two full shapes of equal trailing strides: same bits."""
    a = uniform(np, KEY, (1, 0), (1, 5), (4, 5))
    b = uniform(np, KEY, (0,), (5,), (20,))[None]
    c = uniform(np, KEY, (5,), (5,), (20,))[None]
    assert not np.array_equal(a, b)
    assert np.array_equal(a, c)


def test_uniformity() -> None:
    n, buckets = 200_000, 20
    u = _whole((n,), RandomKey(1, 0, 0))
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 0.002
    counts = np.bincount((u * buckets).astype(np.int64), minlength=buckets)
    expected = n / buckets
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45.3, chi2  # chi-square, 19 degrees of freedom: p = 0.0006
    # Neighbours (consecutive counters) are uncorrelated.
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / math.sqrt(n)
    # The low bits are as good as the high ones: each bit set about half the time.
    z = bits(np, RandomKey(1, 0, 0), (0,), (n,), (n,))
    for b in (0, 1, 31, 32, 63):
        frac = float(((z >> np.uint64(b)) & np.uint64(1)).mean())
        assert abs(frac - 0.5) < 5 * math.sqrt(0.25 / n), (b, frac)


@pytest.mark.parametrize(
    "other,stream",
    [
        (RandomKey(8, 3, 2), 0),
        (RandomKey(7, 4, 2), 0),
        (RandomKey(7, 3, 3), 0),
        (RandomKey(3, 7, 2), 0),  # the words' order matters
        (KEY, 1),
    ],
    ids=["seed", "step", "op", "order", "stream"],
)
def test_different_keys_draw_different_bits(other, stream) -> None:
    shape = (64, 64)
    a = bits(np, KEY, (0, 0), shape, shape)
    b = bits(np, other, (0, 0), shape, shape, stream=stream)
    assert int((a == b).sum()) == 0
    r = np.corrcoef(_whole(shape).ravel(), _whole(shape, other, stream).ravel())[0, 1]
    assert abs(r) < 0.04


def test_degenerate_tiles() -> None:
    assert uniform(np, KEY, (), (), ()).shape == ()
    assert uniform(np, KEY, (0, 2), (3, 0), (3, 2)).shape == (3, 0)
    with pytest.raises(ValueError, match="inside"):
        uniform(np, KEY, (2, 0), (2, 2), (3, 2))
    with pytest.raises(ValueError, match="one entry per axis"):
        uniform(np, KEY, (0,), (2, 2), (3, 2))


def test_float_stream() -> None:
    assert float_stream(None) == 0
    assert float_stream(1.0) != float_stream(2.0)
    assert float_stream(1.0) == float_stream(1)


@pytest.mark.gpu
def test_cupy_draws_the_same_bits() -> None:
    cp = cupy_or_skip()
    tiles = [((0, 0, 0), (3, 4, 5), (3, 4, 5)), ((1, 2), (2, 3), (4, 7)), ((), (), ())]
    for origin, tile, full in tiles:
        want = bits(np, KEY, origin, tile, full, stream=9)
        assert np.array_equal(cp.asnumpy(bits(cp, KEY, origin, tile, full, stream=9)), want)


# --- Dropout and RandomUniformLike kernels ---------------------------------------------


def _args(shape, random=KEY) -> TaskArgs:
    return TaskArgs(
        out_shape=shape,
        valid=(),
        origin=(0,) * len(shape),
        full_shape=shape,
        random=random,
    )


def test_dropout_drops_a_ratio_and_scales_the_rest() -> None:
    shape, ratio = (50, 40, 10), 0.3
    x = np.random.default_rng(0).uniform(0.5, 2.0, shape).astype(np.float32)
    attrs = DropoutAttrs(ratio, training=True, seed=None)
    y = dropout_forward(np, attrs, [x], _args(shape))
    assert y.dtype == np.float32 and y.shape == shape
    kept = y != 0
    assert abs(1 - kept.mean() - ratio) < 0.01
    np.testing.assert_allclose(y[kept], x[kept] / np.float32(1 - ratio), rtol=1e-6)
    # The mask is uniform >= ratio of the op's bits.
    assert np.array_equal(kept, _whole(shape) >= ratio)
    g = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    (dx,) = dropout_backward(np, attrs, [x], y, g, _args(shape))
    assert dx.dtype == np.float32
    np.testing.assert_allclose(dx, np.where(kept, g / np.float32(1 - ratio), 0), rtol=1e-6)


@pytest.mark.parametrize(
    "attrs,random",
    [
        (DropoutAttrs(0.5, training=False, seed=None), KEY),
        (DropoutAttrs(0.0, training=True, seed=None), KEY),
        (DropoutAttrs(0.5, training=True, seed=None), None),
    ],
    ids=["training_mode_false", "ratio_0", "not_training"],
)
def test_dropout_identities(attrs, random) -> None:
    x = np.random.default_rng(0).standard_normal((4, 5))
    y = dropout_forward(np, attrs, [x], _args(x.shape, random))
    assert np.array_equal(y, x) and y is not x
    (dx,) = dropout_backward(np, attrs, [x], y, x, _args(x.shape, random))
    assert np.array_equal(dx, x) and dx is not x


def test_dropout_seed_attribute_is_a_stream_of_its_own() -> None:
    x = np.ones((32, 32))
    masks = [
        dropout_forward(np, DropoutAttrs(0.5, True, seed), [x], _args(x.shape)) != 0
        for seed in (None, 1, 2)
    ]
    assert not np.array_equal(masks[0], masks[1])
    assert not np.array_equal(masks[1], masks[2])


def test_random_uniform_like() -> None:
    shape = (20, 30)
    x = np.zeros(shape, np.float32)
    attrs = RandomUniformAttrs(-2.0, 0.5, float_stream(3.0))
    y = random_uniform_like_forward(np, attrs, [x], _args(shape))
    assert y.dtype == np.float32 and y.shape == shape
    assert y.min() >= -2.0 and y.max() <= 0.5 and y.std() > 0.5
    again = random_uniform_like_forward(np, attrs, [x + 1], _args(shape))
    assert np.array_equal(y, again)  # the input's values play no part
    # Not training: the fixed inference key, so inference is deterministic.
    infer = random_uniform_like_forward(np, attrs, [x], _args(shape, None))
    fixed = random_uniform_like_forward(np, attrs, [x], _args(shape, INFERENCE_KEY))
    assert np.array_equal(infer, fixed)
    assert not np.array_equal(infer, y)
    (dx,) = random_uniform_like_backward(np, attrs, [x], y, np.ones_like(y), _args(shape))
    assert dx.shape == shape and dx.dtype == np.float32 and not dx.any()


# --- converters -----------------------------------------------------------------------------

X = Tensor("x", (2, 3), DType.FLOAT32, TensorRole.INPUT)


def _ctx(op_type, inputs, constants) -> NodeContext:
    return NodeContext("node", op_type, tuple(inputs), tuple(constants), ("y",))


def _ratio(value, role=TensorRole.CONSTANT):
    v = np.asarray(value, np.float32)
    return Tensor("r", v.shape, DType.FLOAT32, role), v


def test_dropout_reads_constants_as_attributes() -> None:
    r, v = _ratio(0.25)
    op = convert_dropout(_ctx("Dropout", [X, r, None], [None, v, np.bool_(True)]), seed=4)
    assert op.attrs == DropoutAttrs(float(np.float32(0.25)), True, 4)
    assert op.inputs == ("x",)  # the ratio is no operand
    op = convert_dropout(_ctx("Dropout", [X], [None]))
    assert op.attrs == DropoutAttrs(0.5, False, None)
    # A ratio that is a folded constant without a tensor (an older importer) reads too.
    op = convert_dropout(_ctx("Dropout", [X, None], [None, np.array([0.1])]))
    assert op.attrs.ratio == 0.1 and not op.attrs.training


@pytest.mark.parametrize(
    "inputs,constants,match",
    [
        ([X, _ratio(1.0)[0]], [None, _ratio(1.0)[1]], "0 <= ratio < 1"),
        ([X, _ratio(-0.1)[0]], [None, _ratio(-0.1)[1]], "0 <= ratio < 1"),
        ([X, _ratio(float("nan"))[0]], [None, _ratio(float("nan"))[1]], "0 <= ratio < 1"),
        ([X, _ratio([0.1, 0.2])[0]], [None, _ratio([0.1, 0.2])[1]], "scalar"),
        ([X, _ratio(0.1, TensorRole.ACTIVATION)[0]], [None, None], "constant"),
        ([X, None], [None, np.int64(0)], "float scalar"),
        ([X, None, None], [None, None, np.int64(1)], "bool scalar"),
    ],
    ids=["ratio_1", "negative", "nan", "vector", "computed", "int_ratio", "int_training"],
)
def test_dropout_refusals(inputs, constants, match) -> None:
    with pytest.raises(ModelError, match=match):
        convert_dropout(_ctx("Dropout", inputs, constants))


def test_random_uniform_like_converter() -> None:
    op = convert_random_uniform_like(_ctx("RandomUniformLike", [X], [None]), dtype=1, seed=2.0)
    assert op.attrs == RandomUniformAttrs(0.0, 1.0, float_stream(2.0))
    for kwargs, match in [
        ({"dtype": 7}, "accepted: 1"),
        ({"dtype": 11}, "differs from the input"),
        ({"low": 1.0, "high": 0.0}, "low <= high"),
        ({"high": float("inf")}, "finite"),
    ]:
        with pytest.raises(ModelError, match=match):
            convert_random_uniform_like(_ctx("RandomUniformLike", [X], [None]), **kwargs)
    ints = Tensor("i", (2, 3), DType.INT64, TensorRole.ACTIVATION)
    with pytest.raises(ModelError, match="only a float input"):
        convert_random_uniform_like(_ctx("RandomUniformLike", [ints], [None]))
