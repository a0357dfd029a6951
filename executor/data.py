"""Synthetic training data drawn from the seed, and what all data sources share.

Every graph input that is not an initializer is a data input batched along axis 0:
float data, or int64 ids (tokens, masks). A rank holds only the rows its tasks read (one
span per input, from ``rows_needed``); the labels are read whole to count the batch's
labels for a mean loss, and cut like the inputs.

Synthetic data draws every sample from its own stream (seed, step, row), so a rank makes
its rows alone and gets what one device holding the batch would.

A pipeline's step holds ``microbatches`` microbatches of consecutive samples, each the
graph's batch: a rank's rows are its span of every microbatch (``Batch.microbatch``), and
the labels (whole) and a mean loss's divisor are the step's, so the step trains on what
a plan without a pipeline reads at the same step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

# Imported here, not on first use (numpy loads it lazily): about 0.6 MB of modules that
# a traced run would otherwise count in every rank's peak memory.
from numpy.random import default_rng

from executor.batch import Batch, loss_scale
from onnx2soap.ir import DType, Graph
from onnx2soap.ops import definition
from onnx2soap.soap import PartitionedGraph

MASK_BOUND = 2  # ids no op bounds (attention masks, token types) are drawn in [0, 2)


def rows_needed(pg: PartitionedGraph, rank: int) -> dict[str, tuple[int, int]]:
    """Per data input (and the labels), the span of batch rows the rank's tasks read."""
    return pg.data_rows(rank)


def _scale(graph: Graph, labels: np.ndarray, microbatches: int) -> float | None:
    return loss_scale(graph, labels, microbatches) if graph.loss_op is not None else None


def _label_shape(graph: Graph, microbatches: int = 1) -> tuple[int, ...]:
    """The labels' shape in a step of ``microbatches`` (their batch is axis 0)."""
    shape = graph.tensors[graph.labels].shape
    return (shape[0] * microbatches, *shape[1:])


def step_rows(graph: Graph, span: tuple[int, int], microbatches: int) -> list[int]:
    """The step's rows of a span of a microbatch's rows, in every microbatch in turn."""
    lo, hi = span
    return [m * graph.batch + r for m in range(microbatches) for r in range(lo, hi)]


def _classes(graph: Graph) -> int | None:
    """Class ids are integer labels, below the size of the scores' class axis."""
    loss = graph.loss_op
    if graph.tensors[graph.labels].dtype is DType.INT64:
        return graph.tensors[loss.inputs[0]].shape[loss.attrs.class_axis]
    return None


def id_bound(graph: Graph, name: str) -> int:
    """Valid ids of integer tensor ``name`` are below this: the smallest bound any op that
    reads it states (an embedding's row count), following ops that only move values
    (a reshape of the ids), else that of a 0/1 mask."""
    bound = _stated_bound(graph, name)
    return MASK_BOUND if bound is None else bound


def _stated_bound(graph: Graph, name: str) -> int | None:
    bounds = []
    for op in graph.ops:
        d = definition(op.type)
        for k, t in enumerate(op.inputs):
            if t != name:
                continue
            bound = d.id_bound(op, k, graph.tensors) if d.id_bound is not None else None
            if bound is None and d.moves_values:  # ids moved on their way to an embedding
                bound = _stated_bound(graph, op.output)
            bounds.append(bound)
    found = [b for b in bounds if b is not None]
    return min(found) if found else None


@dataclass(frozen=True)
class SyntheticData:
    graph: Graph
    seed: int
    dtype: np.dtype
    microbatches: int = 1  # a pipeline's: a step is this many graph batches

    def _sample(self, name: str, step: int, row: int) -> np.ndarray:
        t = self.graph.tensors[name]
        rng = default_rng([self.seed, step, row, self.graph.inputs.index(name)])
        if t.dtype.is_float:
            return rng.standard_normal(t.shape[1:]).astype(self.dtype)
        return rng.integers(0, id_bound(self.graph, name), t.shape[1:], np.int64)

    def _labels(self, step: int) -> np.ndarray:
        # (seed, step): a stream apart from every row's (seed, step, row, input).
        rng = default_rng([self.seed, step])
        classes = _classes(self.graph)
        if classes is not None:
            shape = _label_shape(self.graph, self.microbatches)
            return rng.integers(0, classes, size=shape, dtype=np.int64)
        return rng.standard_normal(_label_shape(self.graph, self.microbatches)).astype(self.dtype)

    def batch(self, step: int, rows: Mapping[str, tuple[int, int]] | None = None) -> Batch:
        """The rows ``rows`` names of each input (every row when None)."""
        rows = rows if rows is not None else _all_rows(self.graph)
        inputs = {
            name: np.stack(
                [
                    self._sample(name, step, r)
                    for r in step_rows(self.graph, span, self.microbatches)
                ]
            )
            for name, span in rows.items()
            if name in self.graph.inputs
        }
        return _cut(self.graph, inputs, self._labels(step), step, rows, self.microbatches)


def _all_rows(graph: Graph) -> dict[str, tuple[int, int]]:
    names = (*graph.inputs, graph.labels) if graph.labels else graph.inputs
    return {name: (0, graph.batch) for name in names}


def _cut(graph: Graph, inputs, labels: np.ndarray, step: int, rows, microbatches: int) -> Batch:
    """A batch of the given input rows, with the labels' rows cut from the whole labels
    (which give a mean loss its divisor)."""
    span = rows.get(graph.labels, (0, 0))
    first = {name: lo for name, (lo, _) in rows.items()}
    mine = (
        labels[step_rows(graph, span, microbatches)] if microbatches > 1 else labels[slice(*span)]
    )
    scale = _scale(graph, labels, microbatches)
    return Batch(inputs, mine, step, first, scale, microbatches)
