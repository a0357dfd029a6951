"""The Python API (onnx2soap/api.py, docs/api.md): the same plans and steps as the
command line's, typed results, the project's errors raised."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

import onnx2soap
from onnx2soap.cli import main
from onnx2soap.soap import load_plan

ROOT = Path(__file__).resolve().parents[1]
BATCH = 32
SEARCH = {"batch": BATCH, "budget": 60, "max_evals": 150, "seed": 3}


def test_plan_equals_the_command_lines(example_onnx: Path, tmp_path: Path, capsys) -> None:
    planned = onnx2soap.plan(example_onnx, machine="cpu:4", **SEARCH)
    out = tmp_path / "plan.json"
    args = ["plan", str(example_onnx), "--machine", "cpu:4", "--batch", str(BATCH)]
    search = ["--budget", "60", "--max-evals", "150", "--seed", "3"]
    assert main([*args, *search, "-o", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    written = load_plan(out)
    assert written.ops == planned.plan.ops
    assert written.predicted == planned.plan.predicted
    assert planned.method == "mcmc" and planned.machine == "cpu:4"
    assert planned.predicted.step_time_s == doc["predicted_step_time_s"]
    assert {k: b.step_time_s for k, b in planned.baselines.items()} == doc["baselines"]
    unfit = {k for k, b in planned.baselines.items() if not b.fits}
    assert unfit == set(doc["infeasible_baselines"])
    saved = planned.save(tmp_path / "api.json")
    assert load_plan(saved) == dataclasses.replace(written, model_path=load_plan(saved).model_path)


def test_plan_by_rule(example_onnx: Path) -> None:
    planned = onnx2soap.plan(example_onnx, devices=2, batch=BATCH, strategy="zero")
    assert planned.method == "zero" and planned.search_time_s == 0
    assert int(planned.plan.zero_stage) == 2 and planned.plan.devices == 2
    assert "zero" in planned.baselines  # the plan's own stage stands for it


def test_simulate_equals_the_command_lines(example_onnx: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "plan.json"
    onnx2soap.plan(example_onnx, machine="cpu:4", strategy="megatron", batch=BATCH).save(path)
    simulated = onnx2soap.simulate(path, optimizer="adam")
    assert main(["simulate", str(path), "--optimizer", "adam", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    step = simulated.step
    assert step.step_time_s == doc["step_time_s"]
    assert list(step.peak_memory_bytes) == doc["peak_memory_bytes"]
    assert (step.bytes_moved, step.fits) == (doc["bytes_moved"], doc["fits"])
    assert (simulated.machine, simulated.costs) == (doc["machine"], doc["costs"])
    # a Plan in memory prices as its file does; on another machine of its size too
    assert onnx2soap.simulate(load_plan(path), optimizer="adam") == simulated
    other = onnx2soap.simulate(path, machine="flexflow-p100:1")
    assert other.machine == "flexflow-p100:1" and other.step != simulated.step


def test_inspect_equals_the_command_lines(example_onnx: Path, capsys) -> None:
    inspected = onnx2soap.inspect(example_onnx, batch=BATCH)
    assert main(["inspect", str(example_onnx), "--batch", str(BATCH), "--json"]) == 0
    assert inspected.document() == json.loads(capsys.readouterr().out)
    assert (inspected.batch, inspected.loss) == (BATCH, "cross-entropy")
    conv = inspected.ops[0]
    assert conv.type == "Conv" and conv.output_shape[0] == BATCH and conv.params > 0
    assert {d.kind for d in conv.dims} >= {"sample", "parameter", "reduction"}
    assert inspected.flops == sum(o.flops for o in inspected.ops) > 0


def test_errors_are_the_projects(example_onnx: Path, tmp_path: Path) -> None:
    with pytest.raises(onnx2soap.MachineError, match="unknown machine 'nope:4'"):
        onnx2soap.plan(example_onnx, machine="nope:4", batch=BATCH)
    with pytest.raises(onnx2soap.UserError, match="strategy must be one of"):
        onnx2soap.plan(example_onnx, machine="cpu:2", strategy="fastest")
    with pytest.raises(onnx2soap.UserError, match="seed must be"):
        onnx2soap.plan(example_onnx, machine="cpu:2", seed=-1)
    with pytest.raises(onnx2soap.UserError, match="--recompute goes with --strategy"):
        onnx2soap.plan(example_onnx, machine="cpu:2", recompute="all")
    missing = tmp_path / "missing.onnx"
    with pytest.raises(onnx2soap.UserError, match=r"missing\.onnx"):
        onnx2soap.inspect(missing)
    with pytest.raises(AttributeError):
        _ = onnx2soap.no_such_name


def test_the_documented_example_runs(
    example_onnx: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    (block,) = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)
    (tmp_path / "examples").mkdir()
    shutil.copy(example_onnx, tmp_path / "examples" / "cnn.onnx")
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/api.md", "exec"), {})
    out = capsys.readouterr().out
    assert load_plan(tmp_path / "plan.json").devices == 4
    assert "unknown machine 'no-such-machine:4'" in out and "mcmc" in out
