"""The torchvision families, exported once per session (legacy TRAINING mode and dynamo).

``family_onnx(name, exporter)`` -> the exported file, cached. Skips without torch or
torchvision.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.models import Exporter
from tests.optional import require

FAMILIES = (
    "resnet18",
    "mobilenet_v2",
    "squeezenet1_1",
    "shufflenet_v2_x0_5",
    "densenet121",
    "inception_v3",
    "efficientnet_b0",
)
# BatchNorm over a batch of 4 on 1x1 feature maps averages 4 numbers per channel: so
# ill-conditioned that two summation orders part at 1e-9 after two steps. At 8 they agree
# to 1e-10, the contract.
BATCH = 8

FamilyOnnx = Callable[[str, Exporter], Path]


@pytest.fixture(scope="session")
def family_onnx(tmp_path_factory: pytest.TempPathFactory) -> FamilyOnnx:
    require("torch")
    from tests.torchvision_models import export_family, import_torchvision

    try:
        import_torchvision()
    except ModuleNotFoundError as e:  # not installed; a broken install fails the tests
        if e.name != "torchvision":
            raise
        pytest.skip(f"torchvision: {e}")
    directory = tmp_path_factory.mktemp("families")
    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, exporter: Exporter = "legacy") -> Path:
        if (name, exporter) not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the exporters' notes on training mode
                cache[(name, exporter)] = export_family(name, directory, exporter)
        return cache[(name, exporter)]

    return get
