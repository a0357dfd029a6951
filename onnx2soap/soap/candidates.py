"""Candidate configs of an op for D devices: the moves the search draws from.

A candidate splits the op's splittable dims into ``p`` tasks, ``p`` a divisor of D, and
places them on an aligned block of ``p`` consecutive devices. Blocks aligned to their own
size keep tasks inside a node on the usual topologies and keep the candidate count small
(hundreds for 64 devices) while still covering data, model (one task on any device) and
hybrid parallelism.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from onnx2soap.soap.dims import SoapDim
from onnx2soap.soap.partition import ParallelConfig


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def degree_vectors(dims: Sequence[SoapDim], tasks: int) -> list[tuple[int, ...]]:
    """Every degree vector over the splittable dims whose product is exactly ``tasks``."""
    vectors: list[tuple[int, ...]] = [()]
    for dim in dims:
        options = divisors(tasks) if dim.splittable else (1,)
        vectors = [
            (*v, d)
            for v in vectors
            for d in options
            if d <= dim.max_degree and tasks % (math.prod(v) * d) == 0
        ]
    return [v for v in vectors if math.prod(v) == tasks]


def candidates(dims: Sequence[SoapDim], devices: int) -> tuple[ParallelConfig, ...]:
    return _candidates(tuple(dims), devices)


# Ops of one model share dims (every conv of a stage, every layer of a transformer), and
# the search and the ILP both ask: built once, a model's planning saves seconds at 64
# devices (Inception-v3: 630 calls, 3 s). The tuples are immutable, so sharing is safe.
@functools.lru_cache(maxsize=1024)
def _candidates(dims: tuple[SoapDim, ...], devices: int) -> tuple[ParallelConfig, ...]:
    found = []
    for p in divisors(devices):
        for degrees in degree_vectors(dims, p):
            for start in range(0, devices, p):
                found.append(ParallelConfig(degrees, tuple(range(start, start + p))))
    return tuple(found)
