"""Every plan is compared with data parallel, expert, single device, model parallel, the
pipeline rule and ZeRO; a baseline that does not fit in device memory is marked so (in
the plan file, the JSON and the table) and the plan is never slower than a baseline that
fits."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from onnx2soap.cli import main
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import Rule, by_rule
from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
from onnx2soap.sim.machine import dump_machine
from onnx2soap.soap import Partitioner, analyze

BATCH = 32


def _peak(graph, rule: Rule, machine) -> int:
    pg = Partitioner(graph).partition(by_rule(rule, graph, analyze(graph), machine.size))
    return max(Simulator(machine, RooflineCost()).evaluate(pg).peak_memory_bytes)


def test_a_baseline_that_does_not_fit_is_marked(example_onnx: Path, tmp_path: Path, capsys):
    graph = load_model(example_onnx, BATCH).graph
    machine = resolve_machine("cpu:4")
    single, parallel = (
        _peak(graph, Rule.SINGLE_DEVICE, machine),
        _peak(graph, Rule.DATA_PARALLEL, machine),
    )
    assert parallel < single
    doc = yaml.safe_load(dump_machine(machine))
    for device in doc["devices"]:
        device["memory"] = (single + parallel) // 2  # data parallel fits, one device does not
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(doc))
    plan = tmp_path / "plan.json"
    args = ["plan", str(example_onnx), "--batch", str(BATCH), "--machine", str(path)]
    assert main([*args, "--max-evals", "200", "--seed", "0", "-o", str(plan), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "single-device" in out["infeasible_baselines"]
    assert "data-parallel" not in out["infeasible_baselines"]
    # the search may return a pipeline or ZeRO: their rules' plans are baselines too
    assert {"pipeline", "zero"} <= set(out["baselines"])
    feasible = [t for n, t in out["baselines"].items() if n not in out["infeasible_baselines"]]
    assert out["predicted_step_time_s"] <= min(feasible)
    saved = json.loads(plan.read_text())["predicted"]
    assert saved["infeasible_baselines"] == out["infeasible_baselines"]
    assert main([*args, "--strategy", "data-parallel", "-o", str(tmp_path / "dp.json")]) == 0
    table = capsys.readouterr().out
    assert "single-device" in table and "does not fit in device memory" in table
