"""One step's data on one rank, and the divisor of a mean loss over the whole batch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from onnx2soap.ir import Graph
from onnx2soap.ops import definition


@dataclass(frozen=True)
class Batch:
    """One step's data on one rank: for every data input by name (floats already in the
    run's dtype, ids int64) and for the labels, the rows from ``first_row[name]`` on
    that this rank's tasks read (all rows when ``first_row`` lacks the name)."""

    inputs: Mapping[str, np.ndarray]
    labels: np.ndarray
    step: int = 0  # numbers the random ops' draws
    first_row: Mapping[str, int] = field(default_factory=dict)
    loss_scale: float | None = None  # a mean loss's divisor over the whole batch

    def rows(self, name: str, labels_name: str | None) -> tuple[np.ndarray, int]:
        held = self.labels if name == labels_name else self.inputs[name]
        return held, self.first_row.get(name, 0)


def loss_scale(graph: Graph, labels: np.ndarray) -> float:
    """The divisor of a mean loss over the whole batch (each kernel sees only its part)."""
    loss = graph.loss_op
    scale = definition(loss.type).loss_scale
    return scale(loss.attrs, labels, graph.tensors[loss.inputs[0]].shape)
