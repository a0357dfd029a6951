"""Write every rank's shards into one file of whole tensors, at their places: no rank
gathers the model.

A ``Layout`` places whole tensors in a file (row-major, each at its offset, in its file
dtype). Every rank opens the file with MPI-IO (collectively) and writes the Rects it owns
(the lowest device of each replica group), one contiguous run of the row-major tensor at
a time; MPI-IO keeps concurrent writers of neighbouring bytes apart where the file system
shares pages between nodes. The file is then whole on disk, and rank 0 can turn it into
what the user asked for (an .npz, an ONNX model's external data) by streaming it, a chunk
at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mpi4py import MPI

from onnx2soap.errors import UserError
from onnx2soap.soap.partition import Rect

ALIGN = 64  # tensors start on 64-byte boundaries (what onnx's own writer may align to)


@dataclass(frozen=True)
class Placed:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype  # in the file (little-endian)
    offset: int  # bytes from the file's start

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    tensors: dict[str, Placed]
    size: int  # bytes

    @staticmethod
    def of(
        tensors: list[tuple[str, tuple[int, ...], np.dtype]], start: int = 0, align: int = ALIGN
    ) -> Layout:
        """Tensors in the given order from byte ``start``, each aligned to ``align``
        (1: packed back to back, as safetensors lays them out)."""
        placed, offset = {}, start
        for name, shape, dtype in tensors:
            offset = -(-offset // align) * align
            p = Placed(name, tuple(shape), np.dtype(dtype).newbyteorder("<"), offset)
            placed[name] = p
            offset += p.nbytes
        return Layout(placed, offset)


def contiguous_runs(shape: tuple[int, ...], rect: Rect) -> Iterator[tuple[int, tuple]]:
    """(element offset in the row-major tensor, index of the run in the rect's array) of
    every contiguous run of ``rect``: the axes after the last partial one are whole, so
    one run covers them and that axis's range; the axes before it are iterated."""
    partial = [k for k, ((lo, hi), n) in enumerate(zip(rect, shape, strict=True)) if hi - lo != n]
    k = partial[-1] if partial else 0
    if any(hi <= lo for lo, hi in rect):
        return
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    outer = [range(lo, hi) for lo, hi in rect[:k]]
    for index in np.ndindex(*(len(r) for r in outer)) if outer else [()]:
        at = [r[i] for r, i in zip(outer, index, strict=True)]
        start = sum(a * s for a, s in zip(at, strides, strict=False))
        start += rect[k][0] * strides[k] if shape else 0
        yield start, tuple(index)


def write_rect(fh: MPI.File, placed: Placed, rect: Rect, values: np.ndarray) -> None:
    """Write ``values`` (the rect's box of the tensor) at its place in the file."""
    host = np.ascontiguousarray(values, dtype=placed.dtype)
    if not placed.shape:
        fh.Write_at(placed.offset, host.reshape(1))
        return
    for start, index in contiguous_runs(placed.shape, rect):
        run = np.ascontiguousarray(host[index]).reshape(-1)
        fh.Write_at(placed.offset + start * placed.dtype.itemsize, run)


def write_shards(
    comm: MPI.Comm, path: Path, layout: Layout, owned: list[tuple[str, Rect, np.ndarray]]
) -> None:
    """Every rank writes its ``owned`` (tensor, rect, host values) into ``path``
    (collective; the file is created, sized and synced). One line on every rank if the
    file cannot be written."""
    error = None
    try:
        fh = MPI.File.Open(comm, str(path), MPI.MODE_WRONLY | MPI.MODE_CREATE)
    except MPI.Exception as e:
        raise UserError(f"{path}: cannot write ({e.Get_error_string()})") from e
    try:
        fh.Set_size(layout.size)
        for name, rect, values in owned:
            write_rect(fh, layout.tensors[name], rect, values)
        fh.Sync()
    except MPI.Exception as e:
        error = f"{path}: cannot write ({e.Get_error_string()})"
    finally:
        fh.Close()
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise UserError(errors[0])


def read_placed(path: Path, placed: Placed, chunk_bytes: int = 16 << 20) -> Iterator[bytes]:
    """A placed tensor's bytes from ``path``, a chunk at a time."""
    with open(path, "rb") as f:
        f.seek(placed.offset)
        left = placed.nbytes
        while left:
            data = f.read(min(left, chunk_bytes))
            if not data:
                raise UserError(f"{path}: ends before '{placed.name}' does")
            left -= len(data)
            yield data
