"""Sequence models (tests/sequence_models.py), exported once per session.

``sequence_onnx(name, exporter)`` -> the exported file, cached. Skips without torch or
transformers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

SequenceOnnx = Callable[[str, str], Path]


@pytest.fixture(scope="session")
def sequence_onnx(tmp_path_factory: pytest.TempPathFactory) -> SequenceOnnx:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.sequence_models import export_sequence

    directory = tmp_path_factory.mktemp("sequences")
    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, exporter: str = "legacy") -> Path:
        if (name, exporter) not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the exporters' notes on tracing
                cache[(name, exporter)] = export_sequence(name, directory, exporter)
        return cache[(name, exporter)]

    return get
