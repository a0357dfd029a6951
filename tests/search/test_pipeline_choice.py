"""The search's outer choice (search/pipeline_choice.py): its grid offers only shapes the
pipeline rule accepts, the rule's own default among them; its 1 % rule; and its pricing
equals the rule's plan priced by ``plan --strategy pipeline``'s code path."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from onnx2soap.importer import load_model
from onnx2soap.precision import Precision
from onnx2soap.search.megatron import node_size
from onnx2soap.search.pipeline_choice import (
    GAIN,
    STAGE_COUNTS,
    Candidate,
    Pricing,
    Shape,
    choose,
    grid,
    price_pipeline,
)
from onnx2soap.search.pipeline_rule import (
    default_shape,
    full_recompute,
    pipeline_plan,
    shape_accepted,
)
from onnx2soap.search.planner import PIPELINE_MIN_S, choice_bound
from onnx2soap.sim import Evaluation, RooflineCost, make_simulator, resolve_machine
from onnx2soap.soap import Partitioner, Strategy, analyze
from onnx2soap.soap.pipeline import Schedule
from onnx2soap.soap.zero import ZeroStage

MACHINES = ("cpu:4", "flexflow-p100:4", "dgx-h100:2", "cpu:2")


@pytest.mark.parametrize("spec", MACHINES)
@pytest.mark.parametrize("batch", [1, 6, 8, 64])
@pytest.mark.parametrize("ops", [3, 40])
def test_the_grid_offers_only_what_the_rule_accepts(spec: str, batch: int, ops: int) -> None:
    machine = resolve_machine(spec)
    devices = machine.size
    shapes = grid(machine, batch, ops)
    assert len(shapes) == len(set(shapes))
    default = default_shape(machine, batch, ops)
    counts = {*STAGE_COUNTS, devices // node_size(machine), *(default[:1] if default else ())}
    for stages, microbatches in shapes:
        assert shape_accepted(devices, batch, ops, stages, microbatches)
        assert stages in counts and stages >= 2
    if default is not None:  # the rule's baseline is always priced
        assert default in shapes
    # a stage count the rule accepts with some microbatches is in the grid
    for stages in counts:
        if any(shape_accepted(devices, batch, ops, stages, m) for m in range(1, batch + 1)):
            assert any(s == stages for s, _ in shapes) or stages < 2


def _candidate(step: float, fits: bool) -> Candidate:
    ev = Evaluation(step, (1,), 0, fits)
    shape = Shape(2, 2, None, False)
    return Candidate(shape, Strategy(1, {}), None, {}, None, (), ZeroStage.NONE, ev)  # type: ignore[arg-type]


def test_one_percent_rule() -> None:
    plain = Evaluation(1.0, (1,), 0, True)
    close, far = _candidate(1 - GAIN / 2, True), _candidate(1 - 2 * GAIN, True)
    unfit = _candidate(0.5, False)
    assert choose(plain, [close, unfit]) is None  # under 1 %: the plain plan stands
    assert choose(plain, [close, far, unfit]) is far
    over = Evaluation(1.0, (1,), 0, False)
    slow = _candidate(3.0, True)
    assert choose(over, [slow, unfit]) is slow  # nothing plain fits: the fastest that fits
    assert choose(over, [unfit]) is None
    # a by-rule baseline faster than the plan wins at any gain: never slower than one
    assert choose(plain, [close], [close]) is close
    assert choose(plain, [far], [close]) is far


def test_a_machine_margin_raises_the_gain_a_pipeline_or_baseline_needs() -> None:
    plain = Evaluation(1.0, (1,), 0, True)
    within, beyond = _candidate(0.92, True), _candidate(0.85, True)
    assert choose(plain, [within], margin=0.1) is None  # 8 % faster: inside 10 %
    assert choose(plain, [within, beyond], margin=0.1) is beyond
    assert choose(plain, [], [within], margin=0.1) is None  # a baseline needs it too
    assert choose(plain, [], [beyond], margin=0.1) is beyond
    assert choose(plain, [within], margin=0.0) is within  # no margin: GAIN's 1 %


def test_pricing_is_the_rules(example_onnx: Path) -> None:
    """Each grid shape priced by the choice equals the rule's plan priced afresh."""
    machine = resolve_machine("cpu:4")
    graph = load_model(example_onnx, 8).graph
    pricing = Pricing(machine, 1, Precision.FP32)
    for stages, microbatches in grid(machine, graph.batch, len(graph.ops)):
        micro = load_model(example_onnx, 8 // microbatches).graph
        space = analyze(micro)
        shape = Shape(stages, microbatches, Schedule.ONE_F_ONE_B, False)
        got = price_pipeline(micro, space, RooflineCost(), pricing, shape)
        plain = make_simulator(machine, RooflineCost(), 1)
        built = pipeline_plan(micro, space, plain, stages, microbatches)
        priced = make_simulator(machine, RooflineCost(), 1, pipeline=built.pipeline)
        want = priced.evaluate(Partitioner(micro).partition(built.strategy))
        assert math.isclose(got.evaluation.step_time_s, want.step_time_s, rel_tol=1e-12)
        assert got.evaluation.peak_memory_bytes == want.peak_memory_bytes


def test_recomputing_the_walks_plan_is_priced_as_the_rule(example_onnx, tmp_path) -> None:
    """The walk's best recomputing (here data parallelism) is priced as ``plan
    --strategy data-parallel --recompute all`` prices it."""
    import json

    from onnx2soap.cli import main as cli
    from onnx2soap.search.baselines import data_parallel
    from onnx2soap.search.pipeline_choice import price_recompute

    machine = resolve_machine("cpu:4")
    graph = load_model(example_onnx, 8).graph
    space = analyze(graph)
    pricing = Pricing(machine, 0, Precision.FP32)  # plan's default optimizer: sgd
    strategy = data_parallel(graph, space, 4)
    got = price_recompute(graph, space, RooflineCost(), pricing, strategy, ZeroStage.NONE)
    out = tmp_path / "dp.json"
    argv = ["plan", str(example_onnx), "--batch", "8", "--devices", "4"]
    argv += ["--strategy", "data-parallel", "--recompute", "all", "--costs", "roofline"]
    assert cli([*argv, "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sorted(doc["recompute"]) == sorted(got.recompute) and got.recompute
    assert math.isclose(doc["predicted"]["step_time_s"], got.evaluation.step_time_s, rel_tol=1e-9)
    assert max(doc["predicted"]["peak_memory_bytes"]) == max(got.evaluation.peak_memory_bytes)


def test_the_time_bound_prices_the_rules_default_first(example_onnx) -> None:
    """Past ``max_s`` no grid shape is begun; the rule's default shape (the pipeline
    baseline) is priced first, so it always is."""
    from onnx2soap.search.baselines import data_parallel
    from onnx2soap.search.pipeline_choice import pipeline_choice

    machine = resolve_machine("cpu:4")
    graph = load_model(example_onnx, 8).graph
    space = analyze(graph)
    pricing = Pricing(machine, 0, Precision.FP32)
    strategy = data_parallel(graph, space, 4)
    plain = make_simulator(machine, RooflineCost())
    best = plain.evaluate(Partitioner(graph).partition(strategy))
    args = (graph, space, lambda b: load_model(example_onnx, b).graph, RooflineCost())
    full = pipeline_choice(*args, pricing, strategy, best, ZeroStage.NONE)
    bound = pipeline_choice(*args, pricing, strategy, best, ZeroStage.NONE, max_s=0.0)
    shapes = grid(machine, graph.batch, len(graph.ops))
    assert full.skipped == 0 and len(shapes) > 1 and bound.skipped == len(shapes) - 1
    default = default_shape(machine, graph.batch, len(graph.ops))
    # (gradient accumulation, a pipeline of one stage, is priced past the bound)
    one_f = [
        c for c in bound.tried if c.shape.schedule is Schedule.ONE_F_ONE_B and c.shape.stages > 1
    ]
    assert {(c.shape.stages, c.shape.microbatches) for c in one_f} == {default}
    assert bound.baselines["pipeline"].evaluation == full.baselines["pipeline"].evaluation


RULES = [
    ("megatron", ("megatron",)),
    ("data-parallel", ("zero",)),
    ("fsdp", ("zero", "--zero-stage", "3")),
]


@pytest.mark.parametrize(("rule", "strategy"), RULES)
def test_the_rules_recomputing_are_priced_as_plan_prices_them(
    example_onnx, tmp_path, rule: str, strategy: tuple[str, ...]
) -> None:
    """Megatron recomputing, and data parallelism under ZeRO-2 and ZeRO-3 recomputing,
    as ``plan --strategy megatron|zero [--zero-stage 3] --recompute all`` price them."""
    import json

    from onnx2soap.cli import main as cli
    from onnx2soap.search.pipeline_choice import rules_recomputing

    machine = resolve_machine("cpu:4")
    graph = load_model(example_onnx, 8).graph
    space = analyze(graph)
    pricing = Pricing(machine, 0, Precision.FP32)  # plan's default optimizer: sgd
    names = full_recompute(graph, space, pricing.simulator(RooflineCost()))
    got = {c.of: c for c in rules_recomputing(graph, space, RooflineCost(), pricing, names)}[rule]
    out = tmp_path / "r.json"
    argv = ["plan", str(example_onnx), "--batch", "8", "--devices", "4", "--costs", "roofline"]
    assert cli([*argv, "--strategy", *strategy, "--recompute", "all", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sorted(doc["recompute"]) == sorted(got.recompute) and got.recompute
    assert doc.get("zero_stage", 0) == int(got.zero_stage)
    assert math.isclose(doc["predicted"]["step_time_s"], got.evaluation.step_time_s, rel_tol=1e-9)
    assert max(doc["predicted"]["peak_memory_bytes"]) == max(got.evaluation.peak_memory_bytes)


@pytest.mark.parametrize(("rule", "strategy"), RULES)
def test_the_rules_recomputing_selectively_are_priced_as_plan_prices_them(
    example_onnx, tmp_path, rule: str, strategy: tuple[str, ...]
) -> None:
    """Each rule is also offered recomputing selectively (the products kept): priced
    as ``plan --strategy megatron|zero --recompute selective`` prices it, between the
    plain plan and the one recomputing all in time (one forward of the cheap ops, not
    of every op)."""
    import json

    from onnx2soap.cli import main as cli
    from onnx2soap.search.pipeline_choice import rules_recomputing
    from onnx2soap.search.pipeline_rule import selective_recompute

    machine = resolve_machine("cpu:4")
    graph = load_model(example_onnx, 8).graph
    space = analyze(graph)
    pricing = Pricing(machine, 0, Precision.FP32)
    names = full_recompute(graph, space, pricing.simulator(RooflineCost()))
    selective = selective_recompute(graph)
    found = rules_recomputing(graph, space, RooflineCost(), pricing, names, None, selective)
    (full,) = [c for c in found if c.of == rule and not c.selective]
    (got,) = [c for c in found if c.of == rule and c.selective]
    assert got.recompute == selective and set(got.recompute) < {op.name for op in graph.ops}
    out = tmp_path / "r.json"
    argv = ["plan", str(example_onnx), "--batch", "8", "--devices", "4", "--costs", "roofline"]
    redo = ["--recompute", "selective", "-o", str(out)]
    assert cli([*argv, "--strategy", *strategy, *redo]) == 0
    doc = json.loads(out.read_text())
    assert doc["recompute"] == list(got.recompute)
    assert math.isclose(doc["predicted"]["step_time_s"], got.evaluation.step_time_s, rel_tol=1e-9)
    assert max(doc["predicted"]["peak_memory_bytes"]) == max(got.evaluation.peak_memory_bytes)
    assert got.evaluation.step_time_s <= full.evaluation.step_time_s


def test_gradient_accumulation_is_priced_as_the_pipeline_rule_under_zero(
    example_onnx, tmp_path, capsys
) -> None:
    """The choice offers data parallelism accumulating microbatches' gradients (a
    pipeline of one stage) under ZeRO-3, priced as ``plan --strategy pipeline --stages 1
    --microbatches 2 --zero-stage 3`` prices it; where it fits, also with its first
    groups of layers (up to all) at ZeRO-2, the fastest of those (``zero_layers.py``)."""
    import json

    from onnx2soap.cli import main as cli
    from onnx2soap.search.pipeline_choice import accumulating

    machine = resolve_machine("cpu:4")
    graph = load_model(example_onnx, 8).graph
    pricing = Pricing(machine, 0, Precision.FP32)

    def load(batch: int):
        return load_model(example_onnx, batch).graph

    found = accumulating(graph, load, {}, RooflineCost(), pricing)
    fsdp, layered = found  # 8 samples over 4 devices: 2 microbatches at most
    assert fsdp.shape == layered.shape == Shape(1, 2, Schedule.ONE_F_ONE_B, False)
    assert fsdp.zero_stage is ZeroStage.PARAMETERS and not fsdp.zero_weights
    assert fsdp.pipeline is not None and len(fsdp.pipeline.stages) == 1
    assert layered.zero != fsdp.zero and layered.evaluation.fits
    assert layered.evaluation.step_time_s <= fsdp.evaluation.step_time_s
    out = tmp_path / "accumulated.json"
    argv = ["plan", str(example_onnx), "--batch", "8", "--devices", "4", "--costs", "roofline"]
    argv += ["--strategy", "pipeline", "--stages", "1", "--microbatches", "2"]
    assert cli([*argv, "--zero-stage", "3", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["zero_stage"] == 3 and doc["pipeline"]["microbatches"] == 2
    step = doc["predicted"]["step_time_s"]
    assert math.isclose(step, fsdp.evaluation.step_time_s, rel_tol=1e-9)
    assert max(doc["predicted"]["peak_memory_bytes"]) == max(fsdp.evaluation.peak_memory_bytes)
    # the layered one: the plan file with its stages by weight, simulated afresh
    doc["zero_stage"] = int(layered.zero_stage)
    doc["zero_stages"] = {w: int(z) for w, z in layered.zero_weights}
    out.write_text(json.dumps(doc))
    capsys.readouterr()
    assert cli(["simulate", str(out), "--costs", "roofline", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["zero_stages"] == doc["zero_stages"]
    assert math.isclose(again["step_time_s"], layered.evaluation.step_time_s, rel_tol=1e-9)
    assert tuple(again["peak_memory_bytes"]) == layered.evaluation.peak_memory_bytes


def test_a_fixed_batch_model_accumulates_nothing(tmp_path) -> None:
    """A model whose microbatch cannot be loaded offers no gradient accumulation."""
    from onnx2soap.errors import UserError
    from onnx2soap.search.pipeline_choice import accumulating
    from tests.sim.tiny import gemm_model

    graph = load_model(gemm_model(tmp_path / "g.onnx"), batch=8).graph
    pricing = Pricing(resolve_machine("cpu:4"), 0, Precision.FP32)

    def load(batch: int):
        raise UserError("fixed batch")

    assert accumulating(graph, load, {}, RooflineCost(), pricing) == []


def test_past_the_deadline_only_the_first_rule_is_priced(example_onnx) -> None:
    """The rules recomputing are priced FSDP's first, selectively first; past the
    deadline no other is begun."""
    from onnx2soap.search.pipeline_choice import rules_recomputing
    from onnx2soap.search.pipeline_rule import selective_recompute

    graph = load_model(example_onnx, 8).graph
    space = analyze(graph)
    pricing = Pricing(resolve_machine("cpu:4"), 0, Precision.FP32)
    names = full_recompute(graph, space, pricing.simulator(RooflineCost()))
    selective = selective_recompute(graph)
    args = (graph, space, RooflineCost(), pricing, names, None, selective)
    every = rules_recomputing(*args)
    order = [(c.of, c.selective) for c in every]
    assert order == [(r, k) for r in ("fsdp", "data-parallel", "megatron") for k in (True, False)]
    (first,) = rules_recomputing(*args, deadline=0.0)
    assert (first.of, first.selective) == ("fsdp", True)
    assert first.evaluation == every[0].evaluation


def test_the_choice_is_bounded_less_what_the_search_took_past_its_budget() -> None:
    """Half the budget, less the search's overshoot spread over the choice's 2.5 bounds
    (the caller keeps 10 s at least): planning's whole time counts the overshoot once."""
    assert choice_bound(60, 45) == choice_bound(60, 60) == 30
    assert choice_bound(60, 110) == 10
    assert max(PIPELINE_MIN_S, choice_bound(60, 180)) == PIPELINE_MIN_S
    assert 2.5 * (choice_bound(60, 85) - choice_bound(60, 60)) == -25
