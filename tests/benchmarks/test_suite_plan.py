"""benchmarks/suite_plan.py on one small model (written with onnx.helper: no torch) and
one cell: the row is ``plan --json``'s (its step, no slower than any baseline that
fits), with the header's columns; a cell ``plan`` refuses shows its one line."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.suite import Cell
from benchmarks.suite_plan import HEADER, best_rule, main, plan_cell, returned, row


def _columns(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_one_cell(tmp_path: Path, capsys) -> None:
    argv = ["--models", "small_mlp", "--presets", "flexflow-p100", "--devices", "8"]
    assert main([*argv, "--budget", "2", "--work", str(tmp_path)]) == 0
    header, rule, line = capsys.readouterr().out.splitlines()
    assert header == HEADER and set(rule) == {"|", "-"}
    got = dict(zip(_columns(header), _columns(line), strict=True))
    assert got["model"] == "small_mlp" and got["batch"] == "128"
    doc = json.loads((tmp_path / "plans" / "small_mlp@flexflow-p100:8.out.json").read_text())
    assert Path(doc["plan"]).exists()
    feasible = [s for n, s in doc["baselines"].items() if n not in doc["infeasible_baselines"]]
    assert feasible and doc["predicted_step_time_s"] <= min(feasible)
    assert float(got["rule/plan"].strip("*×")) >= 1.0
    assert got["returns"] == returned(doc) and float(got["wall s"]) > 0


def test_a_cell_plan_refuses_shows_its_line() -> None:
    error = "onnx2soap: error: no plan fits (the closest, x); use a machine with more memory"
    doc = {"batch": 8, "wall_s": 3.0, "peak_rss": 1e9, "error": error}
    line = row(Cell("m", "alpa-v100", 8), doc)
    assert len(_columns(line)) == len(_columns(HEADER))
    assert _columns(line)[4] == "no plan fits (the closest, x)"


def test_the_best_rule_counts_the_pipeline_rule_and_recomputing_rules() -> None:
    def tried(stages: int, step: float, fits: bool, of: str | None, walked=False) -> dict:
        return {
            "stages": stages,
            "microbatches": 4,
            "schedule": "1f1b" if stages else None,
            "recompute": True,
            "zero_stage": 0,
            "of": of,
            "walked": walked,
            "step_time_s": step,
            "fits": fits,
        }

    doc = {
        "baselines": {"data-parallel": 1.0, "megatron": 2.0},
        "infeasible_baselines": ["data-parallel"],
        "pipeline_tried": [
            tried(0, 1.5, True, "megatron"),
            tried(2, 1.2, True, None),
            tried(2, 0.5, True, None, walked=True),  # the search's, no rule's
            tried(0, 0.4, True, "walk"),  # the walk's plan recomputing: no rule's
            tried(4, 0.3, False, None),  # does not fit
        ],
    }
    assert best_rule(doc) == ("pipeline 2×4 1f1b recomputing", 1.2)
    doc["pipeline_tried"] = doc["pipeline_tried"][:1]
    assert best_rule(doc) == ("megatron recomputing", 1.5)
    doc["pipeline_tried"], doc["infeasible_baselines"] = [], ["data-parallel", "megatron"]
    assert best_rule(doc) is None


def test_a_refusal_is_kept_whole(tmp_path: Path) -> None:
    """plan's one line, however long (a long path's): the table cuts it, not the run."""
    missing = tmp_path / ("m" * 170 + ".onnx")
    doc = plan_cell(Cell("small_mlp", "flexflow-p100", 8), missing, tmp_path, 1.0, "sgd")
    assert doc["error"].startswith("onnx2soap: error: ") and str(missing) in doc["error"]
