"""Training data: batches from an .npz file, or synthetic batches drawn from the seed.

Every rank builds the same whole batch; each task cuts its own region from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from executor.runtime import Batch
from onnx2soap.errors import UserError
from onnx2soap.ir import DType, Graph


def _label_shape(graph: Graph) -> tuple[int, ...]:
    return graph.tensors[graph.labels].shape


def _classes(graph: Graph) -> int | None:
    """Class ids are integer labels, below the size of the scores' class axis."""
    loss = graph.loss_op
    if graph.tensors[graph.labels].dtype is DType.INT64:
        return graph.tensors[loss.inputs[0]].shape[loss.attrs.class_axis]
    return None


@dataclass(frozen=True)
class SyntheticData:
    graph: Graph
    seed: int
    dtype: np.dtype

    def batch(self, step: int) -> Batch:
        rng = np.random.default_rng([self.seed, step])
        x = rng.standard_normal(self.graph.tensors[self.graph.input].shape).astype(self.dtype)
        classes = _classes(self.graph)
        if classes is not None:
            y = rng.integers(0, classes, size=_label_shape(self.graph), dtype=np.int64)
        else:
            y = rng.standard_normal(_label_shape(self.graph)).astype(self.dtype)
        return Batch(x, y, step)


@dataclass(frozen=True)
class FileData:
    """Arrays ``input`` and ``labels`` batched along axis 0; step ``s`` takes batch
    ``s mod (samples // batch)``."""

    input: np.ndarray
    labels: np.ndarray
    batch_size: int

    def batch(self, step: int) -> Batch:
        b = step % (len(self.input) // self.batch_size)
        rows = slice(b * self.batch_size, (b + 1) * self.batch_size)
        return Batch(self.input[rows], self.labels[rows], step)


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


def load_npz(path: Path, graph: Graph, dtype: np.dtype) -> FileData:
    try:
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
    except FileNotFoundError as e:
        raise UserError(f"{path}: no such data file") from e
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not an .npz file ({e})") from e
    # The data input by its ONNX name; a single-input model also takes it as "input".
    name = graph.input if graph.input in arrays else "input"
    missing = [
        k for k in (graph.input if name not in arrays else name, "labels") if k not in arrays
    ]
    if missing:
        wanted = f"'{graph.input}' (or 'input') and 'labels'"
        raise UserError(
            f"{path}: missing arrays {missing}; it needs {wanted}, has {sorted(arrays)}"
        )
    x, y = arrays[name], arrays["labels"]
    _check(path, name, x, graph.tensors[graph.input].shape, graph.batch)
    _check(path, "labels", y, _label_shape(graph), graph.batch)
    if len(x) != len(y):
        raise UserError(f"{path}: '{name}' has {len(x)} samples but 'labels' has {len(y)}")
    classes = _classes(graph)
    if classes is not None:
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
        y = y.astype(np.int64)
    else:
        y = y.astype(dtype)
    return FileData(x.astype(dtype), y, graph.batch)
