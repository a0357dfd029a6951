"""Copies of weight-only ops on GPU ranks with NCCL (the numpy stand-in without a GPU):
the mixed plan of the weight chain (split and copied, an owner read from another
device, a copy nobody reads) trains like one device."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnx2soap.importer import load_model
from onnx2soap.importer.prepare import file_sha256
from onnx2soap.ir import DType
from onnx2soap.soap import analyze
from onnx2soap.soap.plan import Plan, plan_ops, save_plan
from tests.executor.mpi import assert_same_training, make_plan, mpirun, reference
from tests.executor.test_weight_copies import BATCH, LR, STEPS, mixed
from tests.optional import cupy_or_skip
from tests.weight_only_models import weight_chain_model

cp = cupy_or_skip()
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def test_mixed_copies_with_nccl_train_like_one_device(tmp_path: Path) -> None:
    if cp.cuda.runtime.getDeviceCount() < 3:
        pytest.skip("needs 3 GPUs (NCCL takes one per rank)")
    model = weight_chain_model(tmp_path / "chain.onnx")
    graph = load_model(model, BATCH).graph
    ops = plan_ops(mixed(graph), graph, analyze(graph))
    plan = tmp_path / "mixed.json"
    save_plan(Plan(model, file_sha256(model), BATCH, graph.loss, 3, ops), plan)
    one = tmp_path / "one.json"
    make_plan(model, one, 1, BATCH, "data-parallel")
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--device", "cuda")
    run = mpirun(plan, 3, tmp_path, *args, "--transport", "nccl")
    assert_same_training(run, losses, weights, rtol=1e-10)
