"""The rules and the search reach copies of weight-only ops: the pipeline rule copies a
stage's weight chain over the stage's devices, the walk's and the ILP's candidates
include copies (and only for weight-only ops), and the ILP's vectorized crossing pieces
are the partition math's for configs with copies (a piece from the reader's own copy
crosses nothing, one from the owner does)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx2soap.importer import load_model
from onnx2soap.search.additive import AdditiveCost, Decisions
from onnx2soap.search.baselines import data_parallel
from onnx2soap.search.ilp import IlpOptions, ilp
from onnx2soap.search.megatron import megatron, megatron_at
from onnx2soap.search.pipeline_rule import pipeline_plan
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.presets import cpu
from onnx2soap.soap import Partitioner, analyze, candidates
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.strategy import Strategy, validate
from tests.search.test_ilp import assert_crossing_is_the_partition_maths
from tests.weight_only_models import CHAIN, weight_chain_model

BATCH = 8


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    path = weight_chain_model(tmp_path_factory.mktemp("chain") / "chain.onnx")
    graph = load_model(path, BATCH).graph
    return graph, analyze(graph)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), devices=st.sampled_from([2, 3, 4]))
def test_crossing_pieces_with_copies_are_the_partition_maths(chain, data, devices) -> None:
    graph, space = chain
    copied = weight_only_ops(graph)
    configs = {
        op.name: data.draw(
            st.sampled_from(candidates(space[op.name], devices, op.name in copied)), label=op.name
        )
        for op in graph.ops
    }
    strategy = Strategy(devices, configs)
    validate(graph, space, strategy)
    assert_crossing_is_the_partition_maths(graph, strategy)


def test_only_weight_only_ops_get_copies_among_their_candidates(chain) -> None:
    graph, space = chain
    simulator = Simulator(cpu(4), RooflineCost())
    decisions = Decisions(graph, space, AdditiveCost(graph, simulator))
    for op in graph.ops:
        with_copies = {c.copies for c in decisions.configs[op.name]} != {1}
        assert with_copies == (op.name in CHAIN), op.name


def test_the_ilp_plans_with_copies(chain) -> None:
    graph, space = chain
    simulator = Simulator(cpu(4), RooflineCost())
    result = ilp(graph, space, simulator, IlpOptions(time_limit_s=30))
    validate(graph, space, result.strategy)


def test_the_pipeline_rule_copies_each_stages_chain(chain) -> None:
    graph, space = chain
    simulator = Simulator(cpu(4), RooflineCost())
    plan = pipeline_plan(graph, space, simulator, stages=2, microbatches=2)
    (first, *_) = plan.pipeline.stages
    for name in CHAIN:
        assert name in first
        config = plan.strategy[name]
        assert (config.copies, config.devices) == (2, (0, 1))
    assert data_parallel(graph, space, 4)["concat"].copies == 4


def test_megatron_cuts_and_copies_the_chain_as_its_readers_read_it(chain) -> None:
    """Megatron-LM's rule on 8 devices in nodes of 4: the Concat cut as the column-split
    MatMul reads it, each chunk copied on the devices that read it; the ops before it on
    every device that reads them: no piece of the chain crosses devices. Inside a
    pipeline stage (``megatron_at``, whose configs the layout moves to the stage's
    devices, copies kept) alike."""
    graph, space = chain
    strategy = megatron(graph, space, 8, 4)
    validate(graph, space, strategy)
    concat = strategy["concat"]
    assert max(concat.degrees) > 1 and concat.copies > 1
    assert all(strategy[name].copies > 1 for name in CHAIN)
    pg = Partitioner(graph).partition(strategy)
    assert all(p.device == c.device for e, _, p, c in pg.moves() if e.producer in CHAIN)
    inside = megatron_at(graph, space, 8, 4)
    assert all(inside[name].copies > 1 for name in CHAIN)
    pg = Partitioner(graph).partition(inside)
    assert all(p.device == c.device for e, _, p, c in pg.moves() if e.producer in CHAIN)
