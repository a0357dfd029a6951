"""Balanced pipeline stages against every way of cutting the ops (small cases)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from onnx2soap.errors import PlanError
from onnx2soap.search.pipeline_stages import balanced_stages


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
