"""Training data: batches from an .npz file, or synthetic batches drawn from the seed.

Every graph input that is not an initializer is a data input batched along axis 0:
float data, or int64 ids (tokens, masks). A rank holds only the rows its tasks read (one
span per input, from ``rows_needed``); the labels are read whole to count the batch's
labels for a mean loss, and cut like the inputs.

Synthetic data draws every sample from its own stream (seed, step, row), so a rank makes
its rows alone and gets what one device holding the batch would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from executor.runtime import Batch, loss_scale
from onnx2soap.errors import UserError
from onnx2soap.ir import DType, Graph
from onnx2soap.ops import definition
from onnx2soap.soap import PartitionedGraph

MASK_BOUND = 2  # ids no op bounds (attention masks, token types) are drawn in [0, 2)


def rows_needed(pg: PartitionedGraph, rank: int) -> dict[str, tuple[int, int]]:
    """Per data input (and the labels), the span of batch rows the rank's tasks read."""
    return pg.data_rows(rank)


def _scale(graph: Graph, labels: np.ndarray) -> float | None:
    return loss_scale(graph, labels) if graph.loss_op is not None else None


def _label_shape(graph: Graph) -> tuple[int, ...]:
    return graph.tensors[graph.labels].shape


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
            if d.id_bound is not None:
                bounds.append(d.id_bound(op, k, graph.tensors))
            elif d.moves_values:  # ids reshaped on their way to an embedding
                bounds.append(_stated_bound(graph, op.output))
    found = [b for b in bounds if b is not None]
    return min(found) if found else None


