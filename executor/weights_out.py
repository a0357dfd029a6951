"""``--save-weights W.npz`` or ``W.safetensors``: every weight and state tensor, whole,
in the run's dtype, under the model's initializer names, written by the ranks that hold
its shards: no rank gathers the model.

For an .npz the ranks write their shards into a file of whole tensors beside the output
(``shard_io``), then rank 0 streams it into the .npz (uncompressed members, a chunk at a
time, so its memory holds a chunk, not the model) under a temporary name, renamed into
place; the shard file is removed. The disk holds the model twice for a moment.

A .safetensors file is written in place by the ranks: its header (every tensor's dtype,
shape and byte range, known from the graph alone) is laid out first, the ranks write
their shards at their ranges with MPI-IO, rank 0 writes the header and renames the file
into place. What Hugging Face and torch read (``safetensors.torch.load_file``): for a
model exported by dynamo (``optimize=False``) the names are the module's parameters'.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from mpi4py import MPI

from executor.runtime import Runtime
from executor.shard_io import Layout, read_placed, write_shards
from onnx2soap.errors import UserError
from onnx2soap.files import check_output, temporary_beside
from onnx2soap.soap.partition import Rect


def owned_shards(rt: Runtime, names: set[str]) -> Iterator[tuple[str, Rect, np.ndarray]]:
    """(tensor, rect, host values) of every shard of ``names`` this rank writes: those
    whose replica group has this rank as its lowest device (each Rect written once).
    Made one at a time, so a GPU rank holds one host copy at a time."""
    for op in rt.graph.ops:
        for group in rt.pg.groups[op.name]:
            for device, rect in rt.written(group):  # ZeRO-3: every member its rows
                if device == rt.rank and group.weight in names:
                    shard = rt.shards[(group.weight, group.rect)]
                    yield group.weight, rect, rt.device.to_host(shard)


def shard_file(comm: MPI.Comm, target: Path) -> Path:
    """A temporary path beside ``target`` that every rank agrees on."""
    return Path(comm.bcast(str(temporary_beside(target, "shards")) if comm.rank == 0 else None))


def written_then(
    comm: MPI.Comm, rt: Runtime, raw: Path, layout: Layout, target: Path, finish
) -> None:
    """Collective: every rank writes its shards of ``layout``'s tensors into ``raw``
    (``write_shards``), then rank 0 ``finish()``es the output ``target`` from it (a
    stream into another file, a header and a rename). A UserError or OSError there is
    one line naming ``target`` on every rank; ``raw`` is gone afterwards unless
    ``finish`` renamed it."""
    try:
        write_shards(comm, raw, layout, owned_shards(rt, set(layout.tensors)))
        error = None
        if comm.rank == 0:
            try:
                finish()
            except UserError as e:
                error = str(e)
            except OSError as e:
                error = f"{target}: cannot write ({e.strerror or e})"
        error = comm.bcast(error, root=0)
        if error:
            raise UserError(error)
    finally:
        if comm.rank == 0:
            raw.unlink(missing_ok=True)


def save_weights(comm: MPI.Comm, rt: Runtime, out: Path) -> None:
    """Collective: write ``out`` (.safetensors, or else .npz) from every rank's shards."""
    target = check_output(out)
    tensors = [(t.name, t.shape, rt.dtype) for t in (*rt.graph.weights, *rt.graph.states)]
    raw = shard_file(comm, target)
    if target.suffix == ".safetensors":
        prefix, layout = safetensors_layout(tensors)
        written_then(
            comm, rt, raw, layout, target, lambda: _finish_safetensors(raw, prefix, target)
        )
    else:
        layout = Layout.of(tensors)
        written_then(comm, rt, raw, layout, target, lambda: _npz_from(raw, layout, target))


def _npz_from(raw: Path, layout: Layout, target: Path) -> None:
    tmp = temporary_beside(target)
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for placed in layout.tensors.values():
                header = {
                    "descr": np.lib.format.dtype_to_descr(placed.dtype),
                    "fortran_order": False,
                    "shape": placed.shape,
                }
                with archive.open(f"{placed.name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array_header_2_0(member, header)
                    for chunk in read_placed(raw, placed):
                        member.write(chunk)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{target}: cannot write ({e.strerror or e})") from e


SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64"}


def safetensors_layout(
    tensors: list[tuple[str, tuple[int, ...], np.dtype]],
) -> tuple[bytes, Layout]:
    """The file's first bytes (the header's length, little-endian u64, and the JSON
    header, padded with spaces to 8 bytes) and where each tensor's bytes go: back to
    back after them, in the given order."""
    packed = Layout.of(tensors, align=1)  # the data's own offsets, from 0
    header: dict = {"__metadata__": {"format": "pt"}}
    for p in packed.tensors.values():
        kind = SAFETENSORS_DTYPES[p.dtype.newbyteorder("=")]
        header[p.name] = {
            "dtype": kind,
            "shape": list(p.shape),
            "data_offsets": [p.offset, p.offset + p.nbytes],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, Layout.of(tensors, start=len(prefix), align=1)


def _finish_safetensors(raw: Path, prefix: bytes, target: Path) -> None:
    """Rank 0, once the shards are in place: the header written, the file renamed."""
    with open(raw, "rb+") as f:
        f.write(prefix)
        f.flush()
        os.fsync(f.fileno())
    os.replace(raw, target)
