"""One float64 SGD step of the executor is one ``torch.optim.SGD`` step of the same torch
module in train mode, for torchvision families with BatchNorm in training mode (no
Dropout, no stochastic depth: their random masks are not torch's), on 1 rank and on a
random 3-rank plan (for a seeded sample of the families a run: tests/sampling.py).

Compared to 1e-10 (relative, with an absolute floor of 1e-10 near zero): the loss (torch's
CrossEntropyLoss, mean over the batch: the importer attaches softmax cross-entropy with
mean reduction to a model without a loss), every trainable weight after the step, every
BatchNorm running mean, and every running variance against the ONNX update computed by
hand from torch's batch statistics (ONNX keeps the biased variance, torch the unbiased).

The torch module is made to be the model the ONNX file describes: it starts from the
file's initializers (the export ran forward passes in train mode, which moved the
module's running statistics after they were written), and each BatchNorm takes the
file's epsilon and momentum. ONNX stores float attributes in float32, so the file says
momentum 0.8999999761581421 and epsilon 9.999999747378752e-06 where torch said 0.1 and
1e-5. With torch's own values the running means part by ~2.4e-8 relative (the momentum)
and, through the epsilon, efficientnet_b0's loss by 1.9e-9 and its weights by ~2e-8.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.executor.mpi import make_plan, mpirun
from tests.families.conftest import BATCH
from tests.optional import require
from tests.sampling import seeded_sample

LR = 0.05
RTOL = ATOL = 1e-10
RANDOM_RANKS, RANDOM_SEED = 3, 11
# Families with BatchNorm in training mode; the options that switch their random ops off.
CASES = {
    "resnet18": {},  # has neither Dropout nor stochastic depth
    "mobilenet_v2": {"dropout": 0.0},
    "squeezenet1_1": {"dropout": 0.0},  # no BatchNorm at all
    "shufflenet_v2_x0_5": {},
    "densenet121": {"dropout": 0.0},
    "inception_v3": {"dropout": 0.0},
    "efficientnet_b0": {"dropout": 0.0, "stochastic_depth": 0.0},
}

Export = Callable[[str], Path]


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Torch on one thread: on a small shared machine (2 cores, mpiexec ranks beside it)
    its OpenMP threads spin against each other and a float64 step of the depthwise
    families took 14 s instead of 0.1 s."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def deterministic_onnx(tmp_path_factory: pytest.TempPathFactory) -> Export:
    """``get(name)`` -> the legacy (TRAINING mode) export of ``CASES[name]``, cached.

    Not the session's ``family_onnx``: that one keeps torchvision's drop probabilities."""
    require("torch")
    require("onnx")
    from tests.torchvision_models import export_family, import_torchvision

    try:
        import_torchvision()
    except ModuleNotFoundError as e:  # not installed; a broken install fails the tests
        if e.name != "torchvision":
            raise
        pytest.skip(f"torchvision: {e}")
    directory = tmp_path_factory.mktemp("torch_step")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            with warnings.catch_warnings(), _one_torch_thread():
                warnings.simplefilter("ignore")  # the exporter's notes on training mode
                cache[name] = export_family(name, directory, "legacy", BATCH, **CASES[name])
        return cache[name]

    return get


def _torch_model(name: str, path: Path):
    """The family as torch runs it, in float64 and train mode, holding exactly the file's
    initializers and BatchNorm attributes. Returns (model, {bn module: running_mean name})."""
    import onnx
    import torch
    from onnx import numpy_helper

    from tests.torchvision_models import build_family

    model, _ = build_family(name, 0, **CASES[name])
    model = model.double().train()
    proto = onnx.load(path)
    initializers = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    tensors = dict(model.named_parameters())
    norms: dict[str, torch.nn.BatchNorm2d] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            norms[module_name] = module
            tensors[f"{module_name}.running_mean"] = module.running_mean
            tensors[f"{module_name}.running_var"] = module.running_var
    # The legacy exporter keeps the parameter names: every one is found, none renamed.
    missing = sorted(set(tensors) - set(initializers))
    assert not missing, f"torch tensors without an ONNX initializer of that name: {missing}"
    with torch.no_grad():
        for key, tensor in tensors.items():
            value = torch.from_numpy(initializers[key].astype(np.float64))
            assert tensor.shape == value.shape, key
            tensor.copy_(value)
    # Each BatchNormalization node -> its module (by the running mean's name), and the
    # module takes the node's float32 epsilon and momentum exactly.
    by_mean = {}
    for node in proto.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs.get("training_mode") == 1, node.name
        module_name = node.input[3].removesuffix(".running_mean")
        module = norms[module_name]
        module.eps = float(attrs.get("epsilon", 1e-5))
        module.momentum = 1.0 - float(attrs.get("momentum", 0.9))  # exact in float64
        by_mean[module_name] = node.input[3]
    assert sorted(by_mean) == sorted(norms), "a BatchNorm module without its ONNX node"
    return model, norms


def _torch_step(model, norms, x: np.ndarray, y: np.ndarray):
    """One SGD step; returns (loss, {name: tensor after the step}, expected running var)."""
    import torch

    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda m, args, name=name: inputs.__setitem__(name, args[0].detach().clone())
        )
        for name, module in norms.items()
    ]
    before = {name: m.running_var.detach().clone() for name, m in norms.items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    optimizer.zero_grad()
    loss = torch.nn.CrossEntropyLoss()(model(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    optimizer.step()
    for hook in hooks:
        hook.remove()
    after = {name: p.detach().numpy().copy() for name, p in model.named_parameters()}
    running_var = {}
    for name, module in norms.items():
        after[f"{name}.running_mean"] = module.running_mean.detach().numpy().copy()
        # ONNX: momentum * running + (1 - momentum) * the batch's BIASED variance, where
        # torch mixes in the unbiased one; so the update by hand from torch's batch.
        h = inputs[name]
        dims = (0, *range(2, h.dim()))
        biased = h.var(dim=dims, unbiased=False)
        keep = 1.0 - module.momentum
        running_var[f"{name}.running_var"] = (
            before[name] * keep + biased * module.momentum
        ).numpy()
    return loss.item(), after, running_var


def _assert_close(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL, err_msg=what)


@dataclass(frozen=True)
class TorchStep:
    """One family's file, its batch (saved for the executor) and torch's step on it."""

    path: Path
    data: Path
    loss: float
    expected: dict[str, np.ndarray]  # every weight and running statistic after the step


@pytest.fixture(scope="module")
def torch_step(
    deterministic_onnx: Export, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], TorchStep]:
    """``get(name)`` -> torch's step on the family, taken once: its one-rank run and its
    random plan's compare against the same step. Kept for the module: the largest family's
    weights (inception_v3's) are 11 MB."""
    from tests.torchvision_models import FAMILIES

    cache: dict[str, TorchStep] = {}

    def get(name: str) -> TorchStep:
        if name not in cache:
            path = deterministic_onnx(name)
            model, norms = _torch_model(name, path)
            rng = np.random.default_rng(2024)
            x = rng.standard_normal((BATCH, *FAMILIES[name].sample_shape))
            y = rng.integers(0, 10, size=BATCH, dtype=np.int64)  # torchvision_models.CLASSES
            data = tmp_path_factory.mktemp(f"torch_step_{name}") / "data.npz"
            np.savez(data, input=x, labels=y)
            with _one_torch_thread():
                loss, weights, running_var = _torch_step(model, norms, x, y)
            cache[name] = TorchStep(path, data, loss, {**weights, **running_var})
        return cache[name]

    return get


# Every family against torch on one rank; on the random 3-rank plan, a drawn two a run
# (tests/sampling.py: CI's 20 minutes). tests/families/test_families.py trains every
# family on a random plan like one device, every run.
RANDOM = seeded_sample([(name, RANDOM_RANKS) for name in sorted(CASES)], "families-torch-step", 2)
STEPPED = [
    p for name, r in zip(sorted(CASES), RANDOM, strict=True) for p in (pytest.param(name, 1), r)
]
# Data parallel on 2 ranks: resnet18's downsample BatchNorms beside their blocks' last
# ones and inception_v3's branches' BatchNorms sum their statistics in shared rings
# (soap/stats_batches.py).
SHARED_RANKS = 2
SHARED = [pytest.param("resnet18", SHARED_RANKS), pytest.param("inception_v3", SHARED_RANKS)]


@pytest.mark.mpi
@pytest.mark.parametrize(("name", "ranks"), [*STEPPED, *SHARED])
def test_one_step_is_torch_sgd(torch_step, tmp_path: Path, name: str, ranks: int) -> None:
    step = torch_step(name)
    plan = tmp_path / f"plan-{ranks}.json"
    if ranks in (1, SHARED_RANKS):
        make_plan(step.path, plan, ranks, BATCH, "data-parallel")
    else:
        make_plan(step.path, plan, ranks, BATCH, "random", RANDOM_SEED)
    args = ("--steps", "1", "--lr", str(LR), "--dtype", "float64", "--data", str(step.data))
    run = mpirun(plan, ranks, tmp_path, *args)
    assert run.returncode == 0, run.stderr[-3000:]
    where = f"{name} on {ranks} rank(s)"
    _assert_close(np.array(run.losses), np.array([step.loss]), f"{where}: loss")
    assert run.weights is not None
    # Every weight and running statistic saved, each compared.
    assert set(run.weights) == set(step.expected), where
    for key, value in step.expected.items():
        _assert_close(run.weights[key], value, f"{where}: {key}")