def _cast(graph: Graph, name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Float inputs in the run's dtype, ids as int64."""
    return array.astype(dtype if graph.tensors[name].dtype.is_float else np.int64)


@dataclass(frozen=True)
class SyntheticData:
    graph: Graph
    seed: int
    dtype: np.dtype

    def _sample(self, name: str, step: int, row: int) -> np.ndarray:
        t = self.graph.tensors[name]
        rng = np.random.default_rng([self.seed, step, row, self.graph.inputs.index(name)])
        if t.dtype.is_float:
            return rng.standard_normal(t.shape[1:]).astype(self.dtype)
        return rng.integers(0, id_bound(self.graph, name), t.shape[1:], np.int64)

    def _labels(self, step: int) -> np.ndarray:
        # (seed, step): a stream apart from every row's (seed, step, row, input).
        rng = np.random.default_rng([self.seed, step])
        classes = _classes(self.graph)
        if classes is not None:
            return rng.integers(0, classes, size=_label_shape(self.graph), dtype=np.int64)
        return rng.standard_normal(_label_shape(self.graph)).astype(self.dtype)

    def batch(self, step: int, rows: Mapping[str, tuple[int, int]] | None = None) -> Batch:
        """The rows ``rows`` names of each input (every row when None)."""
        rows = rows if rows is not None else _all_rows(self.graph)
        inputs = {
            name: np.stack([self._sample(name, step, r) for r in range(lo, hi)])
            for name, (lo, hi) in rows.items()
            if name in self.graph.inputs
        }
        return _cut(self.graph, inputs, self._labels(step), step, rows)


def _all_rows(graph: Graph) -> dict[str, tuple[int, int]]:
    names = (*graph.inputs, graph.labels) if graph.labels else graph.inputs
    return {name: (0, graph.batch) for name in names}


def _cut(graph: Graph, inputs, labels: np.ndarray, step: int, rows) -> Batch:
    """A batch of the given input rows, with the labels' rows cut from the whole labels
    (which give a mean loss its divisor)."""
    lo, hi = rows.get(graph.labels, (0, 0))
    first = {name: lo for name, (lo, _) in rows.items()}
    return Batch(inputs, labels[lo:hi], step, first, _scale(graph, labels))


@dataclass(frozen=True)
class FileData:
    """One array per data input and ``labels``, batched along axis 0; step ``s`` takes
    batch ``s mod (samples // batch)``."""

    graph: Graph
    inputs: Mapping[str, np.ndarray]
    labels: np.ndarray
    batch_size: int

    def batch(self, step: int, rows: Mapping[str, tuple[int, int]] | None = None) -> Batch:
        rows = rows if rows is not None else _all_rows(self.graph)
        start = (step % (len(self.labels) // self.batch_size)) * self.batch_size
        inputs = {
            name: np.ascontiguousarray(self.inputs[name][start + lo : start + hi])
            for name, (lo, hi) in rows.items()
            if name in self.inputs
        }
        labels = self.labels[start : start + self.batch_size]
        return _cut(self.graph, inputs, labels, step, rows)


def _check(path: Path, name: str, array: np.ndarray, want: tuple[int, ...], batch: int) -> None:
    if array.ndim != len(want) or array.shape[1:] != want[1:]:
        raise UserError(
            f"{path}: array '{name}' has shape {list(array.shape)}; expected "
            f"[samples, {', '.join(map(str, want[1:]))}]".replace(", ]", "]")
        )
    if array.shape[0] < batch:
        raise UserError(
            f"{path}: array '{name}' has {array.shape[0]} samples, fewer than the batch {batch}"
        )


def _array_names(path: Path, graph: Graph, arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    """{data input: the array holding it}: its ONNX name; a single-input model also
    takes it as "input"."""
    found = {n: n for n in graph.inputs if n in arrays}
    if len(graph.inputs) == 1 and not found and "input" in arrays:
        found = {graph.input: "input"}
    missing = [n for n in graph.inputs if n not in found]
    if "labels" not in arrays:
        missing.append("labels")
    if missing:
        alias = " (or 'input')" if len(graph.inputs) == 1 else ""
        wanted = ", ".join(f"'{n}'" for n in graph.inputs) + alias + " and 'labels'"
        raise UserError(
            f"{path}: missing arrays {missing}; it needs {wanted}, has {sorted(arrays)}"
        )
    return found


def _check_ids(path: Path, graph: Graph, name: str, key: str, x: np.ndarray) -> None:
    if not (np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_):
        raise UserError(f"{path}: '{key}' must hold integer ids (or a bool mask), got {x.dtype}")
    bound = id_bound(graph, name)
    bad = (x < 0) | (x >= bound)
    if bad.any():
        raise UserError(f"{path}: '{key}' must hold ids in [0, {bound}), found {int(x[bad][0])}")


def _labels(path: Path, graph: Graph, y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    classes = _classes(graph)
    if classes is None:
        return y.astype(dtype)
    if not np.issubdtype(y.dtype, np.integer):
        raise UserError(f"{path}: 'labels' must hold integer class ids, got {y.dtype}")
    bad = (y < 0) | (y >= classes)
    ignore = graph.loss_op.attrs.ignore_index
    if ignore is not None:
        bad &= y != ignore
    if bad.any():
        raise UserError(
            f"{path}: 'labels' must be class ids in [0, {classes}), found {int(y[bad][0])}"
        )
    return y.astype(np.int64)


def load_npz(path: Path, graph: Graph, dtype: np.dtype) -> FileData:
    try:
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
    except FileNotFoundError as e:
        raise UserError(f"{path}: no such data file") from e
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not an .npz file ({e})") from e
    names = _array_names(path, graph, arrays)
    y = arrays["labels"]
    _check(path, "labels", y, _label_shape(graph), graph.batch)
    inputs = {}
    for name, key in names.items():
        x = arrays[key]
        _check(path, key, x, graph.tensors[name].shape, graph.batch)
        if len(x) != len(y):
            raise UserError(f"{path}: '{key}' has {len(x)} samples but 'labels' has {len(y)}")
        if not graph.tensors[name].dtype.is_float:
            _check_ids(path, graph, name, key, x)
        inputs[name] = _cast(graph, name, x, dtype)
    return FileData(graph, inputs, _labels(path, graph, y, dtype), graph.batch)
