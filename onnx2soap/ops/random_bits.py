"""Plan-independent random numbers: a counter-based hash of (key, global element index).

A random op (Dropout in training, RandomUniformLike) must draw the same value for an
element whatever task computes it, so that N ranks under any plan train exactly like one
device. Nothing here keeps state: the value of element ``i`` of an op's output is a pure
function of the op's ``RandomKey`` (seed, step, op index), an optional ``stream`` (the
node's own ``seed`` attribute) and ``i``, the element's row-major index in the *whole*
output. A task computes only its tile's indices from ``TaskArgs.origin`` and
``full_shape``.

The hash is SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014) evaluated in closed form: SplitMix64 seeded with ``s`` returns,
as its ``(i + 1)``-th output, ``fmix(s + (i + 1) * GAMMA)`` (everything mod 2**64), so
element ``i`` is exactly that output with ``s`` a SplitMix64 hash of the key. The key's
hash is computed once in Python integers; per element it costs one multiply-add and the
finalizer (three xor-shifts, two multiplies) on ``uint64`` arrays, which numpy and cupy
evaluate with the same wrapping arithmetic, hence the same bits on CPU and GPU. The top
53 bits of the result, divided by 2**53, give a float64 uniform on [0, 1).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np

from onnx2soap.ops.base import Array, RandomKey

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd: SplitMix64's increment
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_FLOAT_BITS = 53


def _fmix(z: int) -> int:
    """SplitMix64's finalizer on one Python integer (a bijection of 64-bit words)."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def key_hash(key: RandomKey, stream: int = 0) -> int:
    """A 64-bit seed from the key's words, chained so that each word (order included)
    changes it: for a fixed prefix each step is a bijection of the next word."""
    h = 0
    for word in (key.seed, key.step, key.op, stream):
        h = _fmix((h + _GAMMA + (word & _MASK)) & _MASK)
    return h


def float_stream(value: float | None) -> int:
    """A stream number from a float ``seed`` attribute (RandomUniformLike's): its IEEE
    bits, so every distinct seed is a distinct stream; None (absent) is stream 0."""
    return 0 if value is None else struct.unpack("<Q", struct.pack("<d", float(value)))[0]


def _flat_index(xp, origin, tile_shape, full_shape) -> Array:
    """The global row-major index of every element of the tile, as uint64."""
    u64 = xp.uint64
    strides = [math.prod(full_shape[a + 1 :]) for a in range(len(full_shape))]
    # Summed by broadcasting, so only the last axis's sum is tile-sized.
    index = xp.zeros((1,) * len(tile_shape), dtype=u64)
    for a, (start, size, stride) in enumerate(zip(origin, tile_shape, strides, strict=True)):
        along = (xp.arange(size, dtype=u64) + u64(start)) * u64(stride)
        shape = [1] * len(tile_shape)
        shape[a] = size
        index = index + along.reshape(shape)
    return xp.broadcast_to(index, tuple(tile_shape)).copy()  # fresh: hashed in place


def _check(origin, tile_shape, full_shape) -> None:
    if not len(origin) == len(tile_shape) == len(full_shape):
        raise ValueError(
            f"origin {list(origin)}, tile {list(tile_shape)} and full shape "
            f"{list(full_shape)} must have one entry per axis"
        )
    for o, t, f in zip(origin, tile_shape, full_shape, strict=True):
        if o < 0 or t < 0 or o + t > f:
            raise ValueError(
                f"tile {list(tile_shape)} at {list(origin)} does not lie inside {list(full_shape)}"
            )


def bits(
    xp,
    key: RandomKey,
    origin: Sequence[int],
    tile_shape: Sequence[int],
    full_shape: Sequence[int],
    *,
    stream: int = 0,
) -> Array:
    """64 random bits (uint64) per element of the tile: SplitMix64 seeded with the key's
    hash, at the element's global row-major index."""
    _check(origin, tile_shape, full_shape)
    u64 = xp.uint64
    # Numpy warns when a 0-d (scalar) uint64 product wraps; the wrap is the point. The
    # steps work in place on the fresh index array: a tile can hold millions of elements.
    with np.errstate(over="ignore"):
        z = _flat_index(xp, origin, tile_shape, full_shape)
        z *= u64(_GAMMA)
        z += u64((key_hash(key, stream) + _GAMMA) & _MASK)
        for shift, factor in ((30, _M1), (27, _M2)):
            z ^= z >> u64(shift)
            z *= u64(factor)
        z ^= z >> u64(31)
    return xp.asarray(z, dtype=u64).reshape(tuple(tile_shape))


def uniform(
    xp,
    key: RandomKey,
    origin: Sequence[int],
    tile_shape: Sequence[int],
    full_shape: Sequence[int],
    *,
    stream: int = 0,
) -> Array:
    """A float64 uniform on [0, 1) per element of the tile (its top 53 bits / 2**53): the
    value of an element depends only on ``key``, ``stream`` and its global index."""
    z = bits(xp, key, origin, tile_shape, full_shape, stream=stream)
    top = (z >> xp.uint64(64 - _FLOAT_BITS)).astype(xp.float64)
    return top * (1.0 / (1 << _FLOAT_BITS))
