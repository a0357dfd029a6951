"""Gradient buckets on GPUs (float64, 1e-10, like one device): under NCCL each bucket's
ring is one NCCL group of all-reduces on the communication stream, one per gradient;
over ``mpi-host`` the ranks share a GPU and ring over host copies of the gradients.
Under the numpy stand-in (``tests/standins``) or on a real machine with the GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnx2soap.ir import DType
from tests.executor import bucket_plans
from tests.executor.mpi import assert_same_training, make_plan, mpirun, reference
from tests.optional import cupy_or_skip

cp = cupy_or_skip()
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
STEPS, LR = 2, 0.05
FLOAT64 = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--device", "cuda")


def _one_device(model: Path, tmp_path: Path):
    one = tmp_path / "one.json"
    make_plan(model, one, 1, bucket_plans.BATCH, "data-parallel")
    return reference(one, STEPS, DType.FLOAT64, LR)


@pytest.mark.parametrize(("kind", "ranks"), [("data-parallel", 2), ("mixed", 3)])
def test_nccl_buckets_train_like_one_device(example_onnx: Path, tmp_path: Path, kind, ranks):
    if cp.cuda.runtime.getDeviceCount() < ranks:
        pytest.skip(f"needs {ranks} GPUs (NCCL takes one per rank)")
    losses, weights = _one_device(example_onnx, tmp_path)
    strategy = bucket_plans.strategy(example_onnx, kind, ranks)
    plan = bucket_plans.save(example_onnx, tmp_path / f"{kind}.json", strategy)
    run = mpirun(plan, ranks, tmp_path, *FLOAT64, "--transport", "nccl")
    assert_same_training(run, losses, weights, rtol=1e-10)


def test_mpi_host_buckets_train_like_one_device(example_onnx: Path, tmp_path: Path, monkeypatch):
    losses, weights = _one_device(example_onnx, tmp_path)
    strategy = bucket_plans.strategy(example_onnx, "mixed", 3)
    plan = bucket_plans.save(example_onnx, tmp_path / "mixed.json", strategy)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU, on a real machine too
    run = mpirun(plan, 3, tmp_path, *FLOAT64, "--transport", "mpi-host")
    assert_same_training(run, losses, weights, rtol=1e-10)
