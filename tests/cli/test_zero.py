"""``plan --strategy zero [--zero-stage 1|2]``: data parallelism with ZeRO in the plan file,
priced by the simulator, shown by ``simulate``; bad input is one line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onnx2soap.cli import main as cli
from tests.cli.test_io_errors import one_line

BATCH = "8"


@pytest.fixture
def model(tmp_path: Path, example_onnx: Path) -> Path:
    path = tmp_path / "cnn.onnx"
    shutil.copy(example_onnx, path)
    return path


def _plan(model: Path, out: Path, *extra: str) -> dict:
    argv = ["plan", str(model), "--batch", BATCH, "--devices", "4", "--optimizer", "adam"]
    assert cli([*argv, *extra, "-o", str(out)]) == 0
    return json.loads(out.read_text())


def test_zero_plans_are_data_parallel_with_a_stage(model: Path, tmp_path: Path, capsys) -> None:
    dp = _plan(model, tmp_path / "dp.json", "--strategy", "data-parallel")
    two = _plan(model, tmp_path / "z2.json", "--strategy", "zero")
    one = _plan(model, tmp_path / "z1.json", "--strategy", "zero", "--zero-stage", "1")
    assert "zero_stage" not in dp and two["zero_stage"] == 2 and one["zero_stage"] == 1
    assert two["ops"] == dp["ops"] == one["ops"]  # ZeRO's splits are data parallelism's
    # the same bytes (a reduce-scatter and an all-gather are an all-reduce), less memory
    for z in (one, two):
        assert z["predicted"]["bytes_moved"] == dp["predicted"]["bytes_moved"]
        assert z["predicted"]["baselines"]["zero"] == z["predicted"]["step_time_s"]
        assert max(z["predicted"]["peak_memory_bytes"]) < max(dp["predicted"]["peak_memory_bytes"])
    # every plan is compared with ZeRO-2 data parallelism
    assert dp["predicted"]["baselines"]["zero"] == two["predicted"]["step_time_s"]
    # ZeRO-3: the same splits; each weight gathered for its forward and, where the
    # backward reads it (not the first Conv's: its input is the data), for its backward,
    # none after the update: between 1 and 1.5 times the all-reduce's bytes
    three = _plan(model, tmp_path / "z3.json", "--strategy", "zero", "--zero-stage", "3")
    assert three["zero_stage"] == 3 and three["ops"] == dp["ops"]
    moved = three["predicted"]["bytes_moved"] / dp["predicted"]["bytes_moved"]
    assert 1 < moved < 1.5
    capsys.readouterr()
    assert cli(["simulate", str(tmp_path / "z2.json"), "--optimizer", "adam"]) == 0
    assert (
        "ZeRO             stage 2: optimizer state and gradients sharded" in capsys.readouterr().out
    )
    assert cli(["simulate", str(tmp_path / "z1.json"), "--optimizer", "adam", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["zero_stage"] == 1
    assert doc["peak_memory_bytes"] == one["predicted"]["peak_memory_bytes"]


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (("--strategy", "zero", "--zero-stage", "4"), ("--zero-stage", "invalid choice: 4")),
        (
            ("--strategy", "zero", "--zero-stage", "3", "--devices", "1"),
            ("--zero-stage 3 needs data parallelism",),
        ),
        (("--strategy", "data-parallel", "--zero-stage", "1"), ("goes with --strategy zero",)),
        (("--zero-stage", "2"), ("goes with --strategy zero",)),
        (("--strategy", "zero", "--devices", "1"), ("--zero-stage 2 needs data parallelism",)),
        (("--strategy", "zero", "--sequence-parallel"), ("goes with --strategy megatron",)),
        (("--sequence-parallel",), ("goes with --strategy megatron",)),
        (("--strategy", "context"), ("--strategy context splits the sequence", "token ids")),
    ],
)
def test_bad_zero_options_are_one_line(model, tmp_path: Path, capsys, extra, fragments) -> None:
    argv = ["plan", str(model), "--batch", BATCH, "-o", str(tmp_path / "p.json")]
    devices = () if "--devices" in extra else ("--devices", "4")
    assert cli([*argv, *devices, *extra]) == 2
    one_line(capsys, *fragments)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    ("stage", "fragments"),
    [
        (1, ("mp.json: field 'zero_stage': 1 needs data parallelism",)),
        (3, ("mp.json: field 'zero_stage': 3 needs data parallelism",)),
        (4, ("mp.json: field 'zero_stage': must be one of [1, 2, 3]", "got 4")),
    ],
)
def test_simulate_refuses_a_stage_it_cannot_apply(model, tmp_path: Path, capsys, stage, fragments):
    """A stage on a plan that replicates no weight (model parallelism), or a stage that
    is not 1, 2 or 3, in a plan file: one line, exit 2."""
    plan = tmp_path / "mp.json"
    doc = _plan(model, plan, "--strategy", "model-parallel")
    plan.write_text(json.dumps({**doc, "zero_stage": stage}))
    capsys.readouterr()
    assert cli(["simulate", str(plan)]) == 2
    one_line(capsys, *fragments)
