"""The search chooses ZeRO (issue 31, part 4): after the walk its best and leading starts
are priced under ZeRO stages 1 and 2, and the plan is the fastest that fits; the stage
is the plan file's ``zero_stage`` and ``plan --json``'s."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from onnx2soap.cli import main as cli
from onnx2soap.errors import UserError
from onnx2soap.search.baselines import Rule, by_rule
from onnx2soap.search.exhaustive import exhaustive
from onnx2soap.search.mcmc import ZERO_GAIN, SearchOptions, _could_fit, _Search, mcmc
from onnx2soap.sim import RooflineCost, make_simulator
from onnx2soap.sim.machine import ComputeDevice, Machine, dump_machine
from onnx2soap.sim.memory import OPTIMIZER_SLOTS
from onnx2soap.sim.presets import cpu
from onnx2soap.soap import Partitioner, analyze
from onnx2soap.soap.zero import ZeroStage
from tests.sim.tiny import gemm_model

ADAM = OPTIMIZER_SLOTS["adam"]  # two arrays of state per weight: what ZeRO shards
BATCH = 256  # activations outweigh the weight: data parallelism is the fastest plan


def _machine(memory: int) -> Machine:
    device = ComputeDevice("dev", 1e9, 1e10, memory, 1e-6)
    return replace(cpu(4, device, 1e8, 1e-6), transfers_use_compute=False)


@pytest.fixture
def case(tmp_path: Path):
    """x [256, 8] -> Gemm(W [8, 1024]) -> Relu -> cross-entropy on 4 devices, Adam; the
    memory that data parallelism with ZeRO needs."""
    from onnx2soap.importer import load_model

    path = gemm_model(tmp_path / "tiny.onnx", hidden=1024, relu=True)
    graph = load_model(path, batch=BATCH).graph
    space = analyze(graph)
    dp = Partitioner(graph).partition(by_rule(Rule.DATA_PARALLEL, graph, space, 4))
    peaks = {
        z: max(
            make_simulator(_machine(1 << 30), RooflineCost(), ADAM, zero=z)
            .evaluate(dp)
            .peak_memory_bytes
        )
        for z in ZeroStage
    }
    assert peaks[ZeroStage.GRADIENTS] < peaks[ZeroStage.NONE]
    return path, graph, space, peaks


def test_a_plan_that_fits_only_with_zero_gets_it(case) -> None:
    _, graph, space, peaks = case
    tight = make_simulator(_machine(peaks[ZeroStage.GRADIENTS]), RooflineCost(), ADAM)
    with pytest.raises(UserError, match="fits"):  # no plan of the space fits without ZeRO
        exhaustive(graph, space, tight)
    result = mcmc(graph, space, tight, SearchOptions(budget_s=60, seed=0, max_evals=200))
    assert result.zero_stage in (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS)
    assert result.best_from == "data-parallel" and result.evaluation.fits
    # the evaluation is the plan's under its stage, as a simulator of that stage has it
    by = make_simulator(
        _machine(peaks[ZeroStage.GRADIENTS]), RooflineCost(), ADAM, zero=result.zero_stage
    )
    ev = by.evaluate(Partitioner(graph).partition(result.best))
    assert ev == result.evaluation
    assert ("data-parallel", result.zero_stage, ev) in result.zero_tried


def test_with_ample_memory_no_zero_unless_it_is_faster(case) -> None:
    _, graph, space, _ = case
    ample = make_simulator(_machine(1 << 30), RooflineCost(), ADAM)
    result = mcmc(graph, space, ample, SearchOptions(budget_s=60, seed=0, max_evals=200))
    assert result.zero_stage is ZeroStage.NONE
    assert result.evaluation == ample.evaluate(Partitioner(graph).partition(result.best))
    # ZeRO was priced, under the highest stage and then the lowest, which costs no more
    # (stage 3 gathers each weight twice more), and no plan under it was ZERO_GAIN faster
    assert {stage for _, stage, _ in result.zero_tried} == {
        ZeroStage.OPTIMIZER,
        ZeroStage.PARAMETERS,
    }
    fastest = min(ev.step_time_s for _, _, ev in result.zero_tried)
    assert fastest >= result.evaluation.step_time_s * (1 - ZERO_GAIN)
    off = mcmc(
        graph, space, ample, SearchOptions(budget_s=60, seed=0, max_evals=200, zero_stages=())
    )
    assert off.zero_tried == () and off.best == result.best


def test_plan_writes_and_reports_the_stage_the_search_chose(case, tmp_path: Path, capsys) -> None:
    path, _, _, peaks = case
    machine = tmp_path / "tight.yaml"
    machine.write_text(dump_machine(_machine(peaks[ZeroStage.GRADIENTS])))
    out = tmp_path / "plan.json"
    argv = ["plan", str(path), "--machine", str(machine), "--batch", str(BATCH)]
    argv += ["--optimizer", "adam", "--max-evals", "100", "-o", str(out), "--json"]
    assert cli(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    saved = json.loads(out.read_text())
    assert doc["zero_stage"] == saved["zero_stage"] in (1, 2)
    assert max(saved["predicted"]["peak_memory_bytes"]) <= peaks[ZeroStage.GRADIENTS]
    assert cli(["simulate", str(out), "--optimizer", "adam", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["zero_stage"] == saved["zero_stage"]
    assert again["peak_memory_bytes"] == saved["predicted"]["peak_memory_bytes"]


def test_only_plans_that_zero_could_bring_within_memory_are_priced(case) -> None:
    """What ZeRO-2 shards with Adam (two arrays of state and the gradient, all but the
    device's quarter of W's rows) bounds what it saves."""
    _, graph, space, peaks = case
    dp = by_rule(Rule.DATA_PARALLEL, graph, space, 4)
    weight = 8 * 1024 * 4  # W [8, 1024] in float32
    saved = 3 * weight * 3 // 4
    for memory, could in (
        (peaks[ZeroStage.GRADIENTS], True),
        (peaks[ZeroStage.NONE] - saved, True),
        (peaks[ZeroStage.NONE] - saved - 1, False),
    ):
        sim = make_simulator(_machine(memory), RooflineCost(), ADAM)
        search = _Search(graph, space, sim, SearchOptions())
        assert _could_fit(search, dp, ZeroStage.GRADIENTS, sim) is could, memory
        # stage 1 shards only the state: a third less
        assert _could_fit(search, dp, ZeroStage.OPTIMIZER, sim) is (
            memory >= peaks[ZeroStage.NONE] - 2 * weight * 3 // 4
        )


def test_zero3_but_on_the_first_groups_of_layers(tmp_path: Path) -> None:
    """A plan that fits under ZeRO-3 but not ZeRO-2 keeps its first groups of layers at
    ZeRO-2 where that fits and is faster (their gathers start each forward: nothing
    hides them), the rest at ZeRO-3 (``zero_layers.py``): an MLP of eight layers, data
    parallel on 4 devices with Adam, in the memory of the first four at ZeRO-2. Every
    count priced by brute force: four is the fastest that fits, and faster than ZeRO-3
    on all."""
    from benchmarks.sparse_mlp import write_sparse_mlp
    from onnx2soap.importer import load_model
    from onnx2soap.search.mcmc import _with_zero
    from onnx2soap.search.zero_layers import layer_groups
    from onnx2soap.soap.zero import ZERO_STAGES, Zero

    mlp = write_sparse_mlp(tmp_path, 8, 256)
    graph = load_model(mlp.model, 8).graph
    space = analyze(graph)
    dp = by_rule(Rule.DATA_PARALLEL, graph, space, 4)
    pg = Partitioner(graph).partition(dp)
    weights = [f"w{i}" for i in range(8)]
    assert layer_groups(graph, space).weights == tuple((w,) for w in weights)

    def priced(zero, memory=1 << 30):
        return make_simulator(_machine(memory), RooflineCost(), ADAM, zero=zero).evaluate(pg)

    def kept(k: int) -> Zero:
        return Zero.mixed(ZeroStage.PARAMETERS, dict.fromkeys(weights[:k], ZeroStage.GRADIENTS))

    memory = max(priced(kept(4)).peak_memory_bytes)
    evaluations = {k: priced(kept(k), memory) for k in range(9)}
    fitting = [k for k, ev in evaluations.items() if ev.fits]
    assert fitting == list(range(5))  # 8: all at ZeRO-2, which does not fit
    fastest = min(fitting, key=lambda k: evaluations[k].step_time_s)
    assert fastest == 4
    sim = make_simulator(_machine(memory), RooflineCost(), ADAM)
    search = _Search(graph, space, sim, SearchOptions())
    search.consider(dp, search.cost(search.evaluate(dp)))
    assert not search.best_cost.fits
    zeroed = _with_zero(search, sim, {dp: "data-parallel"}, ZERO_STAGES)
    assert zeroed.strategy == dp and zeroed.stage is ZeroStage.PARAMETERS
    assert Zero(zeroed.stage, zeroed.weights) == kept(4)
    assert zeroed.evaluation == evaluations[4]
    assert zeroed.evaluation.step_time_s < evaluations[0].step_time_s  # ZeRO-3 on all
    assert any("ZeRO-3, 4 weights ZeRO-2" in name for name, _, _ in zeroed.tried)


def test_the_layers_kept_double_until_one_does_not_fit_or_time_is_out() -> None:
    """``fastest_layered`` over 5 groups: 1, 2, 4 and then all at the lower stage,
    stopping at the first that does not fit or past its deadline, the fastest that fits
    kept; an evaluation made up by hand for each count."""
    from onnx2soap.search.zero_layers import LayerGroups, fastest_layered
    from onnx2soap.sim import Evaluation

    groups = LayerGroups(tuple((f"w{i}",) for i in range(5)))
    assert groups.counts() == [1, 2, 4, 5] and groups.counts(every=False) == [1, 2, 4]
    high, low = ZeroStage.PARAMETERS, ZeroStage.GRADIENTS
    assert groups.zero(5, high, low).weights == () and groups.zero(5, high, low).stage is low
    step = {1: 3.0, 2: 2.0, 4: 2.5, 5: 1.0}  # seconds by groups kept

    def run(fits_up_to: int, deadline: float = float("inf")):
        priced = []

        def price(zero):
            kept = 5 if not zero.weights else len(zero.weights)
            priced.append(kept)
            return Evaluation(step[kept], (0,), 0, kept <= fits_up_to)

        found = fastest_layered(groups, high, low, price, deadline)
        return (None if found is None else found.kept), priced

    assert run(5) == (5, [1, 2, 4, 5])
    assert run(4) == (2, [1, 2, 4, 5])  # all does not fit: the fastest before it
    assert run(1) == (1, [1, 2])
    assert run(0) == (None, [1])
    assert run(5, deadline=0.0) == (1, [1])  # past the deadline: only the first
