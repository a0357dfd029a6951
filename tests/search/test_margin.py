"""The machine's margin (``Machine.margin``, ``search/margin.py``): among plans predicted
within it of the fastest, the search keeps the one that moves the fewest bytes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from onnx2soap.cli import main as cli
from onnx2soap.importer import load_model
from onnx2soap.search.margin import steadiest
from onnx2soap.search.mcmc import SearchOptions, mcmc
from onnx2soap.sim import Evaluation, RooflineCost, Simulator
from onnx2soap.sim.presets import preset
from onnx2soap.soap import analyze

CONTENDERS = {
    "found": Evaluation(1.00, (1,), 1000, True),  # the fastest, the most bytes
    "dp": Evaluation(1.05, (1,), 400, True),
    "single": Evaluation(1.09, (1,), 0, True),
    "alone": Evaluation(1.08, (1,), 0, True),  # as few bytes, a little faster
    "far": Evaluation(1.20, (1,), 0, True),
    "overflows": Evaluation(1.01, (1,), 0, False),
}


@pytest.mark.parametrize(
    ("margin", "kept"),
    [
        (0.0, "found"),  # every difference trusted: the fastest
        (0.06, "dp"),  # the only one within 6 % (1.01's overflows)
        (0.1, "alone"),  # 0 bytes within 10 %: the faster of the two
        (0.5, "alone"),  # far moves 0 bytes too but is slower
    ],
)
def test_the_fewest_bytes_within_the_margin(margin: float, kept: str) -> None:
    assert steadiest("found", CONTENDERS, margin) == kept


def test_a_plan_that_overflows_is_never_traded_for_noise() -> None:
    over = {**CONTENDERS, "found": Evaluation(1.0, (1,), 1000, False)}
    assert steadiest("found", over, 0.5) == "found"


def _search(example: Path, margin: float):
    graph = load_model(example, 32).graph
    machine = replace(preset("cpu:2"), margin=margin)
    options = SearchOptions(budget_s=30.0, seed=0, max_evals=100)
    return mcmc(graph, analyze(graph), Simulator(machine, RooflineCost()), options)


def test_the_search_keeps_the_start_moving_fewest_bytes_within_the_margin(
    example_onnx: Path,
) -> None:
    trusting = _search(example_onnx, 0.0)
    assert trusting.passed_over is None
    for margin in (0.5, 0.95):
        r = _search(example_onnx, margin)
        bound = trusting.evaluation.step_time_s * (1 + margin)
        close = [e for e in r.starts.values() if e.fits and e.step_time_s <= bound]
        fewest = min(e.bytes_moved for e in close)
        if fewest >= trusting.evaluation.bytes_moved:
            # no start within the margin moves fewer bytes: the walk's plan stands
            assert r.passed_over is None and r.evaluation == trusting.evaluation
            continue
        # the same walk: what it passed over is the plan it returns without a margin
        assert r.passed_over == trusting.evaluation
        assert r.evaluation.bytes_moved == fewest
        assert r.evaluation == r.starts[r.best_from]
    # single device is 1.8x the fastest on cpu:2: inside a 95 % margin, not a 50 % one
    assert _search(example_onnx, 0.95).best_from == "single-device"
    assert _search(example_onnx, 0.5).best_from != "single-device"
    assert _search(example_onnx, 0.5).evaluation.bytes_moved > 0


def test_plan_reports_the_margin_and_what_it_passed_over(
    example_onnx: Path, tmp_path: Path, capsys
) -> None:
    args = ["plan", str(example_onnx), "--batch", "32", "--machine", "cpu:2", "--max-evals", "100"]
    out = tmp_path / "plan.json"
    assert cli([*args, "--margin", "0.95", "-o", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["margin"]["fraction"] == 0.95 and doc["margin"]["kept"] == "single-device"
    assert doc["margin"]["passed_over"]["bytes_moved"] > 0
    plan = json.loads(out.read_text())
    assert {tuple(op["devices"]) for op in plan["ops"]} == {(0,)}
    assert plan["predicted"]["step_time_s"] == doc["baselines"]["single-device"]
    assert cli([*args, "--margin", "0.95", "-o", str(out), "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "margin: kept single-device (0.00 MiB moved a step)" in said
    assert cli([*args, "-o", str(out), "--json"]) == 0  # the preset's margin: 0
    assert json.loads(capsys.readouterr().out)["margin"] == {
        "fraction": 0.0,
        "kept": None,
        "passed_over": None,
    }


def test_a_margin_of_a_whole_step_is_refused(example_onnx: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert cli(["plan", str(example_onnx), "--batch", "8", "--margin", "1", "-o", str(out)]) == 2
    assert "--margin" in capsys.readouterr().err
    assert not out.exists()
