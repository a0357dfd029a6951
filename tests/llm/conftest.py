"""The families of ``tests/llm/zoo.py``, each exported once per session (float64, seeded).

``llm_onnx(name, exporter="dynamo")`` -> the exported file, cached. Skips without torch,
or without transformers for the families that need it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

LlmOnnx = Callable[..., Path]


@pytest.fixture(scope="session")
def llm_onnx(tmp_path_factory: pytest.TempPathFactory) -> LlmOnnx:
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    from tests.llm.reference import one_torch_thread
    from tests.llm.zoo import FAMILIES, export_family

    directory = tmp_path_factory.mktemp("llm")
    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, exporter: str = "dynamo") -> Path:
        if FAMILIES[name].transformers:
            pytest.importorskip("transformers")
        if (name, exporter) not in cache:
            with one_torch_thread():
                cache[(name, exporter)] = export_family(name, directory, exporter)
        return cache[(name, exporter)]

    return get
