"""``--save-model OUT.onnx``: the input model with its trained initializers and state.

Every weight and state tensor the executor trains is an initializer of the input file
(checked before training starts); the saved file is the input graph unchanged, those
initializers replaced in their own dtype. The weights go to external data beside the
file (``OUT.onnx.data``) when the input kept them outside or when they pass half of
protobuf's 2 GB limit on a model file (the graph needs room too). Both files are
written under temporary names and renamed into place, the data first, so a crash never
leaves a model pointing at missing data.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.external_data_helper import set_external_data, uses_external_data

from onnx2soap.errors import UserError
from onnx2soap.files import check_output
from onnx2soap.ir import Graph

PROTOBUF_LIMIT = 2**31 - 1
INLINE_BYTES = 1024  # smaller initializers stay in the model file (as onnx's own default)


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


def save_model(model_path: Path, trained: Mapping[str, np.ndarray], out: Path) -> None:
    bare = onnx.load(str(model_path), load_external_data=False)
    external = any(uses_external_data(i) for i in bare.graph.initializer)
    model = onnx.load(str(model_path))
    for init in model.graph.initializer:
        if init.name in trained:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
            value = np.asarray(trained[init.name], dtype=dtype).reshape(tuple(init.dims))
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    total = sum(i.ByteSize() for i in model.graph.initializer)
    if external or total > PROTOBUF_LIMIT // 2:  # room left for the graph itself
        _write_external(model, out)
    else:
        _replace(out, model.SerializeToString())


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _replace(path: Path, data: bytes) -> None:
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{path}: cannot write ({e.strerror or e})") from e


def _write_external(model: onnx.ModelProto, out: Path) -> None:
    """The initializers' bytes (all but the smallest) in ``OUT.onnx.data``, written
    under a temporary name and renamed into place first; then the model."""
    data = out.with_name(out.name + ".data")
    tmp = _temporary(data)
    offset = 0
    try:
        with open(tmp, "wb") as f:
            for init in model.graph.initializer:
                value = numpy_helper.to_array(init)
                if value.nbytes < INLINE_BYTES:
                    continue  # shapes and scalars stay inline: shape inference reads them
                raw = value.astype(value.dtype.newbyteorder("<")).tobytes()
                f.write(raw)
                init.CopyFrom(numpy_helper.from_array(value, init.name))  # raw_data form
                set_external_data(init, data.name, offset, len(raw))
                init.ClearField("raw_data")
                init.data_location = onnx.TensorProto.EXTERNAL
                offset += len(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, data)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{data}: cannot write ({e.strerror or e})") from e
    _replace(out, model.SerializeToString())
