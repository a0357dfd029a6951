"""One step's data on one rank, and the divisor of a mean loss over the whole batch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from onnx2soap.ir import Graph
from onnx2soap.ops import definition


@dataclass(frozen=True)
class Batch:
    """One step's data on one rank: for every data input by name (floats already in the
    run's dtype, ids int64) and for the labels, the rows from ``first_row[name]`` on
    that this rank's tasks read (all rows when ``first_row`` lacks the name). A step of
    ``microbatches`` (a pipeline's) holds those rows of each microbatch in turn, as many
    per microbatch: ``microbatch(m)`` is microbatch ``m``'s part."""

    inputs: Mapping[str, np.ndarray]
    labels: np.ndarray
    step: int = 0  # numbers the random ops' draws
    first_row: Mapping[str, int] = field(default_factory=dict)
    loss_scale: float | None = None  # a mean loss's divisor over the whole batch
    microbatches: int = 1

    def rows(self, name: str, labels_name: str | None) -> tuple[np.ndarray, int]:
        held = self.labels if name == labels_name else self.inputs[name]
        return held, self.first_row.get(name, 0)

    def microbatch(self, m: int) -> Batch:
        """Microbatch ``m``'s rows (views), with the step's number and loss divisor."""
        if self.microbatches == 1:
            return self
        return replace(
            self,
            inputs={name: _part(rows, m, self.microbatches) for name, rows in self.inputs.items()},
            labels=_part(self.labels, m, self.microbatches),
            microbatches=1,
        )


def _part(rows: np.ndarray, m: int, microbatches: int) -> np.ndarray:
    n = len(rows) // microbatches
    return rows[m * n : (m + 1) * n]


def loss_scale(graph: Graph, labels: np.ndarray, microbatches: int = 1) -> float:
    """The divisor of a mean loss over the whole batch (each kernel sees only its part):
    ``labels`` are the step's, ``graph`` a microbatch's when the step has
    ``microbatches`` (its prediction then holds that many times the graph's elements)."""
    loss = graph.loss_op
    scale = definition(loss.type).loss_scale
    shape = graph.tensors[loss.inputs[0]].shape
    if microbatches > 1:
        shape = (shape[0] * microbatches, *shape[1:])
    return scale(loss.attrs, labels, shape)
