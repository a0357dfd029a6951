"""Training and evaluation data from files: an .npz, or a folder of .npy memory-mapped.

One array per data input (by its ONNX name; a single-input model also takes ``input``)
and ``labels``, all with the same number of samples along axis 0. A folder of .npy files
is memory-mapped, so a dataset larger than memory streams: a rank reads only the rows of
its tasks (and each batch's labels, which give a mean loss its divisor). An .npz is read
whole when opened.

Epochs: ``samples // batch`` batches each (the remainder is dropped); with ``--shuffle``
epoch e visits the samples in the permutation drawn from (seed, e), the same on every
rank and for every plan. Values are checked as they are read (ids below their bound,
class labels in range): a bad value is one line naming the file, array and sample.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.random import default_rng

from executor.batch import Batch
from executor.data import _classes, _cut, _label_shape, id_bound, step_rows
from onnx2soap.errors import UserError
from onnx2soap.ir import Graph

LABELS = "labels"


@dataclass(frozen=True)
class FileData:
    graph: Graph
    source: Path
    arrays: Mapping[str, np.ndarray]  # by data input name, and LABELS
    keys: Mapping[str, str]  # the array's name in the file, for messages
    dtype: np.dtype
    shuffle_seed: int | None = None
    microbatches: int = 1  # a pipeline's: a batch is this many graph batches

    @property
    def samples(self) -> int:
        return len(self.arrays[LABELS])

    @property
    def batch_size(self) -> int:
        return self.graph.batch * self.microbatches

    @property
    def batches_per_epoch(self) -> int:
        return self.samples // self.batch_size

    def indices(self, step: int) -> np.ndarray:
        """The samples of batch ``step`` (counted from the start of training)."""
        epoch, b = divmod(step, self.batches_per_epoch)
        size = self.batch_size
        if self.shuffle_seed is None:
            return np.arange(b * size, (b + 1) * size)
        order = default_rng([self.shuffle_seed, epoch]).permutation(self.samples)
        return order[b * size : (b + 1) * size]

    def batch(self, step: int, rows: Mapping[str, tuple[int, int]] | None = None) -> Batch:
        picked = self.indices(step)
        rows = rows if rows is not None else {n: (0, self.graph.batch) for n in self.arrays}
        inputs = {}
        for name, span in rows.items():
            if name in self.graph.inputs:
                inputs[name] = self._read(
                    name, picked[step_rows(self.graph, span, self.microbatches)]
                )
        labels = self._read(LABELS, picked)
        return _cut(self.graph, inputs, labels, step, rows, self.microbatches)

    def _read(self, name: str, picked: np.ndarray) -> np.ndarray:
        values = np.asarray(self.arrays[name][_contiguous(picked)])
        where = f"{self.source}: '{self.keys[name]}'"
        if name == LABELS:
            return _checked_labels(where, self.graph, values, picked, self.dtype)
        if self.graph.tensors[name].dtype.is_float:
            return values.astype(self.dtype)
        return _checked_ids(where, self.graph, name, values, picked)


def _contiguous(picked: np.ndarray) -> slice | np.ndarray:
    """A slice when the samples are consecutive: a memory-mapped read in one piece."""
    if len(picked) and np.array_equal(picked, np.arange(picked[0], picked[0] + len(picked))):
        return slice(int(picked[0]), int(picked[0]) + len(picked))
    return picked


def _checked_ids(where: str, graph: Graph, name: str, x: np.ndarray, picked) -> np.ndarray:
    bound = id_bound(graph, name)
    bad = (x < 0) | (x >= bound)
    if bad.any():
        sample = int(picked[np.argwhere(bad)[0][0]])
        raise UserError(
            f"{where} sample {sample}: ids must be in [0, {bound}), found {int(x[bad][0])}"
        )
    return x.astype(np.int64)


def _checked_labels(where: str, graph: Graph, y: np.ndarray, picked, dtype) -> np.ndarray:
    classes = _classes(graph)
    if classes is None:
        return y.astype(dtype)
    bad = (y < 0) | (y >= classes)
    ignore = graph.loss_op.attrs.ignore_index
    if ignore is not None:
        bad &= y != ignore
    if bad.any():
        sample = int(picked[np.argwhere(bad)[0][0]])
        raise UserError(
            f"{where} sample {sample}: class ids must be in [0, {classes}), found {int(y[bad][0])}"
        )
    return y.astype(np.int64)


def _open_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a folder of .npy (memory-mapped) or of an .npz (read whole)."""
    if path.is_dir():
        arrays = {}
        for file in sorted(path.glob("*.npy")):
            try:
                arrays[file.stem] = np.load(file, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise UserError(f"{file}: not a readable .npy file ({e})") from e
        return arrays
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except FileNotFoundError as e:
        raise UserError(f"{path}: no such data file or folder") from e
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise UserError(f"{path}: not an .npz file or a folder of .npy files ({e})") from e


def _names(path: Path, graph: Graph, arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    """{data input or LABELS: its array's name}; a single-input model also takes "input"."""
    found = {n: n for n in graph.inputs if n in arrays}
    if len(graph.inputs) == 1 and not found and "input" in arrays:
        found = {graph.input: "input"}
    missing = [n for n in graph.inputs if n not in found]
    if LABELS not in arrays:
        missing.append(LABELS)
    if missing:
        alias = " (or 'input')" if len(graph.inputs) == 1 else ""
        wanted = ", ".join(f"'{n}'" for n in graph.inputs) + alias + " and 'labels'"
        raise UserError(
            f"{path}: missing arrays {missing}; it needs {wanted}, has {sorted(arrays)}"
        )
    return {**found, LABELS: LABELS}


def _check_array(path: Path, key: str, array: np.ndarray, want: tuple[int, ...], kind: str) -> None:
    if array.ndim != len(want) or array.shape[1:] != want[1:]:
        raise UserError(
            f"{path}: array '{key}' has shape {list(array.shape)}; expected "
            f"[samples, {', '.join(map(str, want[1:]))}]".replace(", ]", "]")
        )
    ok = {
        "float": array.dtype.kind in "fiub",
        "ids": array.dtype.kind in "iub",
        "classes": array.dtype.kind in "iu",
    }[kind]
    if not ok:
        needs = {
            "float": "numbers",
            "ids": "integer ids (or a bool mask)",
            "classes": "integer class ids",
        }
        raise UserError(f"{path}: array '{key}' must hold {needs[kind]}, got {array.dtype}")


def open_dataset(
    path: Path,
    graph: Graph,
    dtype: np.dtype,
    shuffle_seed: int | None = None,
    microbatches: int = 1,
):
    arrays = _open_arrays(Path(path))
    keys = _names(path, graph, arrays)
    picked = {name: arrays[key] for name, key in keys.items()}
    samples = len(picked[LABELS])
    for name, key in keys.items():
        want = _label_shape(graph) if name == LABELS else graph.tensors[name].shape
        if name == LABELS:
            kind = "classes" if _classes(graph) is not None else "float"
        else:
            kind = "float" if graph.tensors[name].dtype.is_float else "ids"
        _check_array(path, key, picked[name], want, kind)
        if len(picked[name]) != samples:
            raise UserError(
                f"{path}: '{key}' has {len(picked[name])} samples but 'labels' has {samples}"
            )
    batch = graph.batch * microbatches
    if samples < batch:
        raise UserError(f"{path}: {samples} samples, fewer than the batch {batch}")
    return FileData(graph, Path(path), picked, keys, np.dtype(dtype), shuffle_seed, microbatches)
