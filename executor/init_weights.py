"""``--init-weights FILE|DIR``: start training from safetensors weights.

A .safetensors file is an 8-byte little-endian header length, a JSON header (per tensor
its dtype, shape and byte range of the data after the header) and the data. Each tensor
is read as the model's external data is (``importer.weights.StoredTensor``): a rank
reads only the boxes of its shards, with ``pread``. A folder is a Hugging Face
checkpoint: ``model.safetensors.index.json`` (its ``weight_map`` names each tensor's
file), or its one .safetensors file.

Every tensor must be one of the model's weights or state tensors (by initializer name)
with its shape; the model's own values stay for the ones the files leave out. A header
that lies (offsets outside the file or not the size its dtype and shape say, an unknown
dtype, bad JSON) and a name or shape that matches nothing are one line naming the file.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path

import onnx

from onnx2soap.errors import UserError
from onnx2soap.importer.weights import ExternalData, StoredTensor

INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
DTYPES = {
    "F32": onnx.TensorProto.FLOAT,
    "F64": onnx.TensorProto.DOUBLE,
    "F16": onnx.TensorProto.FLOAT16,
    "BF16": onnx.TensorProto.BFLOAT16,
}
ITEMSIZE = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2}


def safetensors_files(source: Path) -> list[Path]:
    """The files of ``source``: itself, or a folder's by its index (or its one file)."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise UserError(f"{source}: no such file or folder (give a .safetensors file or a folder)")
    index = source / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            what = "not a safetensors index (a 'weight_map' of files)"
            raise UserError(f"{index}: {what}: {e}") from e
        files = [source / n for n in names]
        for f in files:
            if f.parent != source or not f.is_file():
                raise UserError(f"{index}: names {f.name!r}, which is not a file beside it")
        return files
    found = sorted(source.glob("*.safetensors"))
    if len(found) != 1:
        raise UserError(
            f"{source}: {len(found)} .safetensors files and no {INDEX} naming their tensors"
        )
    return found


def read_tensors(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one file, checked against its size (nothing read but the header)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(f"{path}: not a safetensors file (shorter than its header)")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise UserError(f"{path}: not a safetensors file (a header of {length} bytes)")
            header = json.loads(f.read(length))
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a safetensors file (its header is not JSON: {e})") from e
    if not isinstance(header, Mapping):
        raise UserError(f"{path}: not a safetensors file (its header is not a JSON object)")
    start = 8 + length
    return {
        name: _tensor(path, name, entry, start, size)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _tensor(path: Path, name: str, entry, start: int, size: int) -> StoredTensor:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, Mapping):
        raise UserError(f"{where}: not a mapping of dtype, shape and data_offsets")
    kind, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(kind, str) or kind not in DTYPES:
        raise UserError(f"{where}: dtype {kind!r}; the weights read {', '.join(DTYPES)}")
    if not _integers(shape) or not _integers(offsets) or len(offsets) != 2:
        raise UserError(f"{where}: shape and data_offsets must be lists of integers >= 0")
    begin, end = offsets
    if end - begin != math.prod(shape) * ITEMSIZE[kind] or start + end > size:
        raise UserError(
            f"{where}: data_offsets {offsets} do not hold a {kind} tensor of shape {shape} "
            f"inside the file ({size - start} bytes of data)"
        )
    data = ExternalData(path, start + begin, end - begin)
    return StoredTensor(name, tuple(shape), DTYPES[kind], data)


def _integers(values) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    )


def initial_weights(
    source: Path, weights: Mapping[str, object], state: Mapping[str, object]
) -> tuple[dict[str, object], dict[str, object]]:
    """The model's weights and state with every tensor of ``source`` in its place."""
    weights, state = dict(weights), dict(state)
    for path in safetensors_files(source):
        for name, tensor in read_tensors(path).items():
            held = weights if name in weights else state if name in state else None
            if held is None:
                raise UserError(
                    f"{path}: tensor {name!r} is none of the model's {len(weights)} weights "
                    f"and {len(state)} state tensors (by initializer name)"
                )
            want = tuple(getattr(held[name], "shape", ()))
            if tensor.shape != want:
                raise UserError(
                    f"{path}: tensor {name!r} has shape {list(tensor.shape)}; the model's "
                    f"is {list(want)}"
                )
            held[name] = tensor
    return weights, state
