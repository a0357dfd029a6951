"""Importer-only models: the shapes of export a user hits and the refusals they should get.

Each fixture exports once per session with the legacy exporter (the one that produces
these patterns); the shared models live in ``tests/models.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from onnx2soap.importer import ImportedModel, load_model
from onnx2soap.ir import LossKind
from tests.models import export
from tests.optional import require

VIEW_SAMPLE = (3, 8, 8)
STATIC_BATCH = 4


def _build_view(seed: int = 0):
    """Conv -> Relu -> ``x.view(x.size(0), -1)`` -> Linear: the classic flatten idiom,
    which the legacy exporter writes as Shape/Gather/Unsqueeze/Concat feeding Reshape."""
    import torch
    from torch import nn

    class ViewFlatten(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, kernel_size=3, padding=1)
            self.relu = nn.ReLU()
            self.fc = nn.Linear(4 * 8 * 8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.relu(self.conv(x))
            return self.fc(y.view(y.size(0), -1))

    torch.manual_seed(seed)
    return ViewFlatten()


def _build_own_loss(seed: int = 0):
    """Linear then ``F.cross_entropy``: the model computes its own loss from its labels."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 5)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.fc(x), labels)

    torch.manual_seed(seed)
    return WithLoss()


def _build_unsupported(seed: int = 0):
    """Three ops onnx2soap does not convert (Sign, Atan, TopK) among supported ones, so
    a refusal has several nodes to list."""
    import torch
    from torch import nn

    class Unsupported(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, kernel_size=3, padding=1)
            self.flatten = nn.Flatten()
            self.fc = nn.Linear(4 * 8 * 8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.atan(torch.sign(self.conv(x)))
            return torch.topk(self.fc(self.flatten(y)), k=5, dim=1).values

    torch.manual_seed(seed)
    return Unsupported()


def _build_residual(seed: int = 0):
    """fc -> relu -> (+ the fc output): an Add of two activations, no weight."""
    import torch
    from torch import nn

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.relu = nn.ReLU()
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            return self.head(self.relu(y) + y)

    torch.manual_seed(seed)
    return Residual()


def _randn(*shape: int):
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def importer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("torch")
    return tmp_path_factory.mktemp("importer")


@pytest.fixture(scope="session")
def view_onnx(importer_dir: Path) -> Path:
    """``x.view(x.size(0), -1)`` with a symbolic batch."""
    x = _randn(2, *VIEW_SAMPLE)
    return export(_build_view(), x, importer_dir / "view.onnx", "legacy")


@pytest.fixture(scope="session")
def static_view_onnx(importer_dir: Path) -> Path:
    """The same model exported with its batch fixed at ``STATIC_BATCH``."""
    x = _randn(STATIC_BATCH, *VIEW_SAMPLE)
    path = importer_dir / "view_static.onnx"
    return export(_build_view(), x, path, "legacy", dynamic_batch=False)


@pytest.fixture(scope="session")
def own_loss_onnx(importer_dir: Path) -> Path:
    """Inputs ``input`` [4, 8] float and ``labels`` [4] int64 (a static batch, so loading
    with another batch rebinds both); output the scalar ``loss``."""
    import torch

    x = _randn(STATIC_BATCH, 8)
    labels = torch.tensor([0, 3, 1, 4])
    return export(
        _build_own_loss(),
        (x, labels),
        importer_dir / "own_loss.onnx",
        "legacy",
        input_names=("input", "labels"),
        output_names=("loss",),
        dynamic_batch=False,
    )


@pytest.fixture(scope="session")
def unsupported_onnx(importer_dir: Path) -> Path:
    x = _randn(2, *VIEW_SAMPLE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on TopK
        return export(_build_unsupported(), x, importer_dir / "unsupported.onnx", "legacy")


@pytest.fixture(scope="session")
def residual_onnx(importer_dir: Path) -> Path:
    return export(_build_residual(), _randn(2, 16), importer_dir / "residual.onnx", "legacy")


@pytest.fixture(scope="session")
def old_opset_onnx(importer_dir: Path) -> Path:
    """A residual model exported at opset 12, one below what onnx2soap reads."""
    path = importer_dir / "opset12.onnx"
    return export(_build_residual(), _randn(2, 16), path, "legacy", opset=12)


# --- graphs by source name -------------------------------------------------------------------

BATCH = 8  # differs from every export's example batch, so each load rebinds the batch
GraphSource = str  # "example", "view", or "<model>-<exporter>" for a model of tests.models


@pytest.fixture(scope="session")
def source_path(request: pytest.FixtureRequest) -> Callable[[GraphSource], Path]:
    """``source_path("cnn-dynamo") -> Path``: the ONNX file behind a source name."""

    def path(source: GraphSource) -> Path:
        if source == "example":
            return request.getfixturevalue("example_onnx")
        if source == "view":
            return request.getfixturevalue("view_onnx")
        name, exporter = source.rsplit("-", 1)
        return request.getfixturevalue("export_model")(name, exporter)

    return path


@pytest.fixture(scope="session")
def load_graph(
    source_path: Callable[[GraphSource], Path],
) -> Callable[..., ImportedModel]:
    """``load_graph(source, batch=BATCH, loss=None) -> ImportedModel``, cached."""
    cache: dict[tuple[GraphSource, int, LossKind | None], ImportedModel] = {}

    def load(
        source: GraphSource, batch: int = BATCH, loss: LossKind | None = None
    ) -> ImportedModel:
        key = (source, batch, loss)
        if key not in cache:
            cache[key] = load_model(source_path(source), batch, loss)
        return cache[key]

    return load
