"""ONNX -> ``Graph``: load, bind the batch, fold constants, convert nodes, attach the loss.

model = load_model(Path("cnn.onnx"), batch=64)
model.graph   # onnx2soap.ir.Graph
model.weights # initial values of the trainable weights, by initializer name
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnx2soap.importer.build import build_graph
from onnx2soap.importer.prepare import file_sha256, prepare
from onnx2soap.ir import Graph, LossKind

__all__ = ["ImportedModel", "file_sha256", "load_model"]


@dataclass(frozen=True)
class ImportedModel:
    path: Path
    sha256: str
    graph: Graph
    weights: dict[str, np.ndarray]


def load_model(
    path: Path | str, batch: int | None = None, loss: LossKind | None = None
) -> ImportedModel:
    """``loss=None`` keeps the model's own loss, or attaches cross-entropy if it has none."""
    prepared = prepare(Path(path), batch)
    graph = build_graph(prepared, loss)
    weights = {t.name: prepared.float_initializers[t.name] for t in graph.weights}
    return ImportedModel(Path(path), prepared.sha256, graph, weights)
