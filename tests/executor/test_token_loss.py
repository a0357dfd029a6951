"""Token-level cross-entropy: a model whose output is [N, T, C] gets torch's
CrossEntropyLoss over the last axis (labels [N, T], the mean over every position whose
label is not -100). One float64 SGD step on 1 and on 3 ranks equals torch.optim.SGD's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.executor.mpi import make_plan, mpirun
from tests.models import build_matmul, example_input

pytestmark = pytest.mark.mpi
BATCH, LR = 4, 0.1


def _torch_step(model_path: Path, x: np.ndarray, labels: np.ndarray):
    import torch

    model = build_matmul().double()
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(model_path).graph.initializer}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(inits[name].astype(np.float64)))
    logits = model(torch.from_numpy(x))
    loss = torch.nn.CrossEntropyLoss()(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(labels).reshape(-1)
    )
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return float(loss), {n: p.detach().numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("ranks", "strategy"), [(1, "data-parallel"), (3, "random")])
def test_one_step_is_torch_cross_entropy_over_the_last_axis(
    export_model, tmp_path: Path, ranks: int, strategy: str
) -> None:
    model = export_model("matmul")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(tuple(example_input("matmul", BATCH).shape))
    classes = 24  # build_matmul's output width
    labels = rng.integers(0, classes, x.shape[:2])
    labels[0, :3] = -100  # ignored positions, as a padded sequence has
    labels[2, 5] = -100
    data = tmp_path / "tokens.npz"
    np.savez(data, input=x, labels=labels)
    plan = tmp_path / "plan.json"
    make_plan(model, plan, ranks, BATCH, strategy, seed=3)
    args = ("--steps", "1", "--lr", str(LR), "--dtype", "float64", "--data", str(data))
    run = mpirun(plan, ranks, tmp_path, *args)
    assert run.returncode == 0, run.stderr[-2000:]
    loss, weights = _torch_step(model, x, labels)
    assert run.losses[0] == pytest.approx(loss, rel=1e-12)
    for name, want in weights.items():
        np.testing.assert_allclose(run.weights[name], want, rtol=1e-10, atol=1e-12, err_msg=name)
