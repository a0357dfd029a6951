"""MCMC search: finds the brute-force optimum, is reproducible, never exceeds memory."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import product
from pathlib import Path

import pytest

from onnx2soap.cli import main as cli
from onnx2soap.cli.plan_cmd import _walk_line, draw_progress
from onnx2soap.errors import UserError
from onnx2soap.importer import load_model
from onnx2soap.search import mcmc as mcmc_module
from onnx2soap.search.baselines import BASELINES, Rule, by_rule, narrow_data_parallel
from onnx2soap.search.exhaustive import exhaustive, space_size
from onnx2soap.search.mcmc import Progress, SearchOptions, SearchResult, _rule_strategies, mcmc
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.machine import ComputeDevice
from onnx2soap.sim.memory import peak_memory
from onnx2soap.sim.presets import cpu, preset
from onnx2soap.soap import Partitioner, Strategy, analyze, candidates
from onnx2soap.soap.zero import ZeroStage
from tests.sim.tiny import tiny_graph


def hybrid_case(tmp_path: Path):
    """x [16, 8] -> Gemm(W [8, 1024]) -> Relu -> cross-entropy on 4 devices whose links
    make a split optimal that no start strategy is (the best, the expert's, is 1.08x; the
    ILP's additive cost finds the optimum of the former case, x [32, 8] and W [8, 256])."""
    graph = tiny_graph(tmp_path, batch=16, hidden=1024, relu=True)
    device = ComputeDevice("dev", 1e9, 1e10, 1 << 30, 1e-6)
    machine = replace(cpu(4, device, 1e8, 1e-6), transfers_use_compute=False)
    return graph, analyze(graph), Simulator(machine, RooflineCost())


def test_mcmc_finds_the_brute_force_optimum_for_most_seeds(tmp_path: Path) -> None:
    graph, space, sim = hybrid_case(tmp_path)
    optimum = exhaustive(graph, space, sim)
    partitioner = Partitioner(graph)
    # every rule's plan but random's and context parallelism's (the model reads no sequence)
    rules = [rule for rule in Rule if rule not in (Rule.RANDOM, Rule.CONTEXT)]
    starts = [by_rule(rule, graph, space, 4, 0, sim) for rule in rules]
    starts += narrow_data_parallel(graph, space, 4).values()
    for strategy in starts:
        start = sim.evaluate(partitioner.partition(strategy))
        assert start.step_time_s > optimum.evaluation.step_time_s * 1.01, strategy
    budget = 300
    assert budget < space_size(graph, space, 4) / 2
    found = 0
    for seed in range(10):
        result = mcmc(graph, space, sim, SearchOptions(budget_s=120, seed=seed, max_evals=budget))
        assert result.evaluated <= budget + 3
        assert result.evaluation.step_time_s >= optimum.evaluation.step_time_s - 1e-15
        found += result.evaluation.step_time_s == pytest.approx(
            optimum.evaluation.step_time_s, rel=1e-12
        )
    assert found >= 8


def test_same_seed_same_plan(example_onnx: Path) -> None:
    graph = load_model(example_onnx, batch=8).graph
    space = analyze(graph)
    sim = Simulator(preset("flexflow-p100:1"), RooflineCost())
    options = SearchOptions(budget_s=300, seed=7, max_evals=120)
    first, second = mcmc(graph, space, sim, options), mcmc(graph, space, sim, options)
    assert first.best == second.best
    assert first.evaluated == second.evaluated


def test_search_that_stops_on_max_evals_is_reproducible(tmp_path: Path) -> None:
    graph, space, sim = hybrid_case(tmp_path)
    options = SearchOptions(budget_s=300, seed=3, max_evals=500)
    first, second = mcmc(graph, space, sim, options), mcmc(graph, space, sim, options)
    assert first.best == second.best and first.evaluated == second.evaluated
    assert first.time_s < 150  # ended on the evaluation count, not the clock


def test_a_plan_never_exceeds_device_memory(tmp_path: Path) -> None:
    graph = tiny_graph(tmp_path, batch=4, hidden=1024, relu=True)  # weight-heavy
    space = analyze(graph)
    partitioner = Partitioner(graph)
    names = [op.name for op in graph.ops]
    peaks = [
        max(peak_memory(partitioner.partition(Strategy(4, dict(zip(names, c, strict=True)))), 4))
        for c in product(*(candidates(space[n], 4) for n in names))
    ]
    dp = max(peak_memory(partitioner.partition(by_rule(Rule.DATA_PARALLEL, graph, space, 4)), 4))
    assert min(peaks) < dp
    # Data parallelism just does not fit; the 22 of the 1,232 plans (reduction splits
    # counted) that need less do. A limit only 4 of them meet had left a 300-proposal
    # search to luck.
    limit = dp - 1
    device = ComputeDevice("dev", 1e9, 1e10, limit, 1e-6)
    tight = Simulator(cpu(4, device, 1e9, 1e-6), RooflineCost())
    result = mcmc(graph, space, tight, SearchOptions(budget_s=60, seed=0, max_evals=300))
    assert result.evaluation.fits and max(result.evaluation.peak_memory_bytes) <= limit
    assert not result.baselines["data-parallel"].fits

    device = ComputeDevice("dev", 1e9, 1e10, min(peaks) - 1, 1e-6)
    nothing_fits = Simulator(cpu(4, device, 1e9, 1e-6), RooflineCost())
    with pytest.raises(UserError, match="fits in device memory"):
        mcmc(graph, space, nothing_fits, SearchOptions(budget_s=60, seed=0, max_evals=50))


def test_plan_cli_json(example_onnx: Path, tmp_path: Path, capsys) -> None:
    plan = tmp_path / "plan.json"
    args = ["plan", str(example_onnx), "--machine", "flexflow-p100:1", "--batch", "8"]
    code = cli([*args, "--budget", "60", "--max-evals", "60", "-o", str(plan), "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {
        "plan",
        "predicted_step_time_s",
        "baselines",
        "infeasible_baselines",
        "evaluated",
        "search_time_s",
        "costs",
        "precision",
        "zero_stage",
        "zero_stages",
        "ilp",
        "best_start",
        "walk_gain",
        "walks",
        "pipeline_tried",
        "pipeline_chosen",
        "pipeline_s",
        "pipeline_skipped",
        "pipeline_walk",
        "margin",
        "start",
    }
    assert doc["start"] is None  # no --start: no annotated or JSON plan to keep
    assert doc["pipeline_tried"] and doc["pipeline_s"] >= 0  # 4 devices: pipelines priced
    baselines = {"data-parallel", "expert", "single-device", "model-parallel", "megatron", "ilp"}
    # the search may return a pipeline or ZeRO: compared with both rules' plans too
    assert doc["plan"] == str(plan) and set(doc["baselines"]) == baselines | {"pipeline", "zero"}
    assert 0 < doc["predicted_step_time_s"] <= min(doc["baselines"].values())
    assert 0 < doc["evaluated"] <= 63
    saved = json.loads(plan.read_text())
    assert saved["predicted"]["step_time_s"] == doc["predicted_step_time_s"]
    assert saved["search"]["method"] == "mcmc" and saved["machine"] == "flexflow-p100:1"
    # The best start is the fastest of the walks' starts that fit, and the gain is its
    # step time over the plan's; every start is walked (or named beside one it equals).
    walks, start = doc["walks"], doc["best_start"]
    names = [n for w in walks for n in (w["start"], *w["also"])]
    assert sorted(names) == sorted({*baselines, "data-parallel:2"})
    fitting = [w for w in walks if w["start_fits"]]
    assert start == {"name": fitting[0]["start"], "step_time_s": fitting[0]["start_step_time_s"]}
    assert start["step_time_s"] == min(w["start_step_time_s"] for w in fitting)
    if start["name"] in doc["baselines"]:
        assert doc["baselines"][start["name"]] == start["step_time_s"]
    assert doc["walk_gain"] == pytest.approx(start["step_time_s"] / doc["predicted_step_time_s"])
    assert doc["walk_gain"] >= 1.0
    best = min(w["best_step_time_s"] for w in fitting)
    assert best == pytest.approx(doc["predicted_step_time_s"], rel=1e-12)
    assert sum(w["proposals"] for w in walks) <= 60


def test_plan_says_what_the_walk_added_in_one_line(example_onnx: Path, tmp_path: Path, capsys):
    args = ["plan", str(example_onnx), "--machine", "flexflow-p100:4", "--batch", "64"]
    # a gradient bucket an op: each op's ring overlaps the rest of the backward (in the
    # default 25 MiB the whole model is one bucket, summed after it, which the walk beats)
    args += ["--bucket-mb", "0.0001"]
    assert cli([*args, "--max-evals", "40", "-o", str(tmp_path / "p.json"), "--quiet"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("walk:")]
    # the example CNN on 16 P100s: 4-way data parallelism, which 40 proposals do not beat
    assert lines == [
        "  walk: data-parallel:4 (253.1 us) is the best start; the walk found nothing faster"
    ]


def test_the_walk_s_line_gives_its_gain_where_it_found_one(tmp_path: Path) -> None:
    graph, space, sim = hybrid_case(tmp_path)
    result = mcmc(graph, space, sim, SearchOptions(budget_s=120, seed=0, max_evals=300))
    start = result.starts[result.best_start].step_time_s
    gain = start / result.evaluation.step_time_s
    assert result.walk_gain == gain and gain > 1.05  # the optimum is no start (above)
    line = _walk_line(result)
    assert line.startswith(f"  walk: from {result.best_start} (") and f"{gain:.2f}x in" in line


def test_progress_is_reported_and_drawn(tmp_path: Path, capsys) -> None:
    graph, space, sim = hybrid_case(tmp_path)
    seen: list[Progress] = []
    mcmc(graph, space, sim, SearchOptions(budget_s=0.6, seed=0), seen.append)
    assert seen and all(0 <= p.elapsed_s <= 0.7 and p.evaluated > 0 for p in seen)
    assert [p.evaluated for p in seen] == sorted(p.evaluated for p in seen)
    draw_progress(Progress(elapsed_s=3.0, budget_s=12.0, evaluated=321, best_step_time_s=2e-3))
    bar = capsys.readouterr().err
    assert bar.startswith("\r[#######.......................]") and "321 simulated" in bar
    assert "best 2.000 ms" in bar


@pytest.mark.parametrize("machine", ["flexflow-p100:4", "flexflow-p100:8"])
def test_the_search_is_never_slower_than_any_rule_it_could_have_returned(
    example_onnx: Path, machine: str
) -> None:
    """Even stopped after a handful of proposals, the result is at least as fast as data
    parallelism, expert, model parallelism and a single device."""
    graph = load_model(example_onnx, 32).graph
    space = analyze(graph)
    sim = Simulator(preset(machine), RooflineCost())
    result = mcmc(graph, space, sim, SearchOptions(budget_s=60, seed=0, max_evals=6))
    partitioner = Partitioner(graph)
    for rule in (Rule.DATA_PARALLEL, Rule.EXPERT, Rule.MODEL_PARALLEL, Rule.SINGLE_DEVICE):
        strategy = by_rule(rule, graph, space, sim.machine.size)
        baseline = sim.evaluate(partitioner.partition(strategy))
        assert result.evaluation.step_time_s <= baseline.step_time_s * (1 + 1e-12), rule


def test_narrow_data_parallel_splits_samples_over_the_first_k_devices(tmp_path: Path) -> None:
    graph = tiny_graph(tmp_path, batch=32, hidden=16, relu=True)
    space = analyze(graph)
    named = narrow_data_parallel(graph, space, 8)
    assert list(named) == ["data-parallel:2", "data-parallel:4"]
    for name, strategy in named.items():
        k = int(name.split(":")[1])
        for op in graph.ops:
            config = strategy[op.name]
            sample = next(i for i, d in enumerate(space[op.name]) if d.kind.value == "sample")
            assert config.devices == tuple(range(k))
            assert config.degrees[sample] == k
            assert all(d == 1 for i, d in enumerate(config.degrees) if i != sample)


def test_the_result_names_its_starts_and_its_history_honestly(example_onnx: Path) -> None:
    """On 64 devices the search also starts from data parallelism over 2..32 devices; the
    result is never slower than any start (each simulated here afresh), says which start
    its best is (or "search"), and its history begins at the best start, at 0 s."""
    graph = load_model(example_onnx, 32).graph
    space = analyze(graph)
    sim = Simulator(preset("flexflow-p100:16"), RooflineCost())
    result = mcmc(graph, space, sim, SearchOptions(budget_s=120, seed=1, max_evals=30))
    names = [r.value for r in BASELINES]  # ZeRO's strategy is data parallelism's
    assert set(result.starts) == {*names, *(f"data-parallel:{k}" for k in (2, 4, 8, 16, 32))}
    assert set(result.baselines) == set(names)
    partitioner = Partitioner(graph)
    strategies = {r.value: by_rule(r, graph, space, 64, 0, sim) for r in BASELINES}
    strategies.update(narrow_data_parallel(graph, space, 64))
    fresh = {n: sim.evaluate(partitioner.partition(s)) for n, s in strategies.items()}
    assert fresh == dict(result.starts)
    best_start = min(ev.step_time_s for ev in fresh.values() if ev.fits)
    assert result.evaluation.step_time_s <= best_start
    assert fresh[result.best_start].step_time_s == best_start
    if result.best_from == "search":
        assert result.evaluation.step_time_s < best_start
        assert all(result.best != s for s in strategies.values())
    else:
        assert result.best == strategies[result.best_from]
    first, *rest = result.history
    assert (first.after_s, first.proposals, first.step_time_s) == (0.0, 0, best_start)
    costs = [h.step_time_s for h in result.history]
    assert costs == sorted(costs, reverse=True) and len(set(costs)) == len(costs)
    if result.zero_stage is ZeroStage.NONE:
        assert costs[-1] == result.evaluation.step_time_s
    else:  # priced under ZeRO after the walk, only where faster (its rings overlap the
        # backward, where the model's one gradient bucket is summed after it)
        assert result.evaluation.step_time_s < costs[-1]
    assert all(0 < h.proposals <= result.proposals for h in rest)
    assert 0 < result.setup_s <= result.time_s and result.proposals <= 30 + 2


def test_the_setup_counts_in_the_budget(example_onnx: Path) -> None:
    """The budget begins at the call: the setup (every start built and simulated, the
    ILP's solve) counts in it and the walk has what is left, none where the setup took
    it all (planning a LLaMA-3-8B shape with ``--budget 50`` had taken 103 s)."""
    graph = load_model(example_onnx, batch=64).graph
    sim = Simulator(preset("flexflow-p100:4"), RooflineCost())  # 16 devices
    space = analyze(graph)
    short = mcmc(graph, space, sim, SearchOptions(budget_s=0.01, seed=0))
    assert short.setup_s > 0.01 and short.proposals == 0
    # past the budget no start's simulation is begun: the smallest alone was
    named, _ = _rule_strategies(graph, space, sim, SearchOptions())
    partitioner = Partitioner(graph)

    def size(strategy: Strategy) -> int:
        pg = partitioner.partition(strategy)
        return sum(len(t) for t in pg.tasks.values()) + sum(len(e.overlaps) for e in pg.edges)

    # one strategy simulated (under every name that built it: the ILP's, at times), the
    # smallest (the ILP's, solved under another time limit here, aside)
    assert sorted([*short.starts, *short.skipped]) == sorted(named)
    first, *others = short.starts.values()
    assert all(ev == first for ev in others) and short.baselines.keys() <= short.starts.keys()
    assert size(short.best) <= min(size(s) for n, s in named.items() if n != Rule.ILP.value)
    budget = 4.0  # room for every start (about a second under load) and a walk
    result = mcmc(graph, space, sim, SearchOptions(budget_s=budget, seed=0))
    assert sorted(result.starts) == sorted(named) and result.proposals > 0
    walked_until = result.time_s - result.zero_s  # from the call to the walk's end
    # the last round stops on a stall after half of what it had, at the least
    assert result.setup_s + (budget - result.setup_s) * 0.2 <= walked_until <= budget * 1.1


def test_starts_past_the_size_bound_are_not_simulated(example_onnx: Path, monkeypatch) -> None:
    """Starts are simulated smallest first while what they hold together (tasks plus tile
    overlaps) stays within ``MAX_STARTS_SIZE``: past it, the rest are skipped, whatever
    the budget, and the walk goes from those simulated."""
    graph = load_model(example_onnx, batch=64).graph
    space = analyze(graph)
    sim = Simulator(preset("flexflow-p100:4"), RooflineCost())
    named, _ = _rule_strategies(graph, space, sim, SearchOptions())
    partitioner = Partitioner(graph)

    def size(strategy: Strategy) -> int:
        pg = partitioner.partition(strategy)
        return sum(len(t) for t in pg.tasks.values()) + sum(len(e.overlaps) for e in pg.edges)

    sizes = sorted({size(s) for n, s in named.items() if n != Rule.ILP.value})
    monkeypatch.setattr(mcmc_module, "MAX_STARTS_SIZE", sizes[0] + sizes[1] - 1)
    result = mcmc(graph, space, sim, SearchOptions(budget_s=120, seed=0, max_evals=20))
    kept = {named[n] for n in result.starts if n != Rule.ILP.value}
    assert {size(s) for s in kept} == {sizes[0]} and result.skipped and result.proposals > 0
    assert sorted([*result.starts, *result.skipped]) == sorted(named)


def test_letting_go_of_the_memo_changes_no_step(example_onnx: Path, monkeypatch) -> None:
    """The walk lets go of its memoized segments past a bound (``_Evaluator.bound``); a
    chain's state holds its own, so the walk from it, forgetting after every sweep,
    proposes, prices and keeps exactly what it does with the memo whole."""
    graph = load_model(example_onnx, batch=64).graph
    space = analyze(graph)
    options = SearchOptions(budget_s=300, seed=4, max_evals=60)

    def search() -> SearchResult:
        return mcmc(graph, space, Simulator(preset("flexflow-p100:4"), RooflineCost()), options)

    whole = search()
    forgot = []
    forget = mcmc_module._Evaluator.forget

    def counted(self) -> None:
        forgot.append(self.memoized())
        forget(self)

    monkeypatch.setattr(mcmc_module._Evaluator, "forget", counted)
    monkeypatch.setattr(
        mcmc_module._Evaluator, "bound", lambda self: setattr(self, "_allowance", 0)
    )
    trimmed = search()
    assert len([n for n in forgot if n]) > 10  # after (nearly) every sweep that built any
    assert (trimmed.best, trimmed.evaluation) == (whole.best, whole.evaluation)
    assert [(h.proposals, h.step_time_s) for h in trimmed.history] == [
        (h.proposals, h.step_time_s) for h in whole.history
    ]
    assert (trimmed.proposals, trimmed.walks) == (whole.proposals, whole.walks)


def test_starts_are_simulated_exactly(example_onnx: Path) -> None:
    """Every start's evaluation is its own full simulation's, on a simulator of its own."""
    graph = load_model(example_onnx, batch=64).graph
    space = analyze(graph)
    sim = Simulator(preset("flexflow-p100:2"), RooflineCost())
    result = mcmc(graph, space, sim, SearchOptions(budget_s=60, seed=0, max_evals=5))
    named, _ = _rule_strategies(graph, space, sim, SearchOptions())
    partitioner = Partitioner(graph)
    fresh = Simulator(preset("flexflow-p100:2"), RooflineCost())
    for name, strategy in named.items():
        assert result.starts[name] == fresh.evaluate(partitioner.partition(strategy)), name
