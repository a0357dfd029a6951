"""PyTorch models the tests export to ONNX, and the export helpers.

Shared by the importer, executor and simulator tests. Torch is imported inside the
functions only, so importing this module is free and works without torch; the fixtures in
``tests/conftest.py`` skip when torch is missing.

    path = export_named("spatial", tmp_dir, "dynamo")     # build, seed, export
    path = export(model, example, tmp_dir / "m.onnx", "legacy")

Every builder seeds torch first, so the weights (and the exported bytes) are the same on
every run.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch
    from torch import nn

Exporter = Literal["legacy", "dynamo"]
EXPORTERS: tuple[Exporter, ...] = ("legacy", "dynamo")
LEGACY_OPSET = 17
DYNAMO_OPSET = 18  # the dynamo exporter's native opset: no version conversion pass
EXAMPLE_CNN = Path(__file__).resolve().parents[1] / "examples" / "cnn.py"


# --- models ------------------------------------------------------------------------------


def build_mlp(seed: int = 0, features: int = 32, hidden: int = 64, classes: int = 10):
    """[B, 32] -> Gemm -> Relu -> Gemm -> Relu -> Gemm -> logits [B, 10]."""
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(features, hidden)
            self.relu1 = nn.ReLU()
            self.fc2 = nn.Linear(hidden, hidden)
            self.relu2 = nn.ReLU()
            self.fc3 = nn.Linear(hidden, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc3(self.relu2(self.fc2(self.relu1(self.fc1(x)))))

    torch.manual_seed(seed)
    return MLP()


@cache
def example_cnn_module() -> ModuleType:
    """``examples/cnn.py`` loaded from its path: the tests need not put examples on sys.path."""
    spec = importlib.util.spec_from_file_location("onnx2soap_example_cnn", EXAMPLE_CNN)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {EXAMPLE_CNN}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_cnn(seed: int = 0):
    """The example CNN of ``examples/cnn.py`` (the model behind ``examples/cnn.onnx``)."""
    return example_cnn_module().build_model(seed)


def build_spatial(seed: int = 0):
    """A CNN made to be split spatially: every windowed op has a halo or an uneven edge.

    [B, 3, 32, 32]
      conv_s2   3x3 stride 2 pad 1                  -> [B, 8, 16, 16]
      conv_d2   3x3 dilation 2 pad 2                -> [B, 8, 16, 16]
      pool_ceil max 3x3 stride 2, ceil_mode         -> [B, 8, 8, 8]   (floor would give 7)
      avg_incl  avg 3x3 stride 1 pad 1, pads counted -> [B, 8, 8, 8]
      avg_excl  avg 3x3 stride 2 pad 1, pads not counted -> [B, 8, 4, 4]
      conv_out  3x3 pad 1                           -> [B, 16, 4, 4]
      gap (GlobalAveragePool with the legacy exporter), flatten, fc -> logits [B, 10]
    """
    import torch
    from torch import nn

    class SpatialCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv_s2 = nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=1)
            self.relu1 = nn.ReLU()
            self.conv_d2 = nn.Conv2d(8, 8, kernel_size=3, dilation=2, padding=2)
            self.relu2 = nn.ReLU()
            self.pool_ceil = nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True)
            self.avg_incl = nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=True)
            self.avg_excl = nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False)
            self.conv_out = nn.Conv2d(8, 16, kernel_size=3, padding=1)
            self.relu3 = nn.ReLU()
            self.gap = nn.AdaptiveAvgPool2d(1)
            self.flatten = nn.Flatten()
            self.fc = nn.Linear(16, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.relu2(self.conv_d2(self.relu1(self.conv_s2(x))))
            x = self.avg_excl(self.avg_incl(self.pool_ceil(x)))
            x = self.relu3(self.conv_out(x))
            return self.fc(self.flatten(self.gap(x)))

    torch.manual_seed(seed)
    return SpatialCNN()


def build_matmul(seed: int = 0, hidden: int = 16, out: int = 24):
    """x [B, S, H] @ weight [H, O] + bias [O] -> [B, S, O]: MatMul then Add (S=6 in MODELS)."""
    import torch
    from torch import nn

    class MatMulModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(hidden, out) / hidden**0.5)
            self.bias = nn.Parameter(torch.randn(out))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.matmul(x, self.weight) + self.bias

    torch.manual_seed(seed)
    return MatMulModel()


def build_bnnet(seed: int = 0, dropout: float = 0.3):
    """What torchvision's mobile CNNs are made of, small: BatchNorm in training mode (its
    statistics synchronized across any split), ReLU6 (Clip), a depthwise conv, SiLU
    (Sigmoid * x), a squeeze-excitation scale (a broadcast Mul), a grouped conv (split in
    whole groups) and Dropout.

    [B, 3, 16, 16] conv 3x3 s2 -> BN -> ReLU6 -> depthwise 3x3 -> BN -> SiLU
      -> x * sigmoid(conv1x1(mean over h, w)) -> grouped 3x3 (2 groups) -> dropout -> gap
      -> flatten -> fc [B, 10]
    """
    import torch
    from torch import nn

    class BNNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(8)
            self.relu6 = nn.ReLU6()
            self.dw = nn.Conv2d(8, 8, kernel_size=3, padding=1, groups=8, bias=False)
            self.bn2 = nn.BatchNorm2d(8)
            self.se = nn.Conv2d(8, 8, kernel_size=1)
            self.grouped = nn.Conv2d(8, 12, kernel_size=3, padding=1, groups=2)
            self.drop = nn.Dropout(dropout)
            self.gap = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(12, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.relu6(self.bn1(self.conv(x)))
            y = self.bn2(self.dw(y))
            y = y * torch.sigmoid(y)
            y = y * torch.sigmoid(self.se(y.mean(dim=(2, 3), keepdim=True)))
            y = self.grouped(y)
            return self.fc(torch.flatten(self.gap(self.drop(y)), 1))

    torch.manual_seed(seed)
    return BNNet()


def build_branches(seed: int = 0):
    """Two conv -> BatchNorm -> ReLU branches from one input (Inception's, a ResNet
    block's two paths), added, then a conv -> BatchNorm that depends on both: torch
    writes the branches one after the other, and the importer puts their independent
    BatchNorms side by side, whose statistics then share a ring (issue 45); the last
    BatchNorm keeps its own.

    [B, 3, 8, 8] -> (conv 3x3 -> BN -> ReLU) + (conv 1x1 -> BN -> ReLU) -> conv 1x1 -> BN
      -> ReLU -> mean over h, w -> fc [B, 5]
    """
    import torch
    from torch import nn

    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 6, kernel_size=3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(6)
            self.conv2 = nn.Conv2d(3, 6, kernel_size=1, bias=False)
            self.bn2 = nn.BatchNorm2d(6)
            self.conv3 = nn.Conv2d(6, 4, kernel_size=1, bias=False)
            self.bn3 = nn.BatchNorm2d(4)
            self.fc = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = torch.relu(self.bn1(self.conv1(x)))
            b = torch.relu(self.bn2(self.conv2(x)))
            y = torch.relu(self.bn3(self.conv3(a + b)))
            return self.fc(y.mean(dim=(2, 3)))

    torch.manual_seed(seed)
    return Branches()


def build_tokens(seed: int = 0, vocabulary: int = 50, width: int = 16, classes: int = 5):
    """A token classifier: ids [B, T] (int64) -> Embedding -> LayerNorm -> GELU -> Linear
    -> token logits [B, T, classes] (the loss: cross-entropy over the last axis)."""
    import torch
    from torch import nn

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocabulary, width)
            self.norm = nn.LayerNorm(width)
            self.act = nn.GELU()
            self.head = nn.Linear(width, classes)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.act(self.norm(self.embed(ids))))

    torch.manual_seed(seed)
    return Tokens()


def build_tied(seed: int = 0, vocabulary: int = 40, width: int = 12):
    """A language-model head tied to its embedding, as GPT-2's: ids [B, T] -> Embedding
    -> LayerNorm -> Linear(width, vocabulary) whose weight IS the embedding's -> token
    logits [B, T, vocabulary]."""
    import torch
    from torch import nn

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocabulary, width)
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocabulary, bias=False)
            self.head.weight = self.embed.weight  # tied

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.embed(ids)))

    torch.manual_seed(seed)
    return Tied()


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[[], nn.Module]
    sample_shape: tuple[int, ...]  # one sample, without the batch axis
    output_name: str
    ids: int = 0  # > 0: the input is int64 token ids below this


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(build_mlp, (32,), "logits"),
    "cnn": ModelSpec(build_cnn, (3, 32, 32), "logits"),
    "spatial": ModelSpec(build_spatial, (3, 32, 32), "logits"),
    "matmul": ModelSpec(build_matmul, (6, 16), "output"),
    "bnnet": ModelSpec(build_bnnet, (3, 16, 16), "logits"),
    "branches": ModelSpec(build_branches, (3, 8, 8), "logits"),
    "tokens": ModelSpec(build_tokens, (6,), "logits", ids=50),
    "tied": ModelSpec(build_tied, (6,), "logits", ids=40),
}


def example_input(name: str, batch: int = 2, seed: int = 1) -> torch.Tensor:
    """A random input batch for model ``name``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    spec = MODELS[name]
    if spec.ids:
        return torch.randint(0, spec.ids, (batch, *spec.sample_shape), generator=generator)
    return torch.randn(batch, *spec.sample_shape, generator=generator)


# --- export ------------------------------------------------------------------------------


def _as_tuple(example: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    import torch

    return (example,) if isinstance(example, torch.Tensor) else tuple(example)


def _batched_outputs(model: nn.Module, args: tuple, output_names: Sequence[str]) -> list[str]:
    """Names of the outputs that have a batch axis (a scalar loss has none)."""
    import torch

    with torch.no_grad():
        outs = model(*args)
    outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    return [n for n, o in zip(output_names, outs, strict=True) if o.dim() > 0]


def export_legacy(
    model: nn.Module,
    args: tuple[torch.Tensor, ...],
    path: Path,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_batch: bool = True,
    opset: int = LEGACY_OPSET,
) -> Path:
    """TorchScript export in training mode, as a user exporting a model to train would."""
    import torch

    dynamic_axes = None
    if dynamic_batch:
        batched = [*input_names, *_batched_outputs(model, args, output_names)]
        dynamic_axes = {name: {0: "batch"} for name in batched}
    model.train()
    with warnings.catch_warnings():
        # The legacy exporter is what is being tested; its deprecation notice is noise.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model,
            args,
            str(path),
            dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            opset_version=opset,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_axes=dynamic_axes,
        )
    return path


def export_dynamo(
    model: nn.Module,
    args: tuple[torch.Tensor, ...],
    path: Path,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_batch: bool = True,
    opset: int = DYNAMO_OPSET,
    optimize: bool = True,
) -> Path:
    """torch.export-based export; weights go to ``<path>.data`` beside the model.
    ``optimize=False`` keeps weights as the model has them (the optimizer may store a
    tied weight as two initializers, one transposed)."""
    import torch

    dynamic_shapes = None
    if dynamic_batch:
        batch = torch.export.Dim("batch")  # one Dim object: every input shares the batch
        dynamic_shapes = tuple({0: batch} for _ in args)
    model.train()
    with warnings.catch_warnings():
        # Training mode is intended (the graph is to be trained); torch.export's internal
        # deprecation notices are not ours to fix.
        warnings.filterwarnings("ignore", "Exporting a model while it is in training mode")
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model,
            args,
            str(path),
            dynamo=True,
            optimize=optimize,
            dynamic_shapes=dynamic_shapes,
            external_data=True,
            opset_version=opset,
            input_names=list(input_names),
            output_names=list(output_names),
            verbose=False,
        )
    return path


