"""ONNX -> ``Graph``: load, bind the batch, fold constants, convert nodes, attach the loss.

model = load_model(Path("cnn.onnx"), batch=64)
model.graph     # onnx2soap.ir.Graph
model.weights   # where each trainable weight's bytes are (``StoredTensor``), by name
model.state     # the same for the state tensors (BatchNorm's running statistics)
model.constants # the float and id constants the ops read: values, or where they are stored

Nothing here reads a weight's bytes: planning needs shapes and dtypes only. A
``StoredTensor`` is read where values are needed (the executor, box by box:
``tensor.read(box)``; ``tensor[slices]`` and ``np.asarray(tensor)`` for code written for
arrays).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnx2soap.importer.build import build_graph
from onnx2soap.importer.prepare import file_sha256, prepare
from onnx2soap.importer.weights import StoredTensor
from onnx2soap.ir import Graph, LossKind, Tensor

__all__ = ["ImportedModel", "StoredTensor", "file_sha256", "load_model"]

Value = np.ndarray | StoredTensor  # a value, or where its bytes are (read on demand)


@dataclass(frozen=True)
class ImportedModel:
    path: Path
    sha256: str
    graph: Graph
    weights: Mapping[str, StoredTensor]
    state: Mapping[str, StoredTensor] = field(default_factory=dict)
    constants: Mapping[str, Value] = field(default_factory=dict)

    def values(self) -> dict[str, np.ndarray]:
        """Every weight's and state tensor's whole value, read now: for small models and
        tests (the executor reads only its ranks' boxes)."""
        return {name: t.read() for name, t in {**self.weights, **self.state}.items()}


def _constant(value: np.ndarray, tensor: Tensor) -> np.ndarray:
    """A constant's value in its IR dtype: masks are 0/1 floats, ids int64."""
    if value.dtype == np.bool_:
        return value.astype(np.float32)
    return value if tensor.dtype.is_float else value.astype(np.int64)


def load_model(
    path: Path | str, batch: int | None = None, loss: LossKind | None = None
) -> ImportedModel:
    """``loss=None`` keeps the model's own loss, or attaches cross-entropy if it has none.
    Reads the graph, shapes and dtypes, and the values of folded constants only."""
    prepared = prepare(Path(path), batch)
    graph = build_graph(prepared, loss)
    stored = prepared.float_initializers
    weights = {t.name: stored[t.name] for t in graph.weights}
    state = {t.name: stored[t.name] for t in graph.states}
    # Masks are 0/1 floats in the IR: a bool constant's value is given as one. A float
    # initializer an op reads as a constant (BatchNorm's statistics in inference mode)
    # stays where it is stored.
    constants: dict[str, Value] = {
        t.name: stored[t.name] if t.name in stored else _constant(prepared.constants[t.name], t)
        for t in graph.constants
    }
    return ImportedModel(Path(path), prepared.sha256, graph, weights, state, constants)
