"""Every optimizer and schedule: steps equal torch.optim's, and N ranks train like one.

- Three float64 steps of the example CNN (one batch, fed from a file) with each
  optimizer, weight decay, and warm-up with a cosine or linear schedule equal the same
  steps of ``torch.optim`` with torch's own schedulers (``torch_schedules.py``, not our
  ``lr_factor``) on the same torch module: losses and every weight.
- Each optimizer on a random 3-rank plan under mpiexec trains like one device (1e-10):
  its state is sharded like its weight and every replica applies the same update.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from mpi4py import MPI
from onnx import numpy_helper

from executor.kinds import DeviceKind
from executor.optim import OptimizerConfig, OptimizerKind
from executor.train import RunOptions, train
from onnx2soap.ir import DType
from tests.executor.mpi import assert_same_training, make_plan, mpirun
from tests.executor.optimizer_configs import OPTIMIZERS as CONFIGS
from tests.executor.torch_schedules import torch_scheduler
from tests.models import MODELS

BATCH, STEPS, LR = 4, 3, 0.05


def _torch_optimizer(torch, params, config: OptimizerConfig):
    kind, wd = config.kind, config.weight_decay
    if kind is OptimizerKind.SGD:
        return torch.optim.SGD(params, lr=LR, weight_decay=wd)
    if kind in (OptimizerKind.MOMENTUM, OptimizerKind.NESTEROV):
        nesterov = kind is OptimizerKind.NESTEROV
        return torch.optim.SGD(
            params, lr=LR, momentum=config.momentum, weight_decay=wd, nesterov=nesterov
        )
    cls = torch.optim.Adam if kind is OptimizerKind.ADAM else torch.optim.AdamW
    return cls(params, lr=LR, betas=config.betas, eps=config.eps, weight_decay=wd)


def _torch_training(model_path: Path, x, labels, config: OptimizerConfig):
    import torch

    model = MODELS["cnn"].build().double()
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(model_path).graph.initializer}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(inits[name].astype(np.float64)))
    optimizer = _torch_optimizer(torch, model.parameters(), config)
    schedule = torch_scheduler(optimizer, config.schedule, config.warmup_steps, STEPS)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(torch.from_numpy(x)), torch.from_numpy(labels)
        )
        loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().numpy() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def one_batch(export_model, tmp_path_factory):
    model = export_model("cnn")
    directory = tmp_path_factory.mktemp("optim")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((BATCH, *MODELS["cnn"].sample_shape))
    labels = rng.integers(0, 10, BATCH)
    data = directory / "batch.npz"
    np.savez(data, input=x, labels=labels)
    plan = directory / "one.json"
    make_plan(model, plan, 1, BATCH, "data-parallel")
    return model, plan, data, x, labels


def _ours(plan: Path, data: Path, config: OptimizerConfig):
    options = RunOptions(
        plan=plan,
        steps=STEPS,
        lr=LR,
        dtype=DType.FLOAT64,
        data=data,
        optimizer=config,
        device=DeviceKind.CPU,
    )
    result = train(MPI.COMM_SELF, options, gather=True)
    return [r.loss for r in result.steps], result.weights


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_steps_equal_torch_optim(one_batch, name):
    model, plan, data, x, labels = one_batch
    losses, weights = _ours(plan, data, CONFIGS[name])
    want_losses, want = _torch_training(model, x, labels, CONFIGS[name])
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
    for param, w in want.items():
        np.testing.assert_allclose(weights[param], w, rtol=1e-9, atol=1e-12, err_msg=param)


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_three_ranks_train_like_one_device(one_batch, tmp_path: Path, name):
    model, plan, data, _, _ = one_batch
    losses, weights = _ours(plan, data, CONFIGS[name])
    config = CONFIGS[name]
    random_plan = tmp_path / "three.json"
    make_plan(model, random_plan, 3, BATCH, "random", seed=len(name))
    args = [
        *("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--data", str(data)),
        *("--optimizer", config.kind.value, "--momentum", str(config.momentum)),
        *("--weight-decay", str(config.weight_decay), "--eps", str(config.eps)),
        *("--betas", *map(str, config.betas), "--lr-schedule", config.schedule.value),
        *("--warmup-steps", str(config.warmup_steps)),
    ]
    run = mpirun(random_plan, 3, tmp_path, *args)
    assert_same_training(run, losses, weights, rtol=1e-10)
