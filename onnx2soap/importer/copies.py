"""Weights that are copies of each other: what an exporter leaves of a tie it broke.

Dynamo's default ``optimize=True`` may store a tied weight (GPT-2's embedding and LM
head) as two initializers, or one as the transpose of another: they would then train
apart. ``weight_copies`` finds such pairs so ``inspect`` can say so.

Planning reads no weight bytes, so neither does this, but for a sample: each weight that
has a twin of the same (or transposed) shape and dtype is sampled at ``SAMPLES`` fixed
positions; only weights whose samples match are compared whole, a box of rows at a
time. A model without copies costs a few reads per weight, whatever its size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import numpy as np

from onnx2soap.importer.weights import StoredTensor

SAMPLES = 64
COMPARE_BYTES = 16 << 20  # compared whole: this many bytes of each weight at a time


class CopyKind(Enum):
    EQUAL = "equal"
    TRANSPOSED = "transposed"


@dataclass(frozen=True)
class WeightCopy:
    first: str
    second: str
    kind: CopyKind


def _positions(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``SAMPLES`` positions spread over the tensor (row-major), the same for any
    tensor of this shape."""
    size = math.prod(shape)
    flat = sorted({k * size // SAMPLES for k in range(SAMPLES)} | {size - 1})
    return [tuple(int(i) for i in np.unravel_index(f, shape)) for f in flat]


def _sample(tensor: StoredTensor, positions: list[tuple[int, ...]]) -> bytes:
    values = [tensor.read(tuple((i, i + 1) for i in p)).reshape(()) for p in positions]
    return np.asarray(values, dtype=tensor.dtype).tobytes()


def _equal(a: StoredTensor, b: StoredTensor, transposed: bool) -> bool:
    """Whether ``b`` equals ``a`` (or ``a``'s transpose), read a band of rows at a time."""
    rows = a.shape[0] if a.ndim else 1
    row_bytes = max(1, a.nbytes // max(rows, 1))
    step = max(1, COMPARE_BYTES // row_bytes)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        band = ((lo, hi), *((0, n) for n in a.shape[1:]))
        mine = a.read(band)
        theirs = b.read(((0, b.shape[0]), (lo, hi))).T if transposed else b.read(band)
        if not np.array_equal(mine, theirs):
            return False
    return True


def weight_copies(weights: Mapping[str, StoredTensor]) -> tuple[WeightCopy, ...]:
    """Pairs of weights with equal values, or one the transpose of the other (2-D),
    ignoring weights whose sample is constant (zeros and ones are equal by nature:
    biases, LayerNorm). In name order, each copy is paired with the first weight it
    copies, and is not itself compared again."""
    samples: dict[tuple[str, bool], bytes] = {}

    def sample(name: str, transposed: bool = False) -> bytes:
        if (name, transposed) not in samples:
            t = weights[name]
            samples[name, transposed] = (
                _sample(t, [p[::-1] for p in _positions(t.shape[::-1])])
                if transposed
                else _sample(t, _positions(t.shape))
            )
        return samples[name, transposed]

    originals: dict[tuple, list[str]] = {}  # (dtype, shape) -> weights no copy of another
    found: list[WeightCopy] = []
    for name in sorted(weights):
        t = weights[name]
        if t.size < 2:
            continue
        key = (t.dtype.str, t.shape)
        flipped = (t.dtype.str, t.shape[::-1]) if t.ndim == 2 and t.shape[0] != t.shape[1] else None
        if key not in originals and flipped not in originals:
            originals.setdefault(key, []).append(name)  # no twin so far: nothing read
            continue
        if _constant(sample(name), t.dtype):
            continue
        copy = _first_copy(weights, name, originals.get(key, []), sample, CopyKind.EQUAL)
        if copy is None and flipped is not None:
            twins = originals.get(flipped, [])
            copy = _first_copy(weights, name, twins, sample, CopyKind.TRANSPOSED)
        if copy is None:
            originals.setdefault(key, []).append(name)
        else:
            found.append(copy)
    return tuple(found)


def _first_copy(weights, name: str, candidates: list[str], sample, kind: CopyKind):
    """The pair of ``name`` with the first candidate it copies (``kind``), or None."""
    transposed = kind is CopyKind.TRANSPOSED
    for first in candidates:
        if sample(first, transposed) == sample(name) and _equal(
            weights[first], weights[name], transposed
        ):
            return WeightCopy(first, name, kind)
    return None


def _constant(sample: bytes, dtype: np.dtype) -> bool:
    values = np.frombuffer(sample, dtype=dtype)
    return bool(np.all(values == values[0]))
