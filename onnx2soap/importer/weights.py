"""Where each float initializer's bytes are, and reading a box of them when asked.

Planning needs shapes and dtypes only: a ``StoredTensor`` says what a weight is and where
its bytes lie (a range of an external data file, or the bytes the model file held
inline), and is read only by who needs values: the executor, for the boxes of each
weight its rank's tasks own. External data is read with ``pread`` in bounded chunks, so a
rank's memory holds its boxes and one chunk, never the whole weight (a memory map would
count every page a strided box touches in the process's RSS).

A ``StoredTensor`` also behaves as a read-only array for code written for arrays:
``t[slices]`` reads that box, ``np.asarray(t)`` the whole tensor.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnx2soap.errors import ModelError

Box = tuple[tuple[int, int], ...]  # per axis [lo, hi)
CHUNK_BYTES = 16 << 20  # the most a read of a strided box holds besides the box itself

# Element types read as floats (weights); anything else is an integer or bool constant.
FLOAT_TYPES = frozenset(
    getattr(onnx.TensorProto, n)
    for n in ("FLOAT", "DOUBLE", "FLOAT16", "BFLOAT16")
    if hasattr(onnx.TensorProto, n)
)


@dataclass(frozen=True)
class ExternalData:
    """``length`` bytes at ``offset`` of ``file`` (inside the model's folder, checked)."""

    file: Path
    offset: int
    length: int


@dataclass(frozen=True, eq=False)
class InlineData:
    """The little-endian bytes the model file held (moved out of the parsed proto, not
    copied: the proto no longer holds them)."""

    payload: bytes = field(repr=False)


@dataclass(frozen=True, eq=False)
class StoredTensor:
    name: str
    shape: tuple[int, ...]
    elem_type: int  # onnx.TensorProto.DataType
    where: ExternalData | InlineData

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem_type)).newbyteorder("<")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def read(self, box: Box | None = None) -> np.ndarray:
        """The values of ``box`` (the whole tensor if None), a fresh native-order array."""
        box = tuple((0, n) for n in self.shape) if box is None else box
        if len(box) != self.ndim or any(
            not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, self.shape, strict=True)
        ):
            raise ValueError(f"box {list(box)} is not inside '{self.name}' {list(self.shape)}")
        if isinstance(self.where, InlineData):
            whole = np.frombuffer(self.where.payload, dtype=self.dtype).reshape(self.shape)
            out = np.array(whole[tuple(slice(lo, hi) for lo, hi in box)])
        else:
            out = np.empty(tuple(hi - lo for lo, hi in box), dtype=self.dtype)
            with open(self.where.file, "rb") as f:
                _read_box(f.fileno(), self.where.offset, self.shape, box, out)
        return out.astype(self.dtype.newbyteorder("="), copy=False)

    # --- read-only array behaviour ---

    def __getitem__(self, index) -> np.ndarray:
        """Basic slicing reads that box (unit steps); any other index reads the whole."""
        index = index if isinstance(index, tuple) else (index,)
        slices = (*index, *[slice(None)] * (self.ndim - len(index)))
        if len(slices) == self.ndim and all(
            isinstance(s, slice) and s.step in (None, 1) for s in slices
        ):
            box = []
            for s, n in zip(slices, self.shape, strict=True):
                lo, hi, _ = s.indices(n)
                box.append((lo, max(lo, hi)))
            return self.read(tuple(box))
        return self.read()[index]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        values = self.read()
        return values if dtype is None else values.astype(dtype, copy=False)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``offset`` (pread may return less than asked)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += got


def _read_box(fd: int, base: int, shape: tuple[int, ...], box: Box, out: np.ndarray) -> None:
    """Read ``box`` of the row-major tensor ``shape`` stored at byte ``base`` into ``out``."""
    itemsize = out.dtype.itemsize
    if not shape:
        _pread_into(fd, memoryview(out.reshape(1)).cast("B"), base)
        return
    (lo, hi), inner = box[0], box[1:]
    row = itemsize * math.prod(shape[1:])
    if out.size == 0:
        return
    if all(b == (0, n) for b, n in zip(inner, shape[1:], strict=True)):
        # Whole rows: one contiguous range, read straight into the result.
        _pread_into(fd, memoryview(out.reshape(-1)).cast("B"), base + lo * row)
        return
    if row <= CHUNK_BYTES:
        # Part of every row: whole rows a chunk at a time, the box's part kept.
        per_chunk = max(1, CHUNK_BYTES // row)
        picked = tuple(slice(a, b) for a, b in inner)
        for start in range(lo, hi, per_chunk):
            stop = min(hi, start + per_chunk)
            chunk = np.empty((stop - start, *shape[1:]), dtype=out.dtype)
            _pread_into(fd, memoryview(chunk.reshape(-1)).cast("B"), base + start * row)
            out[start - lo : stop - lo] = chunk[(slice(None), *picked)]
        return
    for i in range(lo, hi):  # rows too long for a chunk: each row's box on its own
        _read_box(fd, base + i * row, shape[1:], inner, out[i - lo])


def external_data(
    tensor: onnx.TensorProto, model_path: Path, label: str, needed: int | None
) -> ExternalData:
    """The checked place of an external tensor's bytes: a relative location inside the
    model's folder (no path traversal), a regular file long enough for ``needed`` bytes
    (None: any length the entry states)."""
    entries = {e.key: e.value for e in tensor.external_data}
    location = entries.get("location", "")
    if not location:
        raise ModelError(f"{model_path}: {label}: external data without a location")
    folder = model_path.parent.resolve()
    file = (folder / location).resolve()
    if Path(location).is_absolute() or not file.is_relative_to(folder):
        raise ModelError(
            f"{model_path}: {label}: external data location '{location}' is outside the "
            "model's folder; a location is a relative path inside it"
        )
    if not file.is_file():
        raise ModelError(f"{model_path}: external weight file missing: {folder / location}")
    offset = _entry_int(entries, "offset", 0, model_path, label)
    length = _entry_int(entries, "length", None, model_path, label)
    if needed is not None and length is not None and length != needed:
        raise ModelError(
            f"{model_path}: {label}: external data length {length}, but its dims "
            f"{list(tensor.dims)} need {needed} bytes"
        )
    length = needed if needed is not None else length
    size = file.stat().st_size
    if length is None:
        length = size - offset
    if offset + length > size:
        raise ModelError(
            f"{model_path}: {label}: needs bytes {offset} to {offset + length} of "
            f"{file.name}, which holds {size} (a short or truncated weight file)"
        )
    return ExternalData(file, offset, length)


def _entry_int(entries: dict, key: str, default, model_path: Path, label: str):
    text = entries.get(key)
    if text is None:
        return default
    if not text.isascii() or not text.isdigit():
        raise ModelError(
            f"{model_path}: {label}: external data {key} {text!r} is not a byte count (>= 0)"
        )
    return int(text)
