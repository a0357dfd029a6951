"""`onnx2soap profile` under mpiexec, and `plan`/`simulate` choosing their costs from it."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from executor.device import cupy_module
from onnx2soap.cli import main as cli
from onnx2soap.cli.common import seconds
from onnx2soap.sim.machine import dump_machine
from onnx2soap.sim.presets import cpu
from tests.sim.tiny import gemm_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny model and a two-rank machine file with its cost DB, profiled once for real."""
    folder = tmp_path_factory.mktemp("profile")
    model = gemm_model(folder / "tiny.onnx", hidden=8, relu=True)
    machine = folder / "host.yaml"
    machine.write_text(dump_machine(cpu(2)))
    code = cli(["profile", str(model), "--batch", "8", "--machine", str(machine), "--quiet"])
    assert code == 0
    return model, machine


def _plan(model: Path, machine: Path, out: Path, *extra: str) -> list[str]:
    return [
        "plan",
        str(model),
        "--batch",
        "8",
        "--machine",
        str(machine),
        "--strategy",
        "data-parallel",
        "-o",
        str(out),
        *extra,
    ]


@pytest.mark.mpi
def test_profile_writes_the_db_next_to_the_machine_and_resumes(profiled, capsys) -> None:
    model, machine = profiled
    db = machine.with_name("host.costs.sqlite")
    rows = sqlite3.connect(db).execute("SELECT phase, COUNT(*) FROM timings GROUP BY phase")
    counts = dict(rows.fetchall())
    assert counts["forward"] > 0 and counts["backward"] > 0 and counts["update"] > 0
    # The one-device plan's tasks timed inside the executor's step, under known keys.
    in_step = sqlite3.connect(db).execute(
        "SELECT COUNT(*) FROM in_step JOIN timings USING (fingerprint, phase, key)"
    )
    assert in_step.fetchone()[0] > 0
    capsys.readouterr()
    assert cli(["profile", str(model), "--batch", "8", "--machine", str(machine)]) == 0
    out = capsys.readouterr().out
    assert f"0 timings taken, {sum(counts.values())} already there" in out
    assert "in-step calibration: backward " in out


@pytest.mark.mpi
def test_fresh_times_everything_again(profiled, tmp_path: Path, capsys) -> None:
    """``--fresh``: every timing and the in-step calibration taken again over the kept
    ones (a host's speed drifts over hours), the rows replaced, none added."""
    model, machine = profiled
    copy = tmp_path / "host.yaml"
    copy.write_text(machine.read_text())
    db = tmp_path / "host.costs.sqlite"
    db.write_bytes(machine.with_name("host.costs.sqlite").read_bytes())
    count = "SELECT (SELECT COUNT(*) FROM timings), (SELECT COUNT(*) FROM in_step)"
    before = sqlite3.connect(db).execute(count).fetchone()
    poison = "UPDATE {} SET seconds = 1e3"  # what a fresh profile must replace, row by row
    with sqlite3.connect(db) as conn:
        conn.execute(poison.format("timings"))
        conn.execute(poison.format("in_step"))
    capsys.readouterr()
    args = ["profile", str(model), "--batch", "8", "--machine", str(copy), "--quiet"]
    assert cli([*args, "--fresh"]) == 0
    assert f"{before[0]} timings taken, 0 already there" in capsys.readouterr().out
    assert sqlite3.connect(db).execute(count).fetchone() == before
    worst = "SELECT MAX(seconds) FROM {}"
    assert sqlite3.connect(db).execute(worst.format("timings")).fetchone()[0] < 1.0
    assert sqlite3.connect(db).execute(worst.format("in_step")).fetchone()[0] < 1.0


