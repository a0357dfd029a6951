"""`onnx2soap plan` by rule and `onnx2soap simulate`: figures, trace, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onnx2soap.cli import main as cli

BATCH = "8"


@pytest.fixture
def plan(tmp_path: Path, example_onnx: Path) -> Path:
    model = tmp_path / "cnn.onnx"
    shutil.copy(example_onnx, model)
    out = tmp_path / "plan.json"
    args = ["plan", str(model), "--batch", BATCH, "--devices", "4", "--strategy", "expert"]
    assert cli([*args, "-o", str(out)]) == 0
    return out


def test_plan_by_rule_records_its_prediction(plan: Path, capsys) -> None:
    doc = json.loads(plan.read_text())
    assert doc["machine"] == "cpu:4" and doc["devices"] == 4 and doc["search"] is None
    assert set(doc["predicted"]["baselines"]) == {
        "data-parallel",
        "expert",
        "single-device",
        "model-parallel",
        "megatron",
        "ilp",
        "zero",  # ZeRO-2 data parallelism
        "pipeline",  # the pipeline rule's default shape: 2 stages of 2 devices
    }
    assert doc["predicted"]["step_time_s"] == doc["predicted"]["baselines"]["expert"]
    fc = next(o for o in doc["ops"] if o["name"] == "/fc1/Gemm")
    assert fc["degrees"] == {"co": 4}  # the expert splits fully connected layers' outputs


def test_simulate_json_and_trace(plan: Path, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    trace = tmp_path / "trace.json"
    assert cli(["simulate", str(plan), "--json", "--trace", str(trace)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"step_time_s", "peak_memory_bytes", "bytes_moved"} <= set(doc)
    assert doc["step_time_s"] == pytest.approx(
        json.loads(plan.read_text())["predicted"]["step_time_s"]
    )
    assert len(doc["peak_memory_bytes"]) == 4 and all(m > 0 for m in doc["peak_memory_bytes"])
    assert doc["bytes_moved"] > 0
    events = json.loads(trace.read_text())
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in spans} >= {"forward", "backward", "transfer", "update"}
    end = max(e["ts"] + e["dur"] for e in spans)
    assert end == pytest.approx(doc["step_time_s"] * 1e6, rel=1e-6)


def test_simulate_on_another_machine(plan: Path, capsys) -> None:
    capsys.readouterr()
    assert cli(["simulate", str(plan), "--machine", "flexflow-p100:1", "--json"]) == 0
    p100 = json.loads(capsys.readouterr().out)["step_time_s"]
    assert cli(["simulate", str(plan), "--json"]) == 0
    assert p100 < json.loads(capsys.readouterr().out)["step_time_s"]  # GPUs beat CPU ranks


def test_simulate_refusals(plan: Path, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    assert cli(["simulate", str(plan), "--machine", "cpu:2"]) == 2
    assert "4 devices" in capsys.readouterr().err
    (tmp_path / "cnn.onnx").write_bytes(b"not the model")
    assert cli(["simulate", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sha256" in err


def test_plan_refusals(example_onnx: Path, tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "p.json")
    base = ["plan", str(example_onnx), "--batch", BATCH, "-o", out]
    for args, fragment in [
        ([], "--machine"),
        (["--devices", "0"], "--devices"),
        (["--devices", "2", "--machine", "cpu:4"], "disagrees"),
        (["--devices", "2", "--strategy", "random", "--search", "mcmc"], "--strategy"),
        (["--machine", "nowhere.yaml"], "no such machine file"),
        (["--devices", "2", "--loss", "none"], "no loss"),
    ]:
        assert cli([*base, *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err, (args, err)
    assert not Path(out).exists()
