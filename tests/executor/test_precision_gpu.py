"""Mixed precision on GPUs (real, or the numpy stand-in of tests/standins): fp16 runs its
matrix products in float16 (cuBLAS's tensor cores) and trains like the CPU's fp16, which
computes in float32 on rounded values; bf16 (no bfloat16 in CuPy) rounds as the CPU does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnx2soap.precision import Precision
from tests.executor.mpi import make_plan, mpirun
from tests.executor.test_precision import BATCH, LR, STEPS, _mlp, _one_device
from tests.optional import cupy_or_skip, require

cp = cupy_or_skip()
torch = require("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gpu_ranks_train_like_the_cpu_in_the_same_precision(tmp_path: Path, precision) -> None:
    from tests.models import export

    model = export(_mlp(), torch.zeros(BATCH, 16), tmp_path / "mlp.onnx")
    one, plan = tmp_path / "one.json", tmp_path / "random.json"
    make_plan(model, one, 1, BATCH, "single-device")
    make_plan(model, plan, 2, BATCH, "random", seed=4)
    ref = _one_device(tmp_path, one, Precision(precision), STEPS)
    run = mpirun(
        plan,
        2,
        tmp_path,
        "--steps",
        str(STEPS),
        "--lr",
        str(LR),
        "--precision",
        precision,
        "--device",
        "cuda",
        "--transport",
        "mpi-host",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    np.testing.assert_allclose(run.losses, [r.loss for r in ref.steps], rtol=2e-3)
    for name, w in ref.weights.items():
        np.testing.assert_allclose(run.weights[name], w, rtol=0, atol=2e-3, err_msg=name)
