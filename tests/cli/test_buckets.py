"""``plan --bucket-mb``: the plan's gradient buckets (soap/buckets.py), priced and written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onnx2soap.cli import main as cli
from onnx2soap.importer import load_model
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.presets import cpu
from onnx2soap.soap import Partitioner, analyze, load_plan

PLAN = ["--batch", "8", "--devices", "2", "--strategy", "data-parallel", "--quiet"]


def test_the_bucket_size_is_priced_and_written(example_onnx: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    assert cli(["plan", str(example_onnx), *PLAN, "--bucket-mb", "0.002", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["bucket_mb"] == 0.002
    plan = load_plan(out)
    graph = load_model(example_onnx, 8).graph
    pg = Partitioner(graph).partition(plan.strategy(graph, analyze(graph)))
    step = Simulator(cpu(2), RooflineCost(), bucket_mb=0.002).evaluate(pg).step_time_s
    assert doc["predicted"]["step_time_s"] == step
    default = Simulator(cpu(2), RooflineCost()).evaluate(pg).step_time_s
    assert step != default  # four buckets, not one
    assert cli(["plan", str(example_onnx), *PLAN, "-o", str(out)]) == 0
    assert "bucket_mb" not in json.loads(out.read_text())


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_bad_bucket_size_is_refused_in_one_line(example_onnx, tmp_path, capsys, value) -> None:
    out = tmp_path / "p.json"
    assert cli(["plan", str(example_onnx), *PLAN, "--bucket-mb", value, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("onnx2soap: error: --bucket-mb:"), err
    assert not out.exists()
