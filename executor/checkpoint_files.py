"""A checkpoint's files: safetensors shards and the index that names them (format 2).

    step-000000120/model-rank00000.safetensors      rank 0's shards of weights and state
    step-000000120/optimizer-rank00000.safetensors  rank 0's optimizer state
    step-000000120/model.safetensors.index.json     written last: the maps and metadata

A key names a shard by its tensor and its box in the whole tensor, so a reader can put
every tensor back together under any plan: ``fc1.weight[0:4,0:8]`` holds rows 0-3 and
columns 0-7 of ``fc1.weight`` (a scalar's box is ``[]``), ``fc1.weight[0:4,0:8].exp_avg``
Adam's first moment of them. The index is Hugging Face's ``model.safetensors.index.json``
(``weight_map`` from each weight's or state tensor's key to its file, ``metadata`` with
``total_size``) with our own ``optimizer_map`` and metadata beside them.

The files are written with the header ``--save-weights`` writes
(``weights_out.safetensors_layout``) and read as ``--init-weights`` reads them
(``init_weights.read_tensors``: a header that lies about sizes, offsets or dtypes is
refused in one line; a rank reads only the boxes it needs, with ``pread``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from executor.init_weights import DTYPES, read_tensors
from executor.weights_out import safetensors_layout
from onnx2soap.errors import UserError
from onnx2soap.importer.weights import StoredTensor
from onnx2soap.soap.partition import Rect, rect_shape

INDEX = "model.safetensors.index.json"
MAPS = ("weight_map", "optimizer_map")  # values; optimizer slots
_BOX = r"(?:[0-9]+:[0-9]+(?:,[0-9]+:[0-9]+)*)?"  # lo:hi per axis; empty for a scalar
_KEY = re.compile(rf"(?P<tensor>.+)\[(?P<box>{_BOX})\](?:\.(?P<slot>[a-z0-9_]+))?")


def shard_key(tensor: str, rect: Rect, slot: str | None = None) -> str:
    box = ",".join(f"{lo}:{hi}" for lo, hi in rect)
    return f"{tensor}[{box}]" + ("" if slot is None else f".{slot}")


def parse_key(key: str) -> tuple[str, Rect, str | None] | None:
    """(tensor, box, slot) of a key, or None if it is not one."""
    found = _KEY.fullmatch(key)
    if found is None:
        return None
    box = found["box"]
    pairs = [part.split(":") for part in box.split(",")] if box else []
    rect = tuple((int(lo), int(hi)) for lo, hi in pairs)
    if any(lo > hi for lo, hi in rect):
        return None
    return found["tensor"], rect, found["slot"]


def rank_file(kind: str, rank: int) -> str:
    """``model`` or ``optimizer``: one file per rank, so no two ranks write one file."""
    return f"{kind}-rank{rank:05d}.safetensors"


def write_shard_file(
    path: Path, shards: Iterable[tuple[str, object]], to_host: Callable, dtype: np.dtype
) -> int:
    """Write ``shards`` ((key, device array) in the run's ``dtype``) as one safetensors
    file, synced; each array comes to the host as it is written (one host copy at a
    time). Returns the data's size in bytes."""
    shards = list(shards)
    prefix, layout = safetensors_layout([(k, tuple(a.shape), dtype) for k, a in shards])
    with open(path, "wb") as f:
        f.write(prefix)
        for key, array in shards:
            host = np.ascontiguousarray(to_host(array), dtype=layout.tensors[key].dtype)
            f.write(memoryview(host.reshape(-1)).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    return layout.size - len(prefix)


@dataclass(frozen=True)
class Stored:
    """One saved shard: whose tensor, which slot (None: the values), its box, where."""

    tensor: str
    slot: str | None
    rect: Rect
    file: str
    where: StoredTensor


def load_index(path: Path) -> dict:
    """The index of the checkpoint folder ``path``, checked for its shape only."""
    index = path / INDEX
    try:
        doc = json.loads(index.read_text())
    except OSError as e:
        raise UserError(f"{index}: cannot read ({e.strerror or e})") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{index}: not a checkpoint index (not JSON: {e})") from e
    if not isinstance(doc, Mapping) or not isinstance(doc.get("metadata"), Mapping):
        raise UserError(f"{index}: not a checkpoint index (no 'metadata' object)")
    for field in MAPS:
        names = doc.get(field)
        if not isinstance(names, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in names.items()
        ):
            raise UserError(f"{index}: field '{field}' is not a map of tensor keys to files")
    return doc


def stored_shards(path: Path, doc: Mapping, elem_type: int) -> list[Stored]:
    """Every shard the index names, each checked against its file's header: the file
    beside the index, the key in it, the shape its box says, the run's dtype."""
    index, headers, out = path / INDEX, {}, []
    for field in MAPS:
        for key, file in doc[field].items():
            parsed = parse_key(key)
            if parsed is None or (parsed[2] is None) != (field == "weight_map"):
                raise UserError(f"{index}: {field} key {key!r} is not a tensor[box] key")
            if file not in headers:
                headers[file] = read_tensors(_beside(index, field, key, file))
            tensor, rect, slot = parsed
            stored = _checked(path / file, headers[file], key, rect, elem_type)
            out.append(Stored(tensor, slot, rect, file, stored))
    return out


def _beside(index: Path, field: str, key: str, file: str) -> Path:
    path = index.parent / file
    if "/" in file or file in ("", ".", "..") or not path.is_file():
        raise UserError(
            f"{index}: {field} names file {file!r} for {key!r}, which is not a file beside it"
        )
    return path


def _checked(
    file: Path, tensors: Mapping[str, StoredTensor], key: str, rect: Rect, elem_type: int
) -> StoredTensor:
    stored = tensors.get(key)
    if stored is None:
        raise UserError(f"{file}: no tensor {key!r}, which {INDEX} names")
    if stored.shape != rect_shape(rect):
        raise UserError(
            f"{file}: tensor {key!r} has shape {list(stored.shape)}; its key's box is "
            f"{list(rect_shape(rect))}"
        )
    if stored.elem_type != elem_type:
        kind = next(k for k, v in DTYPES.items() if v == stored.elem_type)
        want = next(k for k, v in DTYPES.items() if v == elem_type)
        raise UserError(f"{file}: tensor {key!r} has dtype {kind}; the checkpoint's is {want}")
    return stored
