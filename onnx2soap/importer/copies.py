"""Weights that are copies of each other: what an exporter leaves of a tie it broke.

Dynamo's default ``optimize=True`` may store a tied weight (GPT-2's embedding and LM
head) as two initializers, or one as the transpose of another: they would then train
apart. ``weight_copies`` finds such pairs so ``inspect`` can say so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import numpy as np


class CopyKind(Enum):
    EQUAL = "equal"
    TRANSPOSED = "transposed"


@dataclass(frozen=True)
class WeightCopy:
    first: str
    second: str
    kind: CopyKind


def _key(a: np.ndarray) -> tuple:
    return (a.dtype.str, a.shape, a.tobytes())


def weight_copies(weights: Mapping[str, np.ndarray]) -> tuple[WeightCopy, ...]:
    """Pairs of weights with equal values, or one the transpose of the other (2-D),
    ignoring constant arrays (zeros and ones are equal by nature: biases, LayerNorm)."""
    found: list[WeightCopy] = []
    seen: dict[tuple, str] = {}
    transposes: dict[tuple, str] = {}
    for name in sorted(weights):
        a = np.ascontiguousarray(weights[name])
        if a.size < 2 or np.all(a == a.flat[0]):
            continue
        key = _key(a)
        if key in seen:
            found.append(WeightCopy(seen[key], name, CopyKind.EQUAL))
        elif key in transposes:
            found.append(WeightCopy(transposes[key], name, CopyKind.TRANSPOSED))
        else:
            seen[key] = name
            if a.ndim == 2 and a.shape[0] != a.shape[1]:
                transposes[_key(np.ascontiguousarray(a.T))] = name
    return tuple(found)
