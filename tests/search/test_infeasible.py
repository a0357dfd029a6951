"""The walk among plans that do not fit: ordered by how far they overflow the devices'
memory, so a search whose starts all overflow walks toward plans that fit (issue 31,
part 4: every infeasible plan had cost infinity, and the walk was blind)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from onnx2soap.errors import UserError
from onnx2soap.search.exhaustive import exhaustive
from onnx2soap.search.mcmc import (
    NOWHERE,
    Cost,
    Scale,
    SearchOptions,
    _rule_strategies,
    _Search,
    cost_in,
    mcmc,
)
from onnx2soap.sim import Evaluation, RooflineCost, Simulator
from onnx2soap.sim.machine import ComputeDevice
from onnx2soap.sim.memory import peak_memory
from onnx2soap.sim.presets import cpu
from onnx2soap.soap import ParallelConfig, Partitioner, Strategy, analyze
from tests.sim.tiny import tiny_graph


def test_a_plan_that_fits_comes_before_every_plan_that_does_not() -> None:
    fast_over, slow_fit = Cost(1, 1e-6), Cost(0, 1e6)
    assert slow_fit < fast_over < NOWHERE
    assert Cost(10, 9.0) < Cost(11, 1.0)  # less overflow first, whatever the time
    assert Cost(10, 1.0) < Cost(10, 2.0)  # then the time
    assert slow_fit.fits and not fast_over.fits
    assert slow_fit.seconds == 1e6 and fast_over.seconds == math.inf


def test_overflow_is_the_bytes_past_each_device_s_memory_summed() -> None:
    over = Evaluation(2.0, (150, 90, 130), 0, fits=False)
    assert cost_in(over, (100, 100, 100)) == Cost(50 + 30, 2.0)
    assert cost_in(Evaluation(3.0, (90, 90, 90), 0, fits=True), (100,) * 3) == Cost(0, 3.0)


def test_acceptance_never_leaves_a_fit_and_prefers_less_overflow(tmp_path: Path) -> None:
    graph = tiny_graph(tmp_path)
    search = _Search(graph, analyze(graph), Simulator(cpu(2), RooflineCost()), SearchOptions())
    rng = np.random.default_rng(0)
    scale = Scale(1.0, 100.0)
    draws = range(200)
    assert not any(search._accept(rng, Cost(0, 5.0), Cost(1, 0.1), scale) for _ in draws)
    assert all(search._accept(rng, Cost(500, 0.1), Cost(0, 9.0), scale) for _ in draws)
    assert all(search._accept(rng, Cost(500, 0.1), Cost(400, 9.0), scale) for _ in draws)
    # 1 % more overflow of the scale's bytes: exp(-200 * 0.01), as a 1 % slower plan
    taken = sum(search._accept(rng, Cost(500, 1.0), Cost(501, 1.0), scale) for _ in range(4000))
    assert abs(taken / 4000 - math.exp(-2.0)) < 0.03


def test_the_walk_from_starts_that_all_overflow_reaches_a_plan_that_fits(
    tmp_path: Path,
) -> None:
    graph = tiny_graph(tmp_path, batch=4, hidden=1024, relu=True)  # weight-heavy
    space = analyze(graph)
    partitioner = Partitioner(graph)
    named, _ = _rule_strategies(graph, space, Simulator(cpu(4), RooflineCost()), SearchOptions())
    # a byte less than the least any start needs: no start fits
    limit = min(max(peak_memory(partitioner.partition(s), 4)) for s in named.values()) - 1
    device = ComputeDevice("dev", 1e9, 1e10, limit, 1e-6)
    tight = Simulator(cpu(4, device, 1e9, 1e-6), RooflineCost())
    optimum = exhaustive(graph, space, tight).evaluation  # some of the 1,232 plans fit
    assert optimum.fits and max(optimum.peak_memory_bytes) <= limit
    reached = 0
    for seed in range(10):  # the walk alone (no ZeRO), ended by max_evals: reproducible
        options = SearchOptions(budget_s=60, seed=seed, max_evals=300, zero_stages=())
        try:
            result = mcmc(graph, space, tight, options)
        except UserError:  # it found none: never a plan that overflows
            continue
        assert result.evaluation.fits and max(result.evaluation.peak_memory_bytes) <= limit
        assert result.best_start is None  # what it returns is the walk's own
        assert result.evaluation.step_time_s >= optimum.step_time_s
        reached += 1
    assert reached >= 9


def test_a_plan_that_overflows_is_changed_where_it_overflows(tmp_path: Path) -> None:
    """Half the pivots of a chain whose plan overflows are ops on its fullest device."""
    graph = tiny_graph(tmp_path, batch=4, hidden=1024, relu=True)
    space = analyze(graph)
    names = [op.name for op in graph.ops]  # gemm, relu, loss
    one = {
        n: ParallelConfig((1,) * len(space[n]), (d,)) for n, d in zip(names, (2, 1, 1), strict=True)
    }
    strategy = Strategy(4, one)
    peaks = peak_memory(Partitioner(graph).partition(strategy), 4)
    assert max(peaks) == peaks[2]  # the weight's device: W, its gradient, the input
    device = ComputeDevice("dev", 1e9, 1e10, peaks[1] + 1, 1e-6)  # device 2 overflows alone
    search = _Search(
        graph, space, Simulator(cpu(4, device, 1e9, 1e-6), RooflineCost()), SearchOptions()
    )
    chain = search.start(strategy, np.random.default_rng(0))
    assert not chain.cost.fits and search.fullest_ops(chain) == (names[0],)
    drawn = [search.pivot(chain) for _ in range(3000)]
    # half of them on device 2's op, the other half uniform over the three
    assert abs(drawn.count(names[0]) / 3000 - (0.5 + 0.5 / 3)) < 0.03
