"""The walk inside pipelines (search/pipeline_walk.py) against the exhaustive search under
the same simulator: on GPT-2 cut into 2 stages, every boundary position the walk may
use times every stage's tensor-parallel degree is priced one by one through a fresh
simulator, and the walk's plan is the best of them under its own ZeRO stage and
recomputation, which no single change of either improves. A stage at degree ``t`` runs
Megatron-LM's plan at ``t`` on its own devices; the walk's random changes of one op's
config stay inside the op's stage and are kept only where they lower the cost; the walk
never ends worse than its start, and stops at its time bound. (N ranks == 1 device for
the walk's plans: tests/executor/test_pipeline.py's ``WALKED``.)"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from onnx2soap.importer import load_model
from onnx2soap.precision import Precision
from onnx2soap.search.mcmc import cost_in
from onnx2soap.search.megatron import megatron_at
from onnx2soap.search.pipeline_choice import price_pipeline
from onnx2soap.search.pipeline_rule import full_recompute
from onnx2soap.search.pipeline_walk import Layout, StageSpace, walk_pipeline
from onnx2soap.search.priced import Pricing, Shape
from onnx2soap.sim import RooflineCost, resolve_machine
from onnx2soap.soap import Partitioner, analyze
from onnx2soap.soap.pipeline import Schedule, check_pipeline_plan
from onnx2soap.soap.zero import ZeroStage
from tests.optional import require

MICROBATCHES = 2


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    require("torch")
    require("transformers")
    from tests.sequence_models import export_sequence

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on tracing
        return export_sequence("gpt2", tmp_path_factory.mktemp("walk"), "dynamo")


def _setup(model: Path, spec: str, batch: int):
    micro = load_model(model, batch // MICROBATCHES).graph
    space = analyze(micro)
    pricing = Pricing(resolve_machine(spec), 2, Precision.FP32)  # Adam's two slots
    cost = RooflineCost()
    names = full_recompute(micro, space, pricing.simulator(cost))
    shape = Shape(2, MICROBATCHES, Schedule.ONE_F_ONE_B, False)
    start = price_pipeline(micro, space, cost, pricing, shape, names)
    return micro, space, pricing, cost, names, shape, start


def _cost(stages: StageSpace, layout: Layout, pricing: Pricing, cost, names):
    """The layout's plan priced by a simulator of its own, as ``simulate`` prices it."""
    strategy, pipeline = stages.build(layout)
    redo = names if layout.recompute else ()
    simulator = pricing.simulator(cost, zero=layout.zero, pipeline=pipeline, recompute=redo)
    evaluation = simulator.evaluate(Partitioner(stages.micro).partition(strategy))
    return cost_in(evaluation, [d.memory for d in pricing.machine.devices])


@pytest.mark.parametrize(("spec", "batch"), [("cpu:4", 8), ("flexflow-p100:1", 8)])
def test_the_walk_finds_the_exhaustive_optimum_of_two_stages(gpt2: Path, spec: str, batch: int):
    micro, space, pricing, cost, names, shape, start = _setup(gpt2, spec, batch)
    walk = walk_pipeline(start, cost, pricing, names, proposals=0)
    assert walk.converged
    memory = [d.memory for d in pricing.machine.devices]
    found = cost_in(walk.best.evaluation, memory)
    assert found <= cost_in(start.evaluation, memory)
    stages = StageSpace(micro, space, pricing, shape)
    assert len(stages.positions) > 8  # more than the 2 layers' starts
    every = [
        _cost(stages, replace(walk.layout, cuts=(0, p), degrees=d), pricing, cost, names)
        for p in stages.positions
        for d in itertools.product(*stages.degrees)
    ]
    assert found == min(every)
    for zero in ZeroStage:  # one change of the ZeRO stage or of recomputation: no better
        if zero is not walk.layout.zero:
            assert found <= _cost(stages, replace(walk.layout, zero=zero), pricing, cost, names)
    flipped = replace(walk.layout, recompute=not walk.layout.recompute)
    assert found <= _cost(stages, flipped, pricing, cost, names)


def test_a_stage_at_a_degree_runs_megatron_on_its_own_devices(gpt2: Path) -> None:
    micro, space, pricing, _, _, shape, start = _setup(gpt2, "cpu:4", 8)
    stages = StageSpace(micro, space, pricing, shape)
    assert stages.degrees == ((1, 2), (1, 2))  # 2 ranks a stage, all in one node
    cuts = (0, len(micro.ops) // 2)
    strategy, pipeline = stages.build(Layout(cuts, (2, 1), ZeroStage.NONE, False))
    check_pipeline_plan(pipeline, micro, strategy.configs, 4)
    inside = megatron_at(micro, space, 2, 2)
    first, second = pipeline.stages
    for name in first:  # Megatron's config on ranks 0 and 1
        assert strategy[name] == inside[name]
    assert any(c.degrees != start.strategy[n].degrees for n, c in strategy.configs.items())
    for name in second:  # the rule's data parallelism on ranks 2 and 3
        assert set(strategy[name].devices) <= {2, 3}
        assert strategy[name] == start.strategy[name] or name not in start.pipeline.stages[1]


def test_the_walk_stops_at_its_bound_with_its_start(gpt2: Path) -> None:
    _, _, pricing, cost, names, _, start = _setup(gpt2, "cpu:4", 8)
    walk = walk_pipeline(start, cost, pricing, names, max_s=0.0)
    assert walk.best is start and walk.priced == 1 and not walk.converged and not walk.kept


def test_changes_of_one_op_stay_in_its_stage_and_only_lower_the_cost(gpt2: Path) -> None:
    micro, space, pricing, cost, names, shape, start = _setup(gpt2, "flexflow-p100:1", 8)
    plain = walk_pipeline(start, cost, pricing, names, proposals=0)
    walk = walk_pipeline(start, cost, pricing, names, proposals=20, seed=3)
    memory = [d.memory for d in pricing.machine.devices]
    assert cost_in(walk.best.evaluation, memory) <= cost_in(plain.best.evaluation, memory)
    steps = [(k.overflow, k.step_time_s) for k in walk.kept]
    assert steps == sorted(steps, reverse=True) and len(set(steps)) == len(steps)
    stages = StageSpace(micro, space, pricing, shape)
    strategy, pipeline = stages.build(walk.layout)
    for s, names_in_stage in enumerate(pipeline.stages):
        for name in names_in_stage:
            assert set(strategy[name].devices) <= set(stages.groups[s])
    assert any(k.move == "an op's config" for k in walk.kept)
    again = walk_pipeline(start, cost, pricing, names, proposals=20, seed=3)
    assert again.layout == walk.layout  # seeded: the same walk
