"""GPT-2 (the tests' two-layer GPT: tied embeddings, dropout 0.1, dynamo export) with
recomputation trains exactly like one device without it: Megatron's plan on 2 ranks
(attention by heads, the MLP by columns then rows: partial sums, which are kept) with
``plan --recompute all``, float64, 1e-10, dropout masks included (issue 32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onnx2soap.cli import main as onnx2soap_main
from onnx2soap.ir import DType
from tests.executor.mpi import assert_same_training, mpirun, reference

pytestmark = pytest.mark.mpi
RANKS, BATCH, STEPS, LR = 2, 2, 2, 0.05


def _plan(model: Path, out: Path, devices: int, *rule: str) -> Path:
    common = ["--devices", str(devices), "--batch", str(BATCH), "--quiet", "-o", str(out)]
    assert onnx2soap_main(["plan", str(model), *common, *rule]) == 0
    return out


def test_gpt2_recomputing_under_megatron_trains_like_one_device(sequence_onnx, tmp_path):
    model = sequence_onnx("gpt2", "dynamo")
    one = _plan(model, tmp_path / "one.json", 1, "--strategy", "single-device")
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    plan = _plan(model, tmp_path / "mt.json", RANKS, "--strategy", "megatron", "--recompute", "all")
    assert json.loads(plan.read_text())["recompute"]
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")
    assert_same_training(mpirun(plan, RANKS, tmp_path, *args), losses, weights, rtol=1e-10)
