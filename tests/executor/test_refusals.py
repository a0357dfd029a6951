"""The executor's refusals: one line, a non-zero exit on every rank, no traceback, no hang."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from tests.executor.mpi import make_plan, mpirun

pytestmark = pytest.mark.mpi
DRIVER = Path(__file__).with_name("crash_driver.py")
BATCH = 4


@pytest.fixture
def plan2(tmp_path: Path, example_onnx: Path) -> Path:
    model = tmp_path / "cnn.onnx"
    shutil.copy(example_onnx, model)
    plan = tmp_path / "plan.json"
    make_plan(model, plan, 2, BATCH, "data-parallel")
    return plan


def assert_refused(run, *fragments: str) -> None:
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("executor: error: ")
    assert "Traceback" not in run.stderr + run.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_rank_count_differs_from_the_plan(plan2: Path, tmp_path: Path) -> None:
    assert_refused(mpirun(plan2, 3, tmp_path, "--steps", "1"), "2 devices", "3 ranks", "-n 2")


def test_model_file_missing(plan2: Path, tmp_path: Path) -> None:
    (tmp_path / "cnn.onnx").unlink()
    assert_refused(mpirun(plan2, 2, tmp_path, "--steps", "1"), "cnn.onnx", "not found")


def test_model_is_not_the_plans(plan2: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.onnx"
    other.write_bytes((tmp_path / "cnn.onnx").read_bytes() + b"\0")
    run = mpirun(plan2, 2, tmp_path, "--steps", "1", "--model", str(other))
    assert_refused(run, "other.onnx", "sha256")


def test_invalid_plan(plan2: Path, tmp_path: Path) -> None:
    doc = json.loads(plan2.read_text())
    doc["ops"][0]["degrees"] = {"kh": 2}  # a reduction dim cannot be split
    doc["ops"][0]["devices"] = [0, 1]
    plan2.write_text(json.dumps(doc))
    run = mpirun(plan2, 2, tmp_path, "--steps", "1")
    assert_refused(run, f"op '{doc['ops'][0]['name']}'", "kh")


def test_data_file_shapes_do_not_fit(plan2: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.npz"
    np.savez(data, input=np.zeros((8, 3, 16, 16), np.float32), labels=np.zeros(8, np.int64))
    run = mpirun(plan2, 2, tmp_path, "--steps", "1", "--data", str(data))
    assert_refused(run, "data.npz", "'input'", "[samples, 3, 32, 32]")


def test_data_file_trains(plan2: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    x = rng.standard_normal((12, 3, 32, 32)).astype(np.float32)
    np.savez(data, input=x, labels=rng.integers(0, 10, size=12))
    run = mpirun(plan2, 2, tmp_path, "--steps", "4", "--data", str(data))
    assert run.returncode == 0, run.stderr
    # three batches of 4: step 4 sees batch 0 again, after three updates
    assert len(run.losses) == 4 and run.losses[3] != run.losses[0]


def _with_nan(model: Path, weight_index: int) -> str:
    """Put a NaN into one weight of ``model`` (in place); its name."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(model)
    t = proto.graph.initializer[weight_index]
    a = numpy_helper.to_array(t).copy()
    a.flat[-1] = np.nan
    t.CopyFrom(numpy_helper.from_array(a, t.name))
    onnx.save(proto, model)
    return t.name


def test_nonfinite_weights_are_refused_where_they_are_loaded(tmp_path: Path, example_onnx) -> None:
    """Planning reads no weights; the executor checks the boxes each rank loads, and
    every rank stops with the one line (the NaN is in rank 1's half of the model here)."""
    model = tmp_path / "cnn.onnx"
    shutil.copy(example_onnx, model)
    name = _with_nan(model, -1)
    plan = tmp_path / "plan.json"
    make_plan(model, plan, 2, BATCH, "model-parallel")
    run = mpirun(plan, 2, tmp_path, "--steps", "1")
    assert_refused(run, "cnn.onnx", f"initializer '{name}'", "NaN or infinite", "--allow-nonfinite")
    allowed = mpirun(plan, 2, tmp_path, "--steps", "1", "--allow-nonfinite")
    assert allowed.returncode == 0, allowed.stderr


def test_a_rank_that_raises_aborts_all_ranks_quickly(plan2: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    run = mpirun(plan2, 2, tmp_path, "--steps", "50", timeout=60, script=[str(DRIVER)])
    assert run.returncode != 0
    assert time.monotonic() - started < 10
    assert "injected kernel failure" in run.stderr
