"""Session-wide fixtures: ONNX files exported once per test session from ``tests/models.py``.

``mlp_onnx``, ``cnn_onnx``, ``spatial_onnx`` and ``matmul_onnx`` are legacy exports by
default; choose the exporter with indirect parametrization:

    @pytest.mark.parametrize("cnn_onnx", ["legacy", "dynamo"], indirect=True)
    def test_something(cnn_onnx: Path): ...

``export_model(name, exporter)`` gives any model of ``tests.models.MODELS``. Every file is
exported once per session and shared, so tests must not modify them. Without torch these
fixtures skip; ``example_onnx`` (the committed ``examples/cnn.onnx``) never needs torch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.models import EXPORTERS, Exporter, export_named
from tests.optional import require

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_ONNX = REPO / "examples" / "cnn.onnx"

ExportModel = Callable[[str, Exporter], Path]


@pytest.fixture(scope="session")
def export_model(tmp_path_factory: pytest.TempPathFactory) -> ExportModel:
    """``export_model(name, exporter="legacy") -> Path``, cached for the session."""
    require("torch")
    directory = tmp_path_factory.mktemp("exported")
    cache: dict[tuple[str, str], Path] = {}

    def export(name: str, exporter: Exporter = "legacy") -> Path:
        if exporter not in EXPORTERS:
            raise ValueError(f"exporter must be one of {EXPORTERS}, got {exporter!r}")
        key = (name, exporter)
        if key not in cache:
            cache[key] = export_named(name, directory, exporter)
        return cache[key]

    return export


def _exporter(request: pytest.FixtureRequest) -> Exporter:
    return getattr(request, "param", "legacy")


@pytest.fixture(scope="session")
def mlp_onnx(export_model: ExportModel, request: pytest.FixtureRequest) -> Path:
    """[B, 32] -> three Gemm layers with Relu between -> logits [B, 10]."""
    return export_model("mlp", _exporter(request))


@pytest.fixture(scope="session")
def cnn_onnx(export_model: ExportModel, request: pytest.FixtureRequest) -> Path:
    """The example CNN (examples/cnn.py), exported afresh."""
    return export_model("cnn", _exporter(request))


@pytest.fixture(scope="session")
def spatial_onnx(export_model: ExportModel, request: pytest.FixtureRequest) -> Path:
    """Strided, dilated, padded convs and pools (tests.models.build_spatial).

    The dynamo exporter lowers its global average pool to ReduceMean.
    """
    return export_model("spatial", _exporter(request))


@pytest.fixture(scope="session")
def matmul_onnx(export_model: ExportModel, request: pytest.FixtureRequest) -> Path:
    """x [B, 6, 16] @ weight [16, 24] + bias -> [B, 6, 24]."""
    return export_model("matmul", _exporter(request))


@pytest.fixture(scope="session")
def example_onnx() -> Path:
    """The committed examples/cnn.onnx (symbolic batch; pass batch= when loading)."""
    if not EXAMPLE_ONNX.is_file():
        pytest.fail(f"{EXAMPLE_ONNX} is missing: run `python examples/cnn.py`")
    return EXAMPLE_ONNX
