"""ONNX -> ``Graph``: load, bind the batch, fold constants, convert nodes, attach the loss.

model = load_model(Path("cnn.onnx"), batch=64)
model.graph   # onnx2soap.ir.Graph
model.weights # initial values of the trainable weights, by initializer name
model.state   # initial values of the state tensors (BatchNorm's running statistics)
model.constants # values of the float constants the ops read
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    state: dict[str, np.ndarray] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)


def _constant(value: np.ndarray, tensor) -> np.ndarray:
    """A constant's value in its IR dtype: masks are 0/1 floats, ids int64."""
    if value.dtype == np.bool_:
        return value.astype(np.float32)
    return value if tensor.dtype.is_float else value.astype(np.int64)


def load_model(
    path: Path | str,
    batch: int | None = None,
    loss: LossKind | None = None,
    *,
    allow_nonfinite: bool = False,
) -> ImportedModel:
    """``loss=None`` keeps the model's own loss, or attaches cross-entropy if it has none.
    NaN/Inf in float initializers are refused unless ``allow_nonfinite``."""
    prepared = prepare(Path(path), batch, allow_nonfinite=allow_nonfinite)
    graph = build_graph(prepared, loss)
    values = {**prepared.float_initializers, **prepared.constants}
    weights = {t.name: values[t.name] for t in graph.weights}
    state = {t.name: values[t.name] for t in graph.states}
    # Masks are 0/1 floats in the IR: a bool constant's value is given as one.
    constants = {t.name: _constant(values[t.name], t) for t in graph.constants}
    return ImportedModel(Path(path), prepared.sha256, graph, weights, state, constants)