@pytest.mark.mpi
def test_plan_and_simulate_use_the_measured_costs(profiled, tmp_path: Path, capsys) -> None:
    model, machine = profiled
    plan = tmp_path / "plan.json"
    capsys.readouterr()
    assert cli(_plan(model, machine, plan)) == 0
    out = capsys.readouterr().out
    assert "costs: profiled (" in out and "host.costs.sqlite" in out
    assert "calibrated in this model's own steps" in out
    # Profiled at batch 8: at batch 4 the model has no calibration of its own, and says so.
    other = _plan(model, machine, tmp_path / "other.json")
    other[other.index("--batch") + 1] = "4"
    assert cli(other) == 0
    assert "none of this model at batch 4 (profile it at that batch" in capsys.readouterr().out
    assert cli(["simulate", str(plan), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    predicted = json.loads(plan.read_text())["predicted"]["step_time_s"]
    assert doc["costs"] == "profiled" and doc["step_time_s"] == pytest.approx(predicted)
    assert cli(["simulate", str(plan), "--json", "--costs", "roofline"]) == 0
    assert json.loads(capsys.readouterr().out)["costs"] == "roofline"
    # show draws the step plan and simulate priced, with the same costs
    if importlib.util.find_spec("matplotlib") is not None:
        assert cli(["show", str(plan), "-o", str(tmp_path / "plan.png")]) == 0
        assert f"simulated step ({seconds(predicted)})" in capsys.readouterr().out


@pytest.mark.mpi
def test_a_db_from_another_device_is_refused(profiled, tmp_path: Path, capsys) -> None:
    model, machine = profiled
    other = tmp_path / "host.yaml"
    other.write_text(machine.read_text())
    db = tmp_path / "host.costs.sqlite"
    db.write_bytes(machine.with_name("host.costs.sqlite").read_bytes())
    conn = sqlite3.connect(db)
    (doc,) = conn.execute("SELECT doc FROM fingerprints").fetchone()
    fp = json.loads(doc)
    fp["processor"] = "Some Other CPU"
    conn.execute("UPDATE fingerprints SET doc = ?", (json.dumps(fp, sort_keys=True),))
    conn.commit()
    conn.close()
    capsys.readouterr()
    assert cli(_plan(model, other, tmp_path / "p.json")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "measured on another device" in err
    assert "'Some Other CPU'" in err and "--costs roofline" in err
    assert not (tmp_path / "p.json").exists()
    assert cli(_plan(model, other, tmp_path / "p.json", "--costs", "roofline")) == 0


def _beside_a_foreign_model(machine: Path, tmp_path: Path) -> tuple[Path, Path, object]:
    """A copy of ``machine`` and its profiled DB into which another model's tasks are
    calibrated at 5x their isolated time + 1 ms: (machine file, DB, host fingerprint)."""
    from onnx2soap.measure.cost_writer import CostWriter
    from onnx2soap.sim.costdb import DeviceKind, InStep, Phase, Timing, host_fingerprint

    both = tmp_path / "both.yaml"
    both.write_text(machine.read_text())
    db = tmp_path / "both.costs.sqlite"
    db.write_bytes(machine.with_name("host.costs.sqlite").read_bytes())
    fp = host_fingerprint(DeviceKind.CPU, "float32")
    foreign = [
        Timing(phase, f"foreign {i}", "Conv", 0, 0, 1e-4 * (i + 1), 2)
        for phase in Phase
        for i in range(4)
    ]
    with CostWriter.open(db) as opened:
        fp_id = opened.find(fp)
        opened.add(fp_id, foreign)
        opened.add_in_step(fp_id, [InStep(t.phase, t.key, 5 * t.seconds + 1e-3) for t in foreign])
    return both, db, fp


@pytest.mark.mpi
def test_a_model_keeps_its_calibration_beside_another(profiled, tmp_path: Path, capsys) -> None:
    """Another model calibrated into the same DB, its tasks 5x + 1 ms in the step: the
    tiny model's plan is predicted as before by plan and simulate (its own calibration),
    where a calibration over every model's tasks would move it."""
    from onnx2soap.importer import load_model
    from onnx2soap.search.baselines import data_parallel
    from onnx2soap.sim import Simulator
    from onnx2soap.sim.presets import load_machine_file
    from onnx2soap.sim.profiled import ProfiledCost
    from onnx2soap.soap import Partitioner, analyze

    model, machine = profiled
    plan = tmp_path / "plan.json"
    assert cli(_plan(model, machine, plan)) == 0
    own = json.loads(plan.read_text())["predicted"]["step_time_s"]
    both, db, fp = _beside_a_foreign_model(machine, tmp_path)
    capsys.readouterr()
    assert cli(["simulate", str(plan), "--json", "--machine", str(both)]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(own, rel=1e-12)
    assert cli(_plan(model, both, tmp_path / "again.json")) == 0
    again = json.loads((tmp_path / "again.json").read_text())["predicted"]["step_time_s"]
    assert again == pytest.approx(own, rel=1e-12)
    # The calibration over both models' tasks would have predicted it otherwise.
    graph = load_model(model, 8).graph
    m = load_machine_file(both)
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), m.size))
    mixed = ProfiledCost.load(db, fp, m.devices[0])
    assert Simulator(m, mixed).evaluate(pg).step_time_s > 1.2 * own
    assert Simulator(m, mixed.for_graph(graph, m)).evaluate(pg).step_time_s == pytest.approx(own)


@pytest.mark.mpi
def test_a_pipeline_is_taken_into_the_step_by_its_models_calibration(
    profiled, tmp_path: Path, capsys
) -> None:
    """A pipeline plan's ops are split at the microbatch's batch, whose one-device tasks
    the profile never calibrated (it calibrates the model at the step's batch). With
    another model's tasks in the DB at 5x + 1 ms, plan and simulate price the pipeline
    by the tiny model's own calibration, as ``for_graph`` of the model at the step's
    batch gives it, not by the calibration over every model's tasks."""
    from onnx2soap.importer import load_model
    from onnx2soap.sim import make_simulator
    from onnx2soap.sim.presets import load_machine_file
    from onnx2soap.sim.profiled import ProfiledCost
    from onnx2soap.soap import Partitioner, analyze, load_plan

    model, machine = profiled
    both, db, fp = _beside_a_foreign_model(machine, tmp_path)
    plan = tmp_path / "pipe.json"
    shape = ["--stages", "2", "--microbatches", "2"]
    argv = _plan(model, both, plan, *shape)
    argv[argv.index("data-parallel")] = "pipeline"
    assert cli(argv) == 0
    planned = json.loads(plan.read_text())["predicted"]["step_time_s"]
    capsys.readouterr()
    assert cli(["simulate", str(plan), "--json", "--machine", str(both)]) == 0
    simulated = json.loads(capsys.readouterr().out)["step_time_s"]
    m = load_machine_file(both)
    stored = ProfiledCost.load(db, fp, m.devices[0])
    micro = load_model(model, 4).graph
    pipeline = load_plan(plan).pipeline
    pg = Partitioner(micro).partition(load_plan(plan).strategy(micro, analyze(micro)))

    def step(cost) -> float:
        return make_simulator(m, cost, pipeline=pipeline).evaluate(pg).step_time_s

    own = step(stored.for_graph(load_model(model, 8).graph, m))
    assert planned == pytest.approx(own, rel=1e-12)
    assert simulated == pytest.approx(own, rel=1e-12)
    # The microbatch's graph is not calibrated: it would take the mixed calibration.
    assert stored.for_graph(micro, m) == stored
    assert step(stored) > 1.2 * own


def test_costs_without_a_db(tmp_path: Path, capsys) -> None:
    model = gemm_model(tmp_path / "tiny.onnx")
    machine = tmp_path / "host.yaml"
    machine.write_text(dump_machine(cpu(2)))
    assert cli(_plan(model, machine, tmp_path / "p.json")) == 0
    assert "costs: roofline" in capsys.readouterr().out
    code = cli(_plan(model, machine, tmp_path / "p.json", "--costs", "profiled"))
    assert code == 2 and "no cost DB at" in capsys.readouterr().err
    code = cli(_plan(model, "cpu:2", tmp_path / "p.json", "--costs", "profiled"))
    assert code == 2 and "is a preset" in capsys.readouterr().err


def test_bad_input_is_one_line_before_any_work(tmp_path: Path, capsys) -> None:
    model = gemm_model(tmp_path / "tiny.onnx")
    machine = tmp_path / "host.yaml"
    machine.write_text(dump_machine(cpu(2)))
    base = ["profile", str(model), "--batch", "8"]
    assert cli([*base, "--machine", "cpu:2"]) == 2
    assert "give --db PATH" in capsys.readouterr().err
    assert cli([*base, "--machine", str(machine), "--db", str(tmp_path)]) == 2
    assert "cannot write over a folder" in capsys.readouterr().err
    machine.with_name("host.costs.sqlite").write_text("hello " * 1000)
    assert cli([*base, "--machine", str(machine)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a cost database" in err
    assert cli(_plan(model, machine, tmp_path / "p.json")) == 2  # plan refuses it too
    assert "not a cost database" in capsys.readouterr().err


@pytest.mark.mpi
@pytest.mark.skipif(cupy_module() is not None, reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line(tmp_path: Path, capsys) -> None:
    model = gemm_model(tmp_path / "tiny.onnx")
    machine = tmp_path / "host.yaml"
    machine.write_text(dump_machine(cpu(2)))
    args = ["profile", str(model), "--batch", "8", "--machine", str(machine), "--quiet"]
    assert cli([*args, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda" in err, err


@pytest.mark.mpi
def test_ctrl_c_exits_130_and_a_rerun_resumes(tmp_path: Path) -> None:
    machine = tmp_path / "host.yaml"
    machine.write_text(dump_machine(cpu(2)))
    command = [sys.executable, "-m", "onnx2soap", "profile", str(REPO / "examples/cnn.onnx")]
    command += ["--batch", "16", "--machine", str(machine), "--min-time", "0.02"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        # a terminal's command does not ignore SIGINT; one started in the background by
        # a shell without job control does, the ignoring is inherited, and Python then
        # leaves it ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = proc.stderr.readline()  # a round stored
    assert first.startswith("onnx2soap profile: "), first
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    rest = proc.stderr.read()
    assert proc.wait(timeout=30) == 130
    assert rest.count("\n") == 1 and rest.startswith("onnx2soap: interrupted;"), rest
    db = tmp_path / "host.costs.sqlite"
    (stored,) = sqlite3.connect(db).execute("SELECT COUNT(*) FROM timings").fetchone()
    assert stored > 0
