"""Checkpoints of GPU ranks (a real GPU, or the numpy stand-in of tests/standins): the
shards and Adam's moments come off the devices into the safetensors files and back onto
them under another plan (2 ranks, then 3 sharing the GPUs over mpi-host), and the run
continues like one device on the CPU (float64, 1e-10).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from executor.checkpoint import read_manifest
from tests.executor.mpi import assert_same_training, make_plan, mpirun
from tests.executor.test_checkpoints import ADAM, _one_device, _whole_tensors
from tests.optional import cupy_or_skip

cp = cupy_or_skip()
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
BATCH = 6


def test_gpu_ranks_resume_under_another_plan(example_onnx: Path, tmp_path: Path) -> None:
    plans = {ranks: tmp_path / f"plan-{ranks}.json" for ranks in (1, 2, 3)}
    make_plan(example_onnx, plans[1], 1, BATCH, "data-parallel")
    make_plan(example_onnx, plans[2], 2, BATCH, "random", 3)
    make_plan(example_onnx, plans[3], 3, BATCH, "random", 5)
    one = _one_device(plans[1], 4, "adam")
    losses = [r.loss for r in one.steps]
    folder = tmp_path / "ckpt"
    gpu = (*ADAM, "--device", "cuda", "--transport", "mpi-host")
    first = mpirun(plans[2], 2, tmp_path, "--steps", "2", *gpu, "--checkpoint", str(folder))
    rest = mpirun(plans[3], 3, tmp_path, "--steps", "4", *gpu, "--resume", str(folder))
    assert first.returncode == 0 and rest.returncode == 0, first.stderr + rest.stderr
    np.testing.assert_allclose(first.losses + rest.losses, losses, rtol=1e-10)
    assert_same_training(rest, losses[2:], one.weights, rtol=1e-10)
    whole = _whole_tensors(read_manifest(folder)[1])
    for name, w in first.weights.items():
        np.testing.assert_array_equal(whole[name], w, err_msg=name)
