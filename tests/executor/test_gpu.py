"""The executor on a GPU trains exactly like on the CPU (skipped without cupy and a GPU).

- one rank, ``--device cuda``: the losses and weights of the numpy run (float64, 1e-10);
- four ranks sharing one GPU over ``mpi-host`` (NCCL refuses two ranks on one device), a
  random plan: like one device;
- the ``nccl`` transport with one rank: like one device;
- ``mpi-cuda`` runs when the MPI library reports CUDA support and is refused in one line
  when it does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi4py import MPI

from executor.device import cupy_module
from executor.kinds import DeviceKind
from executor.train import RunOptions, train
from executor.transport import mpi_cuda_aware
from onnx2soap.ir import DType
from tests.executor.mpi import assert_same_training, make_plan, mpirun, reference

pytestmark = pytest.mark.skipif(cupy_module() is None, reason="needs cupy and a GPU")

MODELS = {"cnn": 8, "bnnet": 4, "tokens": 4, "tied": 4}
STEPS, LR = 2, 0.05
FLOAT64 = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--device", "cuda")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_rank_on_the_gpu_trains_like_the_cpu(export_model, tmp_path: Path, name):
    plan = tmp_path / "one.json"
    make_plan(export_model(name), plan, 1, MODELS[name], "data-parallel")
    losses, weights = reference(plan, STEPS, DType.FLOAT64, LR)
    options = RunOptions(plan=plan, steps=STEPS, lr=LR, dtype=DType.FLOAT64, device=DeviceKind.CUDA)
    result = train(MPI.COMM_SELF, options, gather=True)
    run_losses = tuple(r.loss for r in result.steps)
    assert run_losses == pytest.approx(losses, rel=1e-10, abs=0)
    for key, w in weights.items():
        assert result.weights[key] == pytest.approx(w, rel=1e-10, abs=1e-10), key


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["cnn", "bnnet"])
def test_four_ranks_sharing_one_gpu_train_like_one_device(export_model, tmp_path: Path, name):
    model = export_model(name)
    one = tmp_path / "one.json"
    make_plan(model, one, 1, MODELS[name], "data-parallel")
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    plan = tmp_path / "four.json"
    make_plan(model, plan, 4, MODELS[name], "random", seed=11)
    run = mpirun(plan, 4, tmp_path, *FLOAT64, "--transport", "mpi-host")
    assert_same_training(run, losses, weights, rtol=1e-10)


@pytest.mark.mpi
def test_nccl_transport_on_one_rank(export_model, tmp_path: Path):
    plan = tmp_path / "one.json"
    make_plan(export_model("cnn"), plan, 1, MODELS["cnn"], "data-parallel")
    losses, weights = reference(plan, STEPS, DType.FLOAT64, LR)
    run = mpirun(plan, 1, tmp_path, *FLOAT64, "--transport", "nccl")
    assert_same_training(run, losses, weights, rtol=1e-10)


@pytest.mark.mpi
def test_mpi_cuda_transport_runs_or_is_refused(export_model, tmp_path: Path):
    model = export_model("cnn")
    one = tmp_path / "one.json"
    make_plan(model, one, 1, MODELS["cnn"], "data-parallel")
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    plan = tmp_path / "two.json"
    make_plan(model, plan, 2, MODELS["cnn"], "random", seed=4)
    run = mpirun(plan, 2, tmp_path, *FLOAT64, "--transport", "mpi-cuda")
    if mpi_cuda_aware():
        assert_same_training(run, losses, weights, rtol=1e-10)
    else:
        assert run.returncode == 2
        assert "does not report CUDA support" in run.stderr
