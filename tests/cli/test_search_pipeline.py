"""The search's outer choice (issue 32): after the walk, pipelines built by the rule and
recomputation. Where no plain plan fits, the search returns one that does, ``validate``
accepts and ``simulate`` prices as ``plan`` said; the chosen plan is the best of the
shapes tried, each built and priced again one by one through ``plan --strategy
pipeline`` (or the walk inside pipelines', no slower); with ample memory the walk's
plan stands unless one is 1 % faster. The walk inside pipelines starts from the best
pipeline priced and ends no worse."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from onnx2soap.cli import main as cli
from onnx2soap.importer import load_model
from onnx2soap.sim import resolve_machine
from onnx2soap.sim.machine import dump_machine
from onnx2soap.soap import analyze, load_plan
from onnx2soap.soap.pipeline import check_pipeline_plan

BATCH = "32"  # activations enough that only a pipeline or recomputation fits a small machine
SEARCH = ("--max-evals", "300", "--seed", "0")


def _plan(capsys, model: Path, machine: str, out: Path, *extra: str) -> dict:
    capsys.readouterr()
    argv = ["plan", str(model), "--batch", BATCH, "--machine", machine, "-o", str(out)]
    assert cli([*argv, *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def searched(tmp_path_factory, example_onnx: Path) -> dict:
    """The example CNN searched on cpu:4 (ample memory), then on cpu:4 whose devices hold
    only the smallest peak among the pipelines and recomputing plans priced there."""
    folder = tmp_path_factory.mktemp("search-pipeline")
    return {"folder": folder, "model": example_onnx}


def _search(folder: Path, model: Path, machine: str, name: str, capsys) -> tuple[dict, Path]:
    out = folder / f"{name}.json"
    return _plan(capsys, model, machine, out, *SEARCH), out


def _small_machine(folder: Path, memory: int) -> Path:
    doc = yaml.safe_load(dump_machine(resolve_machine("cpu:4")))
    for device in doc["devices"]:
        device["memory"] = memory
    path = folder / "small.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _fitting(doc: dict) -> list[dict]:
    return [t for t in doc["pipeline_tried"] if t["fits"]]


def test_with_ample_memory_the_walk_stands_unless_one_percent_faster(searched, capsys) -> None:
    doc, plan = _search(searched["folder"], searched["model"], "cpu:4", "ample", capsys)
    assert doc["pipeline_tried"] and doc["pipeline_s"] >= 0
    fastest = min(t["step_time_s"] for t in _fitting(doc))
    # GPipe: priced once, at the fastest 1F1B shape of the rule's that fits (the walk
    # inside pipelines comes after it)
    gpipe = [t for t in doc["pipeline_tried"] if t["schedule"] == "gpipe"]
    rules = (
        t
        for t in _fitting(doc)
        if t["schedule"] == "1f1b" and not t["walked"] and t["stages"] > 1  # the grid's
    )
    top = min(rules, key=lambda t: t["step_time_s"])
    keys = ("stages", "microbatches", "recompute")
    assert len(gpipe) == 1 and all(gpipe[0][k] == top[k] for k in keys)
    saved = json.loads(plan.read_text())
    if doc["pipeline_chosen"] is None:  # the walk's plan: nothing tried was 1 % faster
        assert fastest >= doc["predicted_step_time_s"] * 0.99
        assert "pipeline" not in saved and "recompute" not in saved
    else:  # chosen: the fastest tried, 1 % faster than every walk's best
        assert doc["predicted_step_time_s"] == fastest
        walked = min(w["best_step_time_s"] for w in doc["walks"] if w["best_step_time_s"])
        assert fastest < walked * 0.99
    feasible = [t for n, t in doc["baselines"].items() if n not in doc["infeasible_baselines"]]
    assert {"pipeline", "zero"} <= set(doc["baselines"])
    _check_the_walk(doc)
    assert doc["predicted_step_time_s"] <= min(feasible)


def test_where_no_plain_plan_fits_a_pipeline_or_recomputation_does(searched, capsys) -> None:
    folder, model = searched["folder"], searched["model"]
    ample, _ = _search(folder, model, "cpu:4", "ample2", capsys)
    low = min(t["peak_memory_bytes"] for t in ample["pipeline_tried"])
    small = _small_machine(folder, low)
    doc, plan = _search(folder, model, str(small), "small", capsys)
    # the search's own account: no start fits and no walk found a plain plan that fits
    assert doc["best_start"] is None
    assert all(w["best_step_time_s"] is None for w in doc["walks"])
    assert set(doc["infeasible_baselines"]) >= {"data-parallel", "single-device", "megatron"}
    chosen = doc["pipeline_chosen"]
    assert chosen is not None
    fitting = _fitting(doc)
    assert doc["predicted_step_time_s"] == min(t["step_time_s"] for t in fitting)
    saved = json.loads(plan.read_text())
    assert ("pipeline" in saved) == (chosen["stages"] > 0)
    assert ("recompute" in saved) == chosen["recompute"]
    loaded = load_plan(plan)  # a valid plan for the model at its graph's batch
    graph = load_model(model, loaded.graph_batch).graph
    strategy = loaded.strategy(graph, analyze(graph))
    if loaded.pipeline:
        check_pipeline_plan(loaded.pipeline, graph, strategy.configs, loaded.devices)
    capsys.readouterr()
    assert cli(["simulate", str(plan), "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert math.isclose(priced["step_time_s"], doc["predicted_step_time_s"], rel_tol=1e-9)

    # every shape tried, built and priced again through the CLI's rule: the same figures
    # (the rule accepts each shape: exit 0), and the chosen one is the best that fits
    again = []
    for t in doc["pipeline_tried"]:
        if t["stages"] == 0 or t["walked"]:
            continue  # the walk's best recomputing, the walk inside pipelines: no rule's
        extra = ["--strategy", "pipeline", "--stages", str(t["stages"])]
        extra += ["--microbatches", str(t["microbatches"]), "--schedule", t["schedule"]]
        redo = ("selective" if t["selective"] else "all") if t["recompute"] else "none"
        extra += ["--recompute", redo]
        if t["zero_stage"]:  # gradient accumulation (one stage) under ZeRO
            extra += ["--zero-stage", str(t["zero_stage"])]
        rule = _plan(capsys, model, str(small), folder / "rule.json", *extra)
        rule_plan = json.loads((folder / "rule.json").read_text())
        step, peak = rule["predicted_step_time_s"], max(rule_plan["predicted"]["peak_memory_bytes"])
        if t["zero_stages"]:  # its first layers at another stage: the file edited so
            rule_plan["zero_stages"] = t["zero_stages"]
            (folder / "rule.json").write_text(json.dumps(rule_plan))
            assert cli(["simulate", str(folder / "rule.json"), "--json"]) == 0
            priced_again = json.loads(capsys.readouterr().out)
            step, peak = priced_again["step_time_s"], max(priced_again["peak_memory_bytes"])
        assert math.isclose(step, t["step_time_s"], rel_tol=1e-9)
        assert peak == t["peak_memory_bytes"] and (peak <= low) == t["fits"]
        again.append((step, peak <= low, t))
    best = min((s, t) for s, ok, t in again if ok) if any(ok for _, ok, _ in again) else None
    if chosen["stages"] > 0 and not chosen["walked"]:
        assert best is not None and best[0] == doc["predicted_step_time_s"]
        keys = ("stages", "microbatches", "schedule", "recompute", "zero_stage", "zero_stages")
        assert all(best[1][k] == chosen[k] for k in keys)
    elif chosen["walked"]:  # the walk's, from the best rule's pipeline: no slower
        assert best is None or doc["predicted_step_time_s"] <= best[0]
    _check_the_walk(doc)


def test_where_nothing_fits_the_refusal_names_the_nearest_plan_priced(searched, capsys) -> None:
    """Below every plan's peak: one line, exit 2, no plan file; the nearest it names is
    the nearest of everything priced, a pipeline's or a recomputing plan's where the
    walk's plain plans came no nearer (they need more than any pipeline priced)."""
    folder, model = searched["folder"], searched["model"]
    ample, _ = _search(folder, model, "cpu:4", "ample3", capsys)
    low = min(t["peak_memory_bytes"] for t in ample["pipeline_tried"])
    small = _small_machine(folder, low // 2)
    out = folder / "refused.json"
    capsys.readouterr()
    argv = ["plan", str(model), "--batch", BATCH, "--machine", str(small), "-o", str(out)]
    assert cli([*argv, *SEARCH]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()
    named = err.split("(the closest, ")[1]
    assert named.split(",")[0].endswith(("microbatches", "ops")), err
    amount, unit = named.split(" needs ")[1].split(" of ")[0].split()
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert low // 2 < float(amount) * scale <= low * 1.001


def _check_the_walk(doc: dict) -> None:
    """The walk inside pipelines starts from the best pipeline priced (the fastest that
    fits, else the least overflow) and ends no worse; its plan is among those tried
    where it moved."""
    walk = doc["pipeline_walk"]
    piped = [t for t in doc["pipeline_tried"] if t["stages"] > 0 and not t["walked"]]
    # the pipeline baseline is the rule's plan of its shape, never the walk's
    assert doc["baselines"]["pipeline"] in [t["step_time_s"] for t in piped]
    fitting = [t for t in piped if t["fits"]]
    if fitting:
        assert walk["start_fits"]
        assert walk["start_step_time_s"] == min(t["step_time_s"] for t in fitting)
    if walk["start_fits"]:
        assert walk["fits"] and walk["step_time_s"] <= walk["start_step_time_s"]
    walked = [t for t in doc["pipeline_tried"] if t["walked"]]
    assert len(walked) == (1 if walk["kept"] else 0)
    if walked:
        assert walked[0]["step_time_s"] == walk["step_time_s"]
        assert walked[0]["stages"] == len(walk["stages"])
        assert walked[0]["microbatches"] == walk["microbatches"]


def test_the_walk_line_says_where_its_start_does_not_fit() -> None:
    """A walk from a start that does not fit may end slower at one that does: the line
    marks each end that does not fit, so that 1.620 s -> 1.639 s does not read as a loss."""
    from types import SimpleNamespace

    from onnx2soap.cli.plan_cmd import _pipeline_walk_line
    from onnx2soap.sim import Evaluation
    from onnx2soap.soap.zero import ZeroStage

    def walk(start_fits: bool, best_fits: bool) -> SimpleNamespace:
        def at(step: float, fits: bool) -> SimpleNamespace:
            return SimpleNamespace(evaluation=Evaluation(step, (1,), 0, fits))

        layout = SimpleNamespace(degrees=(1, 2), microbatches=4, zero=ZeroStage.NONE)
        return SimpleNamespace(
            start=at(1.620, start_fits),
            best=at(1.639, best_fits),
            kept=(),
            priced=3,
            time_s=1.0,
            converged=True,
            layout=layout,
        )

    line = _pipeline_walk_line(walk(False, True))
    assert "1.620 s (does not fit) -> 1.639 s (" in line
    assert "tensor parallel per stage 1/2, 4 microbatches, ZeRO-0" in line
    assert "does not fit" not in _pipeline_walk_line(walk(True, True))
    assert _pipeline_walk_line(walk(False, False)).count("(does not fit)") == 2