def export(
    model: nn.Module,
    example_input: torch.Tensor | Sequence[torch.Tensor],
    path: Path | str,
    exporter: Exporter = "legacy",
    *,
    input_names: Sequence[str] = ("input",),
    output_names: Sequence[str] = ("output",),
    dynamic_batch: bool = True,
    opset: int | None = None,
    optimize: bool = True,
) -> Path:
    """Export ``model`` to ``path`` with a symbolic batch axis named "batch".

    ``legacy``: TorchScript exporter, training mode, no constant folding, weights inside
    the file. ``dynamo``: torch.export-based exporter, weights in ``<path>.data``.
    ``dynamic_batch=False`` fixes the batch at the example's; ``optimize`` is dynamo's.
    """
    args = _as_tuple(example_input)
    path = Path(path)
    if exporter == "legacy":
        fn = export_legacy
        opset = LEGACY_OPSET if opset is None else opset
    elif exporter == "dynamo":
        fn = export_dynamo
        opset = DYNAMO_OPSET if opset is None else opset
    else:
        raise ValueError(f"exporter must be one of {EXPORTERS}, got {exporter!r}")
    if exporter == "dynamo":
        return export_dynamo(
            model, args, path, input_names, output_names, dynamic_batch, opset, optimize
        )
    return fn(model, args, path, input_names, output_names, dynamic_batch, opset)


def export_named(name: str, directory: Path, exporter: Exporter = "legacy", batch: int = 2) -> Path:
    """Build model ``name`` of ``MODELS`` and export it to ``directory/<name>_<exporter>.onnx``."""
    spec = MODELS[name]
    path = Path(directory) / f"{name}_{exporter}.onnx"
    return export(
        spec.build(),
        example_input(name, batch),
        path,
        exporter,
        output_names=(spec.output_name,),
    )
