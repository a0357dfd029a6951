"""Reduced-width torchvision models for the importer tests, and their export helpers.

Each family is built from torchvision's own classes (so the exported graphs have the real
torchvision op patterns: BatchNormalization, Dropout, ReLU6/Clip, SiLU, squeeze-excitation,
channel shuffle, dense concatenation, stochastic depth...) but at a fraction of the width
and on small images, so that export plus one forward/backward takes well under a second
or two on a small CPU.

    model, example = build_family("mobilenet_v2", seed=0, dropout=0.0)
    path = export_family("efficientnet_b0", tmp_dir, "legacy")

Torch and torchvision are imported inside the functions only, so importing this module is
free and works without them. Nothing is cached here; the pytest fixtures cache exports.

torchvision 0.28.0 from PyPI is a CUDA build: with a CPU-only torch its import fails while
registering meta kernels in ``torchvision._meta_registrations``. ``import_torchvision``
stubs that module out first (the models do not need it).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tests.models import Exporter, export

if TYPE_CHECKING:
    import torch
    from torch import nn


def import_torchvision() -> types.ModuleType:
    """``import torchvision``, tolerating a CUDA torchvision wheel on a CPU-only torch."""
    if "torchvision" not in sys.modules:
        name = "torchvision._meta_registrations"
        sys.modules.setdefault(name, types.ModuleType(name))
    import torchvision

    return torchvision


# --- families ---------------------------------------------------------------------------


def _no_option(family: str, dropout: float | None, stochastic_depth: float | None) -> None:
    if dropout is not None:
        raise ValueError(f"{family} has no dropout")
    if stochastic_depth is not None:
        raise ValueError(f"{family} has no stochastic depth")


def build_resnet18(classes: int, dropout: float | None, stochastic_depth: float | None):
    """ResNet with torchvision's BasicBlock, one block per stage, widths 16-32-64-128.

    torchvision's ``ResNet`` hard-codes 64..512 channels, so this subclass redoes only its
    constructor (same layer names, same init) and keeps its ``_make_layer`` and ``forward``.
    """
    _no_option("resnet18", dropout, stochastic_depth)
    import_torchvision()
    from torch import nn
    from torchvision.models.resnet import BasicBlock, ResNet

    class SmallResNet(ResNet):
        def __init__(self, widths: tuple[int, int, int, int], layers: list[int]) -> None:
            nn.Module.__init__(self)
            self._norm_layer = nn.BatchNorm2d
            self.inplanes = widths[0]
            self.dilation = 1
            self.groups = 1
            self.base_width = 64
            self.conv1 = nn.Conv2d(3, widths[0], kernel_size=7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(widths[0])
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
            self.layer1 = self._make_layer(BasicBlock, widths[0], layers[0])
            self.layer2 = self._make_layer(BasicBlock, widths[1], layers[1], stride=2)
            self.layer3 = self._make_layer(BasicBlock, widths[2], layers[2], stride=2)
            self.layer4 = self._make_layer(BasicBlock, widths[3], layers[3], stride=2)
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(widths[3] * BasicBlock.expansion, classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.constant_(m.weight, 1)
                    nn.init.constant_(m.bias, 0)

    return SmallResNet((16, 32, 64, 128), [1, 1, 1, 1])


def build_mobilenet_v2(classes: int, dropout: float | None, stochastic_depth: float | None):
    """MobileNetV2 at width 0.25 with one inverted residual per stage, except two in the
    24-channel stage so that a residual Add remains (ReLU6 -> Clip, depthwise convs)."""
    _no_option("mobilenet_v2", None, stochastic_depth)
    import_torchvision()
    from torchvision.models import MobileNetV2

    # t (expansion), c (channels), n (repeats), s (first stride), as in torchvision
    setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 1, 2], [6, 64, 1, 2], [6, 96, 1, 1]]
    setting += [[6, 160, 1, 2], [6, 320, 1, 1]]
    return MobileNetV2(
        num_classes=classes,
        width_mult=0.25,
        inverted_residual_setting=setting,
        dropout=_or(dropout, 0.2),
    )


def build_squeezenet1_1(classes: int, dropout: float | None, stochastic_depth: float | None):
    """SqueezeNet 1.1 at full width (torchvision has no width option; 0.7M weights)."""
    _no_option("squeezenet1_1", None, stochastic_depth)
    import_torchvision()
    from torchvision.models import SqueezeNet

    return SqueezeNet(version="1_1", num_classes=classes, dropout=_or(dropout, 0.5))


def build_shufflenet_v2_x0_5(classes: int, dropout: float | None, stochastic_depth: float | None):
    """ShuffleNetV2 with two units per stage (the second one splits channels) at 8..128."""
    _no_option("shufflenet_v2_x0_5", dropout, stochastic_depth)
    import_torchvision()
    from torchvision.models import ShuffleNetV2

    return ShuffleNetV2([2, 2, 2], [8, 16, 32, 64, 128], num_classes=classes)


def build_densenet121(classes: int, dropout: float | None, stochastic_depth: float | None):
    """DenseNet with growth 8, two layers per dense block, 16 initial features, bn_size 2."""
    _no_option("densenet121", None, stochastic_depth)
    import_torchvision()
    from torchvision.models import DenseNet

    return DenseNet(
        growth_rate=8,
        block_config=(2, 2, 2, 2),
        num_init_features=16,
        bn_size=2,
        drop_rate=_or(dropout, 0.0),
        num_classes=classes,
    )


def build_inception_v3(classes: int, dropout: float | None, stochastic_depth: float | None):
    """Inception v3 with every conv a quarter as wide, no aux head; needs >= 75x75 input.

    Inception3 hard-codes its channel counts, but every one of them is divisible by 4 and
    all of them go through the ``conv_block`` it is given, so a conv block that divides
    both channel counts by 4 (except the 3 image channels) scales the whole network.
    """
    _no_option("inception_v3", None, stochastic_depth)
    import_torchvision()
    from torch import nn
    from torchvision.models.inception import (
        BasicConv2d,
        Inception3,
        InceptionA,
        InceptionAux,
        InceptionB,
        InceptionC,
        InceptionD,
        InceptionE,
    )

    factor = 4

    def quarter(channels: int) -> int:
        if channels == 3:
            return 3
        if channels % factor:
            raise ValueError(f"inception channel count {channels} not divisible by {factor}")
        return channels // factor

    class QuarterConv2d(BasicConv2d):
        def __init__(self, in_channels: int, out_channels: int, **kwargs) -> None:
            super().__init__(quarter(in_channels), quarter(out_channels), **kwargs)

    def block(cls):
        return lambda *args, **kwargs: cls(*args, conv_block=QuarterConv2d, **kwargs)

    blocks = [QuarterConv2d, *(block(c) for c in (InceptionA, InceptionB, InceptionC))]
    blocks += [block(InceptionD), block(InceptionE), block(InceptionAux)]
    model = Inception3(
        num_classes=classes,
        aux_logits=False,
        inception_blocks=blocks,
        init_weights=False,
        dropout=_or(dropout, 0.5),
    )
    model.fc = nn.Linear(2048 // factor, classes)
    return model


def build_efficientnet_b0(classes: int, dropout: float | None, stochastic_depth: float | None):
    """EfficientNet-B0 at width 0.25 and depth 0.5 (SiLU, squeeze-excitation, stochastic
    depth in the residual blocks, classifier dropout)."""
    import_torchvision()
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf

    setting, last_channel = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.5)
    return EfficientNet(
        setting,
        dropout=_or(dropout, 0.2),
        stochastic_depth_prob=_or(stochastic_depth, 0.2),
        num_classes=classes,
        last_channel=last_channel,
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


@dataclass(frozen=True)
class Family:
    build: Callable[[int, float | None, float | None], nn.Module]
    sample_shape: tuple[int, ...]  # one sample, without the batch axis
    has_dropout: bool
    has_stochastic_depth: bool


FAMILIES: dict[str, Family] = {
    "resnet18": Family(build_resnet18, (3, 32, 32), False, False),
    "mobilenet_v2": Family(build_mobilenet_v2, (3, 32, 32), True, False),
    "squeezenet1_1": Family(build_squeezenet1_1, (3, 32, 32), True, False),
    "shufflenet_v2_x0_5": Family(build_shufflenet_v2_x0_5, (3, 32, 32), False, False),
    "densenet121": Family(build_densenet121, (3, 32, 32), True, False),
    "inception_v3": Family(build_inception_v3, (3, 75, 75), True, False),
    "efficientnet_b0": Family(build_efficientnet_b0, (3, 32, 32), True, True),
}
CLASSES = 10


def build_family(
    name: str,
    seed: int = 0,
    dropout: float | None = None,
    stochastic_depth: float | None = None,
    batch: int = 2,
) -> tuple[nn.Module, torch.Tensor]:
    """Build family ``name`` (seeded, in train mode) and a random input batch for it.

    ``dropout`` / ``stochastic_depth``: the drop probabilities, for the families that have
    them (``FAMILIES[name].has_dropout`` / ``has_stochastic_depth``); None keeps
    torchvision's default (mobilenet_v2 0.2, squeezenet1_1 0.5, densenet121 0.0,
    inception_v3 0.5, efficientnet_b0 0.2 and 0.2). Giving one to a family without it
    raises ValueError.
    """
    import torch

    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    family = FAMILIES[name]
    torch.manual_seed(seed)
    model = family.build(CLASSES, dropout, stochastic_depth)
    model.train()
    generator = torch.Generator().manual_seed(seed + 1)
    example = torch.randn(batch, *family.sample_shape, generator=generator)
    return model, example


def export_family(
    name: str,
    directory: Path | str,
    exporter: Exporter = "legacy",
    batch: int = 2,
    *,
    seed: int = 0,
    dropout: float | None = None,
    stochastic_depth: float | None = None,
) -> Path:
    """Build family ``name`` and export it to ``directory/<name>_<exporter>.onnx``.

    Exported with ``tests.models.export``: input "input", output "output", symbolic batch
    axis "batch"; legacy in TRAINING mode without constant folding (opset 17), dynamo at
    opset 18 with the weights in ``<path>.data``.
    """
    model, example = build_family(name, seed, dropout, stochastic_depth, batch)
    path = Path(directory) / f"{name}_{exporter}.onnx"
    return export(model, example, path, exporter, output_names=("output",))
