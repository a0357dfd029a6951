"""``--save-model OUT.onnx``: the input model with its trained initializers and state.

Every weight and state tensor the executor trains is an initializer of the input file
(checked before training starts); the saved file is the input graph unchanged, those
initializers replaced in their own dtype. No rank gathers the model: the ranks that hold
each shard write it, with MPI-IO, at its place in the data file (``shard_io``).

The weights go to external data beside the file (``OUT.onnx.data``) when the input kept
them outside or when they pass half of protobuf's 2 GB limit on a model file (the graph
needs room too): the trained tensors are written there by the ranks, and rank 0 copies
the other large initializers from the input, a chunk at a time. Otherwise (a small model
whose input was one file) rank 0 reads the trained tensors back from the shard file into
the model. The data is written under a temporary name and renamed into place before the
model is, so a crash never leaves a model pointing at missing data.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from mpi4py import MPI
from onnx import numpy_helper

from executor.runtime import Runtime
from executor.shard_io import Layout, Placed, read_placed
from executor.weights_out import shard_file, written_then
from onnx2soap.errors import UserError
from onnx2soap.files import check_output, temporary_beside
from onnx2soap.importer.weights import external_data
from onnx2soap.ir import Graph

PROTOBUF_LIMIT = 2**31 - 1
INLINE_BYTES = 1024  # smaller untrained initializers stay in the model file (onnx's default)


def check_saveable(model_path: Path, graph: Graph, out: Path) -> None:
    """Refuse before training a model whose trained tensors are not all initializers
    of the input file (nothing to write them into), or an unwritable output."""
    check_output(out)
    check_output(out.with_name(out.name + ".data"))
    names = {i.name for i in onnx.load(str(model_path), load_external_data=False).graph.initializer}
    missing = [t.name for t in (*graph.weights, *graph.states) if t.name not in names]
    if missing:
        raise UserError(
            f"{model_path}: --save-model needs every trained tensor to be an initializer of "
            f"the input; {missing[:3]} are computed from initializers (use --save-weights)"
        )


@dataclass(frozen=True)
class _Plan:
    """Rank 0's decision, shared with every rank: where each trained tensor goes."""

    layout: Layout  # the trained tensors first, then (external) the large others
    external: bool


def _dtype(init: onnx.TensorProto) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type))


def _nbytes(init: onnx.TensorProto) -> int:
    return int(np.prod(init.dims, dtype=np.int64)) * _dtype(init).itemsize


def _decide(bare: onnx.ModelProto, trained: set[str]) -> _Plan:
    inits = list(bare.graph.initializer)
    was_external = any(i.data_location == onnx.TensorProto.EXTERNAL for i in inits)
    total = sum(_nbytes(i) for i in inits)
    external = was_external or total > PROTOBUF_LIMIT // 2  # room left for the graph
    tensors = [(i.name, tuple(i.dims), _dtype(i)) for i in inits if i.name in trained]
    if external:
        tensors += [
            (i.name, tuple(i.dims), _dtype(i))
            for i in inits
            if i.name not in trained and _nbytes(i) >= INLINE_BYTES
        ]
    return _Plan(Layout.of(tensors), external)


def save_model(comm: MPI.Comm, rt: Runtime, model_path: Path, out: Path) -> None:
    """Collective: write ``out`` (and ``out.data``) from every rank's shards."""
    trained = {t.name for t in (*rt.graph.weights, *rt.graph.states)}
    bare, plan = None, None
    if comm.rank == 0:
        bare = onnx.load(str(model_path), load_external_data=False)
        plan = _decide(bare, trained)
    plan = comm.bcast(plan, root=0)
    raw = shard_file(comm, out.with_name(out.name + ".data"))
    finish = lambda: _finish(bare, plan, model_path, raw, out, trained)  # noqa: E731
    written_then(comm, rt, raw, plan.layout, out, finish)


def _finish(
    bare: onnx.ModelProto, plan: _Plan, source: Path, raw: Path, out: Path, trained: set[str]
) -> None:
    """Rank 0, once the shards are on disk: the model (and its data) in place."""
    if plan.external:
        data = out.with_name(out.name + ".data")
        _copy_untrained(bare, plan.layout, source, raw, trained)
        _fsync(raw)
        os.replace(raw, data)  # the data first: the model must never point at missing data
        for init in bare.graph.initializer:
            if init.name in plan.layout.tensors:
                _point_at(init, plan.layout.tensors[init.name], data.name)
            elif init.data_location == onnx.TensorProto.EXTERNAL:
                # small and untrained, in the input's data file: inline in the output
                _set_raw(init, b"".join(_stored_bytes(init, source)))
    else:  # nothing was external: a small model, one file
        for init in bare.graph.initializer:
            if init.name in trained:
                placed = plan.layout.tensors[init.name]
                _set_raw(init, b"".join(read_placed(raw, placed)))
    _replace(out, bare.SerializeToString())


def _copy_untrained(
    bare: onnx.ModelProto, layout: Layout, source: Path, raw: Path, trained: set[str]
) -> None:
    """Large initializers the run does not train, copied from the input into the data
    file a chunk at a time (their bytes as the input stores them, little-endian)."""
    with open(raw, "r+b") as f:
        for init in bare.graph.initializer:
            if init.name in trained or init.name not in layout.tensors:
                continue
            f.seek(layout.tensors[init.name].offset)
            for chunk in _stored_bytes(init, source):
                f.write(chunk)


def _stored_bytes(init: onnx.TensorProto, source: Path, chunk: int = 16 << 20) -> Iterator[bytes]:
    if init.data_location == onnx.TensorProto.EXTERNAL:
        where = external_data(init, source, f"initializer '{init.name}'", _nbytes(init))
        with open(where.file, "rb") as f:
            f.seek(where.offset)
            left = where.length
            while left:
                data = f.read(min(chunk, left))
                left -= len(data)
                yield data
        return
    value = numpy_helper.to_array(init)
    yield value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes()


def _point_at(init: onnx.TensorProto, placed: Placed, location: str) -> None:
    """The initializer as an external-data reference to its place in ``location``."""
    for field in (
        "raw_data",
        "float_data",
        "double_data",
        "int32_data",
        "int64_data",
        "uint64_data",
        "external_data",
    ):
        init.ClearField(field)
    init.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (
        ("location", location),
        ("offset", placed.offset),
        ("length", placed.nbytes),
    ):
        init.external_data.add(key=key, value=str(value))


def _set_raw(init: onnx.TensorProto, payload: bytes) -> None:
    for field in (
        "float_data",
        "double_data",
        "int32_data",
        "int64_data",
        "uint64_data",
        "external_data",
    ):
        init.ClearField(field)
    init.data_location = onnx.TensorProto.DEFAULT
    init.raw_data = payload


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _replace(path: Path, data: bytes) -> None:
    tmp = temporary_beside(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{path}: cannot write ({e.strerror or e})") from e
