"""Files that cannot be read or written are refused in one line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onnx2soap.cli import main as cli
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.search.mcmc import SearchOptions, mcmc
from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
from onnx2soap.sim.machine import dump_machine
from onnx2soap.soap import Partitioner, analyze, load_plan

BATCH = "4"


def one_line(capsys, *fragments: str) -> None:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_plan_file_that_is_a_directory(tmp_path: Path, capsys) -> None:
    assert cli(["simulate", str(tmp_path)]) == 2
    one_line(capsys, "cannot read the plan")


def test_machine_file_that_is_a_directory_or_binary(tmp_path: Path, example_onnx, capsys) -> None:
    folder = tmp_path / "m.yaml"
    folder.mkdir()
    base = ["plan", str(example_onnx), "--batch", BATCH, "-o", str(tmp_path / "p.json")]
    assert cli([*base, "--machine", str(folder)]) == 2
    one_line(capsys, "cannot read the machine file")
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert cli([*base, "--machine", str(binary)]) == 2
    one_line(capsys, "b.yaml")


def test_output_that_cannot_be_written(tmp_path: Path, example_onnx, capsys) -> None:
    base = ["plan", str(example_onnx), "--batch", BATCH, "--devices", "2", "--strategy"]
    assert cli([*base, "data-parallel", "-o", str(tmp_path)]) == 2
    one_line(capsys, "cannot write")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli([*base, "data-parallel", "-o", str(blocker / "p.json")]) == 2
    one_line(capsys, "cannot write")


def test_a_misspelt_dim_with_degree_one_is_caught(tmp_path: Path, example_onnx, capsys) -> None:
    plan = tmp_path / "p.json"
    cli(
        [
            "plan",
            str(example_onnx),
            "--batch",
            BATCH,
            "--devices",
            "2",
            "--strategy",
            "expert",
            "-o",
            str(plan),
        ]
    )
    doc = json.loads(plan.read_text())
    doc["ops"][0]["degrees"]["channels"] = 1
    plan.write_text(json.dumps(doc))
    capsys.readouterr()
    assert cli(["simulate", str(plan)]) == 2
    one_line(capsys, "degrees.channels: no such dim")


def test_machine_file_in_a_plan_is_found_from_any_folder(
    tmp_path: Path, example_onnx, monkeypatch, capsys
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(example_onnx, work / "cnn.onnx")
    monkeypatch.chdir(work)
    assert cli(["machine", "show", "cpu:2", "--yaml"]) == 0
    Path("m.yaml").write_text(capsys.readouterr().out)
    args = ["plan", "cnn.onnx", "--batch", BATCH, "--machine", "m.yaml", "--strategy", "expert"]
    assert cli([*args, "-o", "plans/p.json"]) == 0
    assert json.loads(Path("plans/p.json").read_text())["machine"] == "../m.yaml"
    monkeypatch.chdir(tmp_path)
    assert load_plan("work/plans/p.json").machine == "work/plans/../m.yaml"
    capsys.readouterr()
    assert cli(["simulate", "work/plans/p.json", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["machine"] == "cpu:2"


def test_yaml_exponent_without_sign_is_a_number(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(
        dump_machine(resolve_machine("cpu:1")).replace(
            "peak_flops: 20000000000.0", "peak_flops: 2e10"
        )
    )
    assert "2e10" in path.read_text()
    assert resolve_machine(str(path)).devices[0].peak_flops == 2e10


def test_search_with_a_single_strategy_returns_at_once(example_onnx) -> None:
    graph = load_model(example_onnx, 2).graph
    sim = Simulator(resolve_machine("cpu:1"), RooflineCost())
    result = mcmc(graph, analyze(graph), sim, SearchOptions(budget_s=60, max_evals=50))
    assert result.time_s < 5 and result.evaluated == 1


@pytest.mark.parametrize("batches", [(8, 64)])
def test_one_simulator_serves_several_graphs(example_onnx, batches) -> None:
    shared = Simulator(resolve_machine("cpu:4"), RooflineCost())
    for batch in batches:
        graph = load_model(example_onnx, batch).graph
        pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 4))
        fresh = Simulator(resolve_machine("cpu:4"), RooflineCost())
        assert shared.evaluate(pg) == fresh.evaluate(pg)


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path) -> None:
    """``onnx2soap plan ... | head -1``: the plan file is written whole, nothing is said
    on stderr, and the exit code is a killed writer's (141)."""
    import subprocess
    import sys

    model = Path(__file__).resolve().parents[2] / "examples" / "cnn.onnx"
    out = tmp_path / "plan.json"
    command = [sys.executable, "-m", "onnx2soap", "plan", str(model), "--batch", BATCH]
    command += ["--machine", "cpu:2", "--strategy", "data-parallel", "-o", str(out)]
    writer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert writer.stdout is not None
    writer.stdout.close()  # the reader leaves before the report is written
    _, err = writer.communicate(timeout=120)
    assert writer.returncode == 141 and err == b"", err
    assert load_plan(out).machine == "cpu:2"
