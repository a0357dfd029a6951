"""Candidate configs of an op for D devices: the moves the search draws from.

A candidate splits the op's splittable dims into ``p`` tasks, ``p`` a divisor of D, and
places them on an aligned block of ``p`` consecutive devices. Blocks aligned to their own
size keep tasks inside a node on the usual topologies and keep the candidate count small
(hundreds for 64 devices) while still covering data, model (one task on any device) and
hybrid parallelism. A weight-only op's candidates add copies of each split
(``ParallelConfig.copies``) over aligned blocks.
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


def candidates(
    dims: Sequence[SoapDim], devices: int, copies: bool = False
) -> tuple[ParallelConfig, ...]:
    """``copies``: the op is weight-only (``soap/copies.py``), so each split may also be
    computed ``r`` times over an aligned block of ``p * r`` devices (``copied``)."""
    found = _candidates(tuple(dims), devices)
    return found + _copied(tuple(dims), devices) if copies else found


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


def copied_devices(start: int, boxes: int, copies: int) -> tuple[int, ...]:
    """Task ``b * copies + c`` (box b's copy c) on device ``start + c * boxes + b``: each
    run of ``boxes`` devices holds the whole tensor, as a data-parallel replica of a
    split does."""
    return tuple(start + c * boxes + b for b in range(boxes) for c in range(copies))


@functools.lru_cache(maxsize=1024)
def _copied(dims: tuple[SoapDim, ...], devices: int) -> tuple[ParallelConfig, ...]:
    """Every split into ``p`` boxes computed ``r > 1`` times on an aligned block of
    ``p * r`` devices; none with a split reduction dim (a partial sum is not copied)."""
    found = []
    for n in divisors(devices):
        for p in divisors(n):
            r = n // p
            if r == 1:
                continue
            for degrees in degree_vectors(dims, p):
                if any(k > 1 and d.axis is None for d, k in zip(dims, degrees, strict=True)):
                    continue
                for start in range(0, devices, n):
                    found.append(ParallelConfig(degrees, copied_devices(start, p, r), r))
    return tuple(found)
