"""The cooling probe's fit (``measure/probe_cooling.py``): it recovers a curve it is given
and finds none in figures that do not rise; the probe itself runs under mpiexec in
``machine probe``'s test (tests/sim/test_machine.py)."""

from __future__ import annotations

import math

import pytest

from onnx2soap.measure.probe_cooling import AFTER_GRID, GAPS, fit_cooling


@pytest.mark.parametrize("after", [AFTER_GRID[10], AFTER_GRID[30], AFTER_GRID[50]])
def test_fit_recovers_the_curve_it_is_given(after: float) -> None:
    hot, cost = 15e-6, 1.7e-4
    seconds = [hot + cost * (1 - math.exp(-g / after)) for g in GAPS]
    cooling = fit_cooling(GAPS, seconds)
    assert cooling is not None
    assert cooling.after == pytest.approx(after, rel=1e-12)
    assert cooling.cost == pytest.approx(cost, rel=1e-6)


def test_fit_finds_no_cooling_where_a_silence_costs_nothing() -> None:
    assert fit_cooling(GAPS, [20e-6] * len(GAPS)) is None
    falling = [30e-6 - 1e-3 * g for g in GAPS]  # faster after a silence: no cooling
    assert fit_cooling(GAPS, falling) is None
