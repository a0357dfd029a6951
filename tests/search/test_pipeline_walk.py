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

import functools
import itertools
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from onnx2soap.importer import load_model
from onnx2soap.ir import Graph
from onnx2soap.precision import Precision
from onnx2soap.search.mcmc import cost_in
from onnx2soap.search.megatron import megatron_at
from onnx2soap.search.pipeline_choice import price_pipeline
from onnx2soap.search.pipeline_layout import Layout, Models, StageSpace, model_source
from onnx2soap.search.pipeline_rule import (
    SEARCHED,
    Recompute,
    Space,
    full_recompute,
    selective_recompute,
)
from onnx2soap.search.pipeline_walk import PipelineWalk, microbatch_counts, walk_pipeline
from onnx2soap.search.priced import Candidate, Pricing, Shape
from onnx2soap.sim import RooflineCost, resolve_machine
from onnx2soap.sim.costs import CostModel
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


@dataclass(frozen=True)
class Setup:
    micro: Graph  # the model at the start's microbatch size
    space: Space
    pricing: Pricing
    cost: CostModel
    names: tuple[str, ...]  # --recompute all's list
    shape: Shape
    start: Candidate  # the rule's pipeline
    models: Models  # the model at a microbatch count's size
    model: Path
    batch: int


def _setup(model: Path, spec: str, batch: int) -> Setup:
    micro = load_model(model, batch // MICROBATCHES).graph
    space = analyze(micro)
    pricing = Pricing(resolve_machine(spec), 2, Precision.FP32)  # Adam's two slots
    cost = RooflineCost()
    names = full_recompute(micro, space, pricing.simulator(cost))
    shape = Shape(2, MICROBATCHES, Schedule.ONE_F_ONE_B, False)
    start = price_pipeline(micro, space, cost, pricing, shape, names)

    def loaded(m: int):
        graph = load_model(model, batch // m).graph
        return graph, analyze(graph), cost

    ops = tuple(op.name for op in micro.ops)
    models = model_source(loaded, pricing, shape, ops)
    return Setup(micro, space, pricing, cost, names, shape, start, models, model, batch)


def _walk(s: Setup, **options) -> PipelineWalk:
    return walk_pipeline(s.start, s.models, s.pricing, **options)


@functools.cache
def _fresh(model: Path, size: int) -> tuple[Graph, Space]:
    micro = load_model(model, size).graph
    return micro, analyze(micro)


def _stage_of(stages: StageSpace, layout: Layout, name: str) -> int:
    i = next(k for k, op in enumerate(stages.micro.ops) if op.name == name)
    return max(s for s, cut in enumerate(layout.cuts) if cut <= i)


def _cost(s: Setup, layout: Layout):
    """The layout's plan priced by a simulator of its own, as ``simulate`` prices it, on
    the model loaded afresh at the layout's microbatch size."""
    at = s.models(layout.microbatches)
    micro, space = _fresh(s.model, s.batch // layout.microbatches)
    stages = StageSpace(micro, space, s.pricing, s.shape)
    strategy, pipeline = stages.build(layout)
    lists = {
        Recompute.NONE: (),
        Recompute.ALL: at.redo_names,
        Recompute.SELECTIVE: selective_recompute(micro),
    }
    redo = tuple(
        op.name
        for op in micro.ops
        if op.name in lists[layout.recompute[_stage_of(stages, layout, op.name)]]
    )
    simulator = s.pricing.simulator(s.cost, zero=layout.zero, pipeline=pipeline, recompute=redo)
    evaluation = simulator.evaluate(Partitioner(micro).partition(strategy))
    return cost_in(evaluation, [d.memory for d in s.pricing.machine.devices])


@pytest.mark.parametrize(("spec", "batch"), [("cpu:4", 8)])
def test_the_walk_finds_the_exhaustive_optimum_of_two_stages(gpt2: Path, spec: str, batch: int):
    s = _setup(gpt2, spec, batch)
    walk = _walk(s, proposals=0)
    assert walk.converged
    memory = [d.memory for d in s.pricing.machine.devices]
    found = cost_in(walk.best.evaluation, memory)
    assert found <= cost_in(s.start.evaluation, memory)
    stages = s.models(walk.layout.microbatches).stages
    assert len(stages.positions) > 8  # more than the 2 layers' starts
    every = [
        _cost(s, replace(walk.layout, cuts=(0, p), degrees=d))
        for p in stages.positions
        for d in itertools.product(*stages.degrees)
    ]
    assert found == min(every)
    # one change of the ZeRO stage, recomputation or the microbatch count: no better
    for zero in ZeroStage:
        if zero is not walk.layout.zero:
            assert found <= _cost(s, replace(walk.layout, zero=zero))
    for i in range(2):
        for mode in SEARCHED:  # the walk's modes
            changed = tuple(mode if j == i else r for j, r in enumerate(walk.layout.recompute))
            assert found <= _cost(s, replace(walk.layout, recompute=changed))
    for m in microbatch_counts(batch, 2):
        if m != walk.layout.microbatches:
            assert found <= _cost(s, replace(walk.layout, microbatches=m))


def test_a_stage_at_a_degree_runs_megatron_on_its_own_devices(gpt2: Path) -> None:
    s = _setup(gpt2, "cpu:4", 8)
    micro, start = s.micro, s.start
    stages = StageSpace(micro, s.space, s.pricing, s.shape)
    assert stages.degrees == ((1, 2), (1, 2))  # 2 ranks a stage, all in one node
    cuts = (0, len(micro.ops) // 2)
    layout = Layout(cuts, (2, 1), ZeroStage.NONE, (Recompute.NONE,) * 2, MICROBATCHES)
    strategy, pipeline = stages.build(layout)
    check_pipeline_plan(pipeline, micro, strategy.configs, 4)
    inside = megatron_at(micro, s.space, 2, 2)
    first, second = pipeline.stages
    for name in first:  # Megatron's config on ranks 0 and 1
        assert strategy[name] == inside[name]
    assert any(c.degrees != start.strategy[n].degrees for n, c in strategy.configs.items())
    for name in second:  # the rule's data parallelism on ranks 2 and 3
        assert set(strategy[name].devices) <= {2, 3}
        assert strategy[name] == start.strategy[name] or name not in start.pipeline.stages[1]


def test_the_walk_stops_at_its_bound_with_its_start(gpt2: Path) -> None:
    s = _setup(gpt2, "cpu:4", 8)
    walk = _walk(s, max_s=0.0)
    assert walk.best is s.start and walk.priced == 1 and not walk.converged and not walk.kept


def test_changes_of_one_op_stay_in_its_stage_and_only_lower_the_cost(gpt2: Path) -> None:
    s = _setup(gpt2, "flexflow-p100:1", 8)
    plain = _walk(s, proposals=0, counts=(MICROBATCHES,))
    # the first seed whose 20 random changes of one op keep some (most seeds' keep none:
    # the rule's stages are near their best; which seed does moves with the graph)
    # seeds 6 and 7 keep some at this commit; the rest are tried after them
    seeds = (6, 7, *(k for k in range(12) if k not in (6, 7)))
    walks = ((seed, _walk(s, proposals=20, seed=seed, counts=(MICROBATCHES,))) for seed in seeds)
    kept = ((seed, w) for seed, w in walks if any(k.move == "an op's config" for k in w.kept))
    seed, walk = next(kept, (None, None))
    assert walk is not None, "no seed of 12 kept a change of one op"
    memory = [d.memory for d in s.pricing.machine.devices]
    assert cost_in(walk.best.evaluation, memory) <= cost_in(plain.best.evaluation, memory)
    steps = [(k.overflow, k.step_time_s) for k in walk.kept]
    assert steps == sorted(steps, reverse=True) and len(set(steps)) == len(steps)
    stages = s.models(walk.layout.microbatches).stages
    strategy, pipeline = stages.build(walk.layout)
    for i, names_in_stage in enumerate(pipeline.stages):
        for name in names_in_stage:
            assert set(strategy[name].devices) <= set(stages.groups[i])
    assert any(k.move == "an op's config" for k in walk.kept)
    again = _walk(s, proposals=20, seed=seed, counts=(MICROBATCHES,))
    assert again.layout == walk.layout  # seeded: the same walk
