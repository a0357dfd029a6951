"""Token-level cross-entropy: a model whose output is [N, T, C] gets torch's
CrossEntropyLoss over the last axis (labels [N, T], the mean over every position whose
label is not -100). One float64 SGD step on 1 and on 3 ranks equals torch.optim.SGD's,
for a MatMul over float features and for a token classifier reading int64 ids
(Embedding, LayerNorm, GELU, Linear)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.executor.mpi import make_plan, mpirun
from tests.models import MODELS

pytestmark = pytest.mark.mpi
BATCH, LR, CLASSES = 4, 0.1, {"matmul": 24, "tokens": 5, "tied": 40}


def _as_in_the_file(model) -> None:
    """Make torch compute what the ONNX file says: the exporter stores LayerNorm's epsilon
    and GELU's sqrt(2) in float32 (1e-5 becomes 9.99999974e-06), which moves the loss by
    about 5e-11 relative: more than the comparison allows."""
    import torch

    class FileGelu(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            root2 = float(np.float32(np.sqrt(2.0)))  # the exporter's Div constant
            return x * (1 + torch.erf(x / root2)) * 0.5

    if hasattr(model, "act"):
        model.act = FileGelu()
    model.norm.eps = float(np.float32(model.norm.eps))


def _torch_step(name: str, model_path: Path, x: np.ndarray, labels: np.ndarray):
    import torch

    model = MODELS[name].build().double()
    if name in ("tokens", "tied"):
        _as_in_the_file(model)
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(model_path).graph.initializer}
    with torch.no_grad():
        for param, p in model.named_parameters():
            p.copy_(torch.from_numpy(inits[param].astype(np.float64)))
    logits = model(torch.from_numpy(x))
    flat = logits.reshape(-1, logits.shape[-1])
    loss = torch.nn.CrossEntropyLoss()(flat, torch.from_numpy(labels).reshape(-1))
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return float(loss), {n: p.detach().numpy() for n, p in model.named_parameters()}


def _data(name: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    spec = MODELS[name]
    shape = (BATCH, *spec.sample_shape)
    x = rng.integers(0, spec.ids, shape) if spec.ids else rng.standard_normal(shape)
    labels = rng.integers(0, CLASSES[name], shape[:2])
    labels[0, :3] = -100  # ignored positions, as a padded sequence has
    labels[2, 5] = -100
    return x, labels


@pytest.mark.parametrize("name", ["matmul", "tokens", "tied"])
@pytest.mark.parametrize(("ranks", "strategy"), [(1, "data-parallel"), (3, "random")])
def test_one_step_is_torch_cross_entropy_over_the_last_axis(
    export_model, tmp_path: Path, name: str, ranks: int, strategy: str
) -> None:
    model = export_model(name)
    x, labels = _data(name, np.random.default_rng(0))
    data = tmp_path / "tokens.npz"
    np.savez(data, input=x, labels=labels)
    plan = tmp_path / "plan.json"
    make_plan(model, plan, ranks, BATCH, strategy, seed=3)
    args = ("--steps", "1", "--lr", str(LR), "--dtype", "float64", "--data", str(data))
    run = mpirun(plan, ranks, tmp_path, *args)
    assert run.returncode == 0, run.stderr[-2000:]
    loss, weights = _torch_step(name, model, x, labels)
    assert run.losses[0] == pytest.approx(loss, rel=1e-12)
    for param, want in weights.items():
        np.testing.assert_allclose(run.weights[param], want, rtol=1e-10, atol=1e-12, err_msg=param)
