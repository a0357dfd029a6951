"""Shared statistics rings (``soap/stats_batches.py``) over NCCL: the branches' two
BatchNorms sum their statistics in one all-reduce a phase, ranks with a GPU each train as
one device (float64, 1e-10). Under the numpy stand-in for cupy (``tests/standins``) where
no GPU is; skipped where cupy is not installed or sees too few GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnx2soap.ir import DType
from tests.executor.mpi import assert_same_training, make_plan, mpirun, reference
from tests.optional import cupy_or_skip

cp = cupy_or_skip()
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
STEPS, LR, BATCH = 2, 0.05, 4


@pytest.mark.parametrize("ranks", [2, 4])
def test_shared_rings_over_nccl_train_like_one_device(export_model, tmp_path: Path, ranks):
    if cp.cuda.runtime.getDeviceCount() < ranks:
        pytest.skip(f"needs {ranks} GPUs (NCCL takes one per rank)")
    model = export_model("branches")
    one, plan = tmp_path / "one.json", tmp_path / "plan.json"
    make_plan(model, one, 1, BATCH, "data-parallel")
    make_plan(model, plan, ranks, BATCH, "data-parallel")
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--device", "cuda")
    run = mpirun(plan, ranks, tmp_path, *args, "--transport", "nccl")
    assert_same_training(run, losses, weights, rtol=1e-10)
