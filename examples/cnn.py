"""A small branching CNN, exported to ``examples/cnn.onnx`` for onnx2soap to plan.

    python examples/cnn.py            # re-export examples/cnn.onnx (deterministic)
    onnx2soap inspect examples/cnn.onnx --batch 32

The graph covers the ops onnx2soap converts: Conv, Relu, MaxPool, AveragePool, Concat,
Flatten and Gemm. Module names become ONNX node names (``/branch_a/conv/Conv``), so the
plan and the inspect table read like the code below.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from torch import nn

INPUT_SHAPE = (3, 32, 32)  # one sample: channels, height, width
NUM_CLASSES = 10
DEFAULT_OUTPUT = Path(__file__).with_name("cnn.onnx")


class BranchA(nn.Module):
    """3x3 convolution path of the inception-style block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv(x))


class BranchB(nn.Module):
    """Average pooling then a 1x1 convolution: the second path of the block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.pool = nn.AvgPool2d(kernel_size=3, stride=1, padding=1)
        self.conv = nn.Conv2d(channels, channels, kernel_size=1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv(self.pool(x)))


class SmallCNN(nn.Module):
    """[B, 3, 32, 32] -> logits [B, 10]; about 135K parameters."""

    def __init__(self, channels: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(INPUT_SHAPE[0], channels, kernel_size=3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(kernel_size=2)  # 32x32 -> 16x16
        self.branch_a = BranchA(channels)
        self.branch_b = BranchB(channels)
        self.pool2 = nn.MaxPool2d(kernel_size=2)  # 16x16 -> 8x8
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(2 * channels * 8 * 8, hidden)
        self.relu_fc = nn.ReLU()
        self.fc2 = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.relu1(self.conv1(x)))
        x = torch.cat([self.branch_a(x), self.branch_b(x)], dim=1)
        x = self.flatten(self.pool2(x))
        return self.fc2(self.relu_fc(self.fc1(x)))


def build_model(seed: int = 0) -> SmallCNN:
    """The model with weights fixed by ``seed``, so every export writes the same file."""
    torch.manual_seed(seed)
    return SmallCNN()


def export(model: nn.Module, path: Path, batch: int = 2) -> Path:
    """Legacy (TorchScript) export in training mode with a symbolic batch named 'batch'.

    Training mode keeps every parameter as a trainable initializer and turns off the
    exporter's constant folding, which is what onnx2soap expects of a model to train.
    """
    example = torch.randn(batch, *INPUT_SHAPE)
    with warnings.catch_warnings():
        # The legacy exporter is chosen on purpose; its deprecation notice is noise here.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            opset_version=17,
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    model = build_model()
    model.train()
    export(model, args.output)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.output}: {params} parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
