"""Checkpoints under a real mpiexec.

- Stopped at step k and resumed: bit-identical to the uninterrupted run (losses and every
  weight, state and Adam moment), on a random plan with BatchNorm and Dropout on.
- Resumed under another plan (other splits, another rank count): re-sharded, it trains
  on like one device (float64, 1e-10).
- mpiexec killed at any moment while checkpointing every step: the newest checkpoint is
  whole, and the run resumes from it; a half-written checkpoint is never read.
- A checkpoint of another model, batch, dtype, seed or optimizer is refused in one line.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from executor.checkpoint import read_manifest
from onnx2soap.ir import DType
from tests.executor.mpi import MPIEXEC, assert_same_training, make_plan, mpirun, reference

pytestmark = pytest.mark.mpi
BATCH, LR = 4, 0.05
ADAM = ("--optimizer", "adam", "--lr", str(LR), "--dtype", "float64")


@pytest.fixture(scope="module")
def bnnet(export_model, tmp_path_factory):
    """The BatchNorm + Dropout model and plans: random on 3 ranks and on 2 ranks."""
    model = export_model("bnnet")
    folder = tmp_path_factory.mktemp("ckpt-plans")
    plans = {}
    for ranks, seed in ((3, 4), (2, 9), (1, 0)):
        plans[ranks] = folder / f"plan-{ranks}.json"
        strategy = "data-parallel" if ranks == 1 else "random"
        make_plan(model, plans[ranks], ranks, BATCH, strategy, seed)
    return model, plans


def test_resumed_run_is_bit_identical(bnnet, tmp_path: Path):
    _, plans = bnnet
    whole = mpirun(plans[3], 3, tmp_path, "--steps", "4", *ADAM)
    assert whole.returncode == 0, whole.stderr[-2000:]
    folder = tmp_path / "ckpt"
    first = mpirun(plans[3], 3, tmp_path, "--steps", "2", *ADAM, "--checkpoint", str(folder))
    assert first.returncode == 0, first.stderr[-2000:]
    assert read_manifest(folder)[0].step == 2
    rest = mpirun(plans[3], 3, tmp_path, "--steps", "4", *ADAM, "--resume", str(folder))
    assert rest.returncode == 0, rest.stderr[-2000:]
    assert first.losses + rest.losses == whole.losses  # exactly
    for name, w in whole.weights.items():
        np.testing.assert_array_equal(rest.weights[name], w, err_msg=name)


def test_resumed_under_another_plan_trains_like_one_device(bnnet, tmp_path: Path):
    _, plans = bnnet
    losses, weights = reference(plans[1], 4, DType.FLOAT64, LR)
    folder = tmp_path / "ckpt"
    sgd = ("--lr", str(LR), "--dtype", "float64")
    first = mpirun(plans[3], 3, tmp_path, "--steps", "2", *sgd, "--checkpoint", str(folder))
    rest = mpirun(plans[2], 2, tmp_path, "--steps", "4", *sgd, "--resume", str(folder))
    assert first.returncode == 0 and rest.returncode == 0, first.stderr + rest.stderr
    np.testing.assert_allclose(first.losses + rest.losses, losses, rtol=1e-10)
    assert_same_training(rest, losses[2:], weights, rtol=1e-10)


def test_killed_while_checkpointing_resumes_from_a_whole_checkpoint(bnnet, tmp_path: Path):
    _, plans = bnnet
    folder = tmp_path / "ckpt"
    command = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "executor", "run", str(plans[2])]
    args = ["--steps", "100000", "--checkpoint", str(folder), "--checkpoint-every", "1"]
    proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (folder / "LATEST").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(7).uniform(0.05, 0.5))  # somewhere in a later write
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    subprocess.run(["pkill", "-9", "-f", str(plans[2])], check=False)  # orphaned ranks
    manifest, path = read_manifest(folder)
    assert manifest.step >= 1
    assert all((path / e.file).exists() for e in manifest.entries)
    more = str(manifest.step + 1)
    rest = mpirun(plans[2], 2, tmp_path, "--steps", more, "--resume", str(folder))
    assert rest.returncode == 0, rest.stderr[-2000:]
    assert len(rest.losses) == 1


def test_a_half_written_checkpoint_is_never_read(bnnet, tmp_path: Path):
    _, plans = bnnet
    folder = tmp_path / "ckpt"
    assert (
        mpirun(plans[2], 2, tmp_path, "--steps", "1", "--checkpoint", str(folder)).returncode == 0
    )
    half = folder / ".tmp-step-000000002"
    half.mkdir()
    (half / "r0-0.npy").write_bytes(b"\x93NUMPY truncated")
    assert read_manifest(folder)[0].step == 1
    run = mpirun(plans[2], 2, tmp_path, "--steps", "2", "--resume", str(folder))
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (("--seed", "3"), "--seed 0"),
        (("--optimizer", "adam"), "--optimizer sgd"),
        (("--dtype", "float64"), "--dtype float32"),
    ],
)
def test_an_incompatible_checkpoint_is_refused(bnnet, tmp_path: Path, change, said):
    _, plans = bnnet
    folder = tmp_path / "ckpt"
    assert (
        mpirun(plans[2], 2, tmp_path, "--steps", "1", "--checkpoint", str(folder)).returncode == 0
    )
    run = mpirun(plans[2], 2, tmp_path, "--steps", "2", "--resume", str(folder), *change)
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.startswith("executor")]
    assert len(lines) == 1 and said in lines[0], run.stderr


def test_a_checkpoint_of_another_model_is_refused(bnnet, export_model, tmp_path: Path):
    _, plans = bnnet
    folder = tmp_path / "ckpt"
    assert (
        mpirun(plans[2], 2, tmp_path, "--steps", "1", "--checkpoint", str(folder)).returncode == 0
    )
    other = tmp_path / "mlp.json"
    make_plan(export_model("mlp"), other, 2, BATCH, "data-parallel")
    run = mpirun(other, 2, tmp_path, "--steps", "2", "--resume", str(folder))
    assert run.returncode == 2 and "another model" in run.stderr
    missing = mpirun(other, 2, tmp_path, "--steps", "2", "--resume", str(tmp_path / "none"))
    assert missing.returncode == 2 and "no checkpoint" in missing.stderr
    shutil.rmtree(folder)
