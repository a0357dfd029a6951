"""Balanced pipeline stages against every way of cutting the ops (small cases)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from onnx2soap.errors import PlanError
from onnx2soap.search.pipeline_stages import balanced_stages, stage_tables


def _slowest_of_every_cut(costs: list[float], stages: int) -> float:
    n = len(costs)
    best = np.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_slowest_stage_is_the_least_any_cut_gives(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    costs = [float(c) for c in rng.exponential(1.0, n)]
    for stages in range(1, n + 1):
        runs = balanced_stages(costs, stages)
        assert len(runs) == stages and all(len(r) for r in runs)
        assert [i for r in runs for i in r] == list(range(n))  # contiguous, in order
        slowest = max(sum(costs[i] for i in r) for r in runs)
        assert slowest == pytest.approx(_slowest_of_every_cut(costs, stages))


def test_equal_layers_split_evenly() -> None:
    assert balanced_stages([1.0] * 8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))


@pytest.mark.parametrize("stages", [0, 4])
def test_more_stages_than_ops_is_refused(stages: int) -> None:
    with pytest.raises(PlanError, match="between 1 and 3"):
        balanced_stages([1.0, 2.0, 3.0], stages)


@pytest.mark.parametrize("seed", range(40))
def test_the_bisection_gives_the_scans_tables_bit_for_bit(seed: int) -> None:
    """Ties included (whole numbers, zeros, repeated layers): the same least slowest
    stage and the same earliest cut for every stage count and op count."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 80))
    pick = seed % 4
    if pick == 0:
        values = rng.exponential(1e-3, n)
    elif pick == 1:
        values = rng.integers(0, 3, n).astype(float)
    elif pick == 2:
        values = np.tile(rng.integers(0, 4, 5).astype(float), n // 5 + 1)[:n]
    else:
        values = np.where(rng.random(n) < 0.3, 0.0, rng.random(n))
    stages = int(rng.integers(1, n + 1))
    fast, scanned = stage_tables(values, stages), stage_tables(values, stages, scan=True)
    assert np.array_equal(fast[0], scanned[0]) and np.array_equal(fast[1], scanned[1])
