"""Region proposals (search/regions.py): the pivot's new config shape spread over the ops
within a radius of it, checked on the example CNN against its graph drawn by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnx2soap.errors import UserError
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel, model_parallel
from onnx2soap.search.exhaustive import exhaustive
from onnx2soap.search.mcmc import SearchOptions, mcmc
from onnx2soap.search.regions import RegionMoves, config_shape
from onnx2soap.soap import analyze, candidates
from tests.search.test_mcmc import hybrid_case

DEVICES = 4
# examples/cnn.py: conv1 -> relu1 -> pool1 -> {branch_a: conv -> relu, branch_b: pool ->
# conv -> relu} -> Concat -> pool2 -> flatten -> fc1 -> relu_fc -> fc2 -> loss
CONV1, RELU1, POOL1 = "/conv1/Conv", "/relu1/Relu", "/pool1/MaxPool"
A_CONV, B_POOL, CONCAT = "/branch_a/conv/Conv", "/branch_b/pool/AveragePool", "/Concat"


@pytest.fixture(scope="module")
def cnn(example_onnx: Path):
    graph = load_model(example_onnx, batch=8).graph
    space = analyze(graph)
    moves = {op.name: candidates(space[op.name], DEVICES) for op in graph.ops}
    return graph, space, RegionMoves(graph, space, moves)


def test_neighbours_are_producers_and_readers(cnn) -> None:
    _, _, regions = cnn
    assert set(regions.neighbours[POOL1]) == {RELU1, A_CONV, B_POOL}
    assert set(regions.neighbours[CONV1]) == {RELU1}


def test_region_is_breadth_first_within_the_radius(cnn) -> None:
    _, _, regions = cnn
    assert regions.region(CONV1, 1) == [RELU1]
    assert regions.region(CONV1, 2) == [RELU1, POOL1]
    three = regions.region(CONV1, 3)
    assert three[:2] == [RELU1, POOL1] and set(three[2:]) == {A_CONV, B_POOL}
    graph = cnn[0]
    everything = regions.region(CONV1, len(graph.ops))
    assert sorted(everything) == sorted(op.name for op in graph.ops if op.name != CONV1)


def test_data_parallel_has_one_shape_and_a_channel_split_another(cnn) -> None:
    graph, space, _ = cnn
    dp = data_parallel(graph, space, DEVICES)
    shapes = {config_shape(space[op.name], dp[op.name]) for op in graph.ops}
    assert shapes == {(tuple(range(DEVICES)), (("sample", DEVICES),))}  # the loss's too
    mp = model_parallel(graph, space, DEVICES)
    assert config_shape(space[CONV1], mp[CONV1]) != config_shape(space[CONV1], dp[CONV1])


def test_a_conv_s_channel_split_passes_to_the_relu_after_it(cnn) -> None:
    """conv1's output channels are a parameter dim, relu1's an attribute dim; both index
    axis 1, so the Relu takes the channel split (not a split of its height or width)."""
    graph, space, regions = cnn
    dp = data_parallel(graph, space, DEVICES)
    pivot = next(
        c
        for c in candidates(space[CONV1], DEVICES)
        if config_shape(space[CONV1], c) == ((0, 1, 2, 3), (("axis 1", 4),))
    )
    assert next(d for d in space[CONV1] if d.axis == 1).kind.value == "parameter"
    # Every radius drawn (1 or more) reaches relu1, conv1's only neighbour.
    moved = regions.propose(dp, CONV1, pivot, np.random.default_rng(0))
    relu = dict(zip([d.name for d in space[RELU1]], moved[RELU1].degrees, strict=True))
    channel = next(d for d in space[RELU1] if d.axis == 1)
    assert channel.kind.value == "attribute"
    assert relu[channel.name] == 4 and sum(n > 1 for n in relu.values()) == 1


def test_a_region_move_gives_every_op_of_the_region_the_pivot_s_shape(cnn) -> None:
    graph, space, regions = cnn
    dp = data_parallel(graph, space, DEVICES)
    # The pivot: samples split two ways on devices 2 and 3.
    pivot = next(
        c
        for c in candidates(space[CONV1], DEVICES)
        if config_shape(space[CONV1], c) == ((2, 3), (("sample", 2),))
    )
    for seed in range(20):
        rng = np.random.default_rng(seed)
        moved = regions.propose(dp, CONV1, pivot, rng)
        changed = {name for name in dp.configs if moved[name] != dp[name]}
        assert CONV1 in changed
        for name in changed - {CONV1}:
            assert moved[name].devices == (2, 3), name
            assert config_shape(space[name], moved[name]) == config_shape(space[CONV1], pivot)
            assert moved[name] in candidates(space[name], DEVICES)
        # The changed ops are the pivot and a breadth-first prefix of its region.
        order = regions.region(CONV1, len(graph.ops))
        assert changed - {CONV1} == set(order[: len(changed) - 1])


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_a_share_outside_zero_to_one_is_refused(share) -> None:
    with pytest.raises(UserError, match="region_share must be a finite number in \\[0, 1\\]"):
        SearchOptions(region_share=share)


def test_only_region_moves_still_find_the_brute_force_optimum(tmp_path: Path) -> None:
    """Every proposal a region move (the tiny hybrid case's three ops): the chains still
    reach the optimum no start strategy is, as one-op proposals do."""
    graph, space, sim = hybrid_case(tmp_path)
    optimum = exhaustive(graph, space, sim).evaluation.step_time_s
    found = 0
    for seed in range(10):
        options = SearchOptions(budget_s=120, seed=seed, max_evals=300, region_share=1.0)
        found += mcmc(graph, space, sim, options).evaluation.step_time_s == pytest.approx(
            optimum, rel=1e-12
        )
    assert found >= 8


def test_a_region_move_that_changes_nothing_is_none(cnn) -> None:
    """The pivot's own config on a data-parallel strategy: every op of every region
    already has that shape's only config, so there is nothing to simulate."""
    graph, space, regions = cnn
    dp = data_parallel(graph, space, DEVICES)
    for seed in range(5):
        assert regions.propose(dp, CONV1, dp[CONV1], np.random.default_rng(seed)) is None


def test_ops_of_one_signature_share_one_table_of_shapes(cnn) -> None:
    """Built once per distinct (dims, candidates), as for each op alone."""
    graph, space, regions = cnn
    names = [op.name for op in graph.ops]
    for name in names:
        alone: dict = {}
        for config in candidates(space[name], DEVICES):
            alone.setdefault(config_shape(space[name], config), []).append(config)
        assert regions.by_shape[name] == alone
    for a in names:
        for b in names:
            if space[a] == space[b]:
                assert regions.by_shape[a] is regions.by_shape[b]
    assert len({id(regions.by_shape[n]) for n in names}) == len({space[n] for n in names})
