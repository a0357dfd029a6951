"""Sequence models (tests/sequence_models.py), exported once per session with dropout on
(0.1, attention dropout included: the masks must not depend on the plan).

``sequence_onnx(name, exporter)`` -> the exported file, cached. Skips without torch or
transformers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.optional import require

SequenceOnnx = Callable[[str, str], Path]
DROPOUT = 0.1
# torch's legacy exporter refuses an RNN's dropout in training mode ("Unsupported: ONNX
# export of operator RNN/GRU/LSTM, dropout in training mode"): those export without it.
NO_DROPOUT = {("lstm_lm", "legacy"), ("gru_classifier", "legacy")}


@pytest.fixture(scope="session")
def sequence_onnx(tmp_path_factory: pytest.TempPathFactory) -> SequenceOnnx:
    require("torch")
    require("transformers")
    from tests.sequence_models import export_sequence

    directory = tmp_path_factory.mktemp("sequences")
    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, exporter: str = "legacy") -> Path:
        if (name, exporter) not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the exporters' notes on tracing
                dropout = 0.0 if (name, exporter) in NO_DROPOUT else DROPOUT
                cache[(name, exporter)] = export_sequence(
                    name, directory, exporter, dropout=dropout
                )
        return cache[(name, exporter)]

    return get
