"""Pipeline stages balanced by time: ops contiguous in topological order, cut so that the
slowest stage is as fast as it can be (a pipeline's step is paced by its slowest stage:
``sim/pipeline_schedule.py``).

The classic linear partition: ``best[s][i]``, the least possible slowest stage when the
first ``i`` ops form ``s`` stages, is the least over the last cut ``j`` of
``max(best[s - 1][j], cost(j, i))``. Exact, with prefix sums; where no cost is negative
the least is found by bisection (``_crossing_row``), O(S·n·log n): 2,225 ops (a
LLaMA-3-8B shape) into 64 stages take 0.04 s, where the scan of every ``j`` took 3.5 s.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from onnx2soap.errors import PlanError


def balanced_stages(costs: Sequence[float], stages: int) -> tuple[range, ...]:
    """``stages`` contiguous, non-empty runs of ops (as index ranges, in order) whose
    largest summed cost is the least possible; ties keep the earliest cuts."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise PlanError(f"{stages} pipeline stages for {n} ops: between 1 and {n} are possible")
    _, cut = stage_tables(np.asarray(costs, dtype=float), stages)
    bounds, i = [n], n
    for s in range(stages, 0, -1):
        i = int(cut[s, i])
        bounds.append(i)
    bounds.reverse()
    return tuple(range(a, b) for a, b in itertools.pairwise(bounds))


def stage_tables(values: np.ndarray, stages: int, scan: bool = False) -> tuple:
    """``best`` and ``cut`` for every stage count up to ``stages`` and op count;
    ``scan``: by the scan alone (what the bisection must equal)."""
    n = len(values)
    prefix = np.concatenate(([0.0], np.cumsum(values)))
    best = np.full((stages + 1, n + 1), np.inf)
    cut = np.zeros((stages + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    monotone = not scan and bool(np.all(np.isfinite(values) & (values >= 0)))
    row = _crossing_row if monotone else _scan_row
    for s in range(1, stages + 1):
        row(best, cut, prefix, s)
    return best, cut


def _scan_row(best: np.ndarray, cut: np.ndarray, prefix: np.ndarray, s: int) -> None:
    """``best[s, i]`` and ``cut[s, i]`` for every ``i`` >= ``s``: the last stage is ops
    ``j..i-1`` (at least one), the slowest stage ``max(best[s - 1, j], prefix[i] -
    prefix[j])``, its first minimum (the earliest cut) over every ``j``."""
    for i in range(s, len(prefix)):
        j = np.arange(s - 1, i)
        slowest = np.maximum(best[s - 1, j], prefix[i] - prefix[j])
        k = int(np.argmin(slowest))
        best[s, i], cut[s, i] = slowest[k], j[k]


def _crossing_row(best: np.ndarray, cut: np.ndarray, prefix: np.ndarray, s: int) -> None:
    """``_scan_row``'s figures where no cost is negative (or NaN), found by bisection,
    every ``i`` at once: then ``before = best[s - 1, j]`` never falls as ``j`` grows and
    ``last = prefix[i] - prefix[j]`` never rises (float subtraction is monotone), so
    the slowest stage is ``last`` up to the first ``j`` where ``before >= last`` and
    ``before`` from there on: its least is ``last`` just before that crossing or
    ``before`` at it, and the first ``j`` holding it is the first where ``last`` is
    that low, or the crossing. The same values and cuts as the scan (tested), in
    O(n log n) a stage where the scan is O(n²): a LLaMA-3-8B shape into 64 stages had
    taken 3.5 s."""
    n = len(prefix) - 1
    i = np.arange(s, n + 1)
    before = best[s - 1]

    def last(j: np.ndarray) -> np.ndarray:
        return prefix[i] - prefix[j]

    # the crossing: the first j in [s - 1, i) with before[j] >= last(j), else i
    cross = _first(s - 1, i, lambda j: before[j] >= last(j))
    a, b = cross - 1, np.minimum(cross, i - 1)  # b: a j where before rules (if any)
    has_a, has_b = a >= s - 1, cross < i
    low_a = np.where(has_a, last(np.maximum(a, s - 1)), np.inf)
    low_b = np.where(has_b, before[b], np.inf)
    take_a = has_a & (low_a <= low_b)
    # the first j whose last is as low as at a: last never rises, so a bisection too
    first_a = _first(s - 1, np.maximum(a, s - 1), lambda j: last(j) <= low_a)
    cut[s, i] = np.where(take_a, first_a, b)
    best[s, i] = np.where(take_a, low_a, low_b)


def _first(lo: int, hi: np.ndarray, holds) -> np.ndarray:
    """Per entry, the first ``j`` in ``[lo, hi]`` where ``holds(j)`` (false, then true,
    as ``j`` grows), or ``hi`` where none before it does."""
    low, high = np.full(len(hi), lo), hi.copy()
    while np.any(low < high):
        mid = (low + high) // 2
        ok = holds(mid)
        high = np.where(ok, mid, high)
        low = np.where(ok, low, mid + 1)
    return low
