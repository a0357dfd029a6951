"""Benchmark models exported once into build/benchmarks/ (torch is a dev extra).

- ``cnn``: the bundled example (examples/cnn.onnx), nothing to export;
- ``alexnet``: AlexNet's layer shapes (Krizhevsky 2014, the model FlexFlow's AlexNet
  numbers use) without dropout, whose training-mode export onnx2soap does not import yet;
- ``mlp``: a wide three-layer perceptron, parameter-heavy like NMT's softmax layer;
- ``resnet50``: torchvision's ResNet-50 at 10 classes on 32x32 inputs (a toy input for
  its 161 weight tensors, the gradient buckets' benchmark).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "benchmarks"


def _alexnet():
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 64, 11, stride=4, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(64, 192, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(192, 384, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(384, 256, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(256, 256, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Flatten(),
        nn.Linear(256 * 6 * 6, 4096),
        nn.ReLU(),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Linear(4096, 1000),
    ), (3, 224, 224)


def _mlp():
    from torch import nn

    return nn.Sequential(
        nn.Linear(1024, 8192), nn.ReLU(), nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 1000)
    ), (1024,)


def _resnet50():
    from benchmarks.suite_models import _torchvision

    return _torchvision().models.resnet50(num_classes=10), (3, 32, 32)


BUILDERS = {"alexnet": _alexnet, "mlp": _mlp, "resnet50": _resnet50}


def model_path(name: str) -> Path:
    """The ONNX file of a benchmark model, exported on first use."""
    if name == "cnn":
        return ROOT / "examples" / "cnn.onnx"
    path = BUILD / f"{name}.onnx"
    if not path.exists():
        import torch

        torch.manual_seed(0)
        model, shape = BUILDERS[name]()
        BUILD.mkdir(parents=True, exist_ok=True)
        torch.onnx.export(
            model,
            (torch.randn(2, *shape),),
            str(path),
            dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING,
            opset_version=17,
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        )
    return path
