"""Read an ONNX file and make its shapes static: bind the batch, fold constants, infer shapes.

The result is a ``Prepared`` model: the remaining (compute) nodes, a static shape and
element type for every tensor, the values of every constant, and which initializers
are float (candidate weights).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.external_data_helper import load_external_data_for_model
from onnx.reference import ReferenceEvaluator

from onnx2soap.errors import ModelError

MIN_OPSET = 13
_MAX_FOLD_PASSES = 16
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16}


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    elem_type: int  # onnx.TensorProto.DataType


@dataclass(frozen=True)
class Prepared:
    path: Path
    sha256: str
    opset: int
    opsets: dict[str, int]  # every imported domain's version ("ai.onnx" for the default)
    batch: int
    nodes: tuple[onnx.NodeProto, ...]
    types: dict[str, TensorType]
    constants: dict[str, np.ndarray]  # folded values and non-float initializers
    float_initializers: dict[str, np.ndarray]
    graph_inputs: tuple[str, ...]  # non-initializer inputs
    graph_outputs: tuple[str, ...]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_model(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise ModelError(f"{path}: no such model file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises several unrelated types on garbage input
        raise ModelError(f"{path}: not a valid ONNX model ({type(e).__name__}: {e})") from e
    _load_external_data(model, path)
    if not model.graph.node:
        raise ModelError(f"{path}: not a valid ONNX model (the graph has no nodes)")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "validation failed"
        raise ModelError(f"{path}: not a valid ONNX model ({first})") from e
    return model


def _load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Load weights kept beside the model (the dynamo exporter's ``.data`` file)."""
    locations = {
        entry.value
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    }
    for location in sorted(locations):
        if not (path.parent / location).is_file():
            raise ModelError(f"{path}: external weight file missing: {path.parent / location}")
    if locations:
        try:
            load_external_data_for_model(model, str(path.parent))
        except Exception as e:
            raise ModelError(f"{path}: cannot read external weights ({e})") from e


def default_opset(model: onnx.ModelProto, path: Path) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            if imp.version < MIN_OPSET:
                raise ModelError(
                    f"{path}: opset {imp.version} is too old; onnx2soap reads opset "
                    f"{MIN_OPSET} and newer (re-export with opset_version>={MIN_OPSET})"
                )
            return imp.version
    raise ModelError(f"{path}: the model imports no ai.onnx opset")


def _bind_batch(model: onnx.ModelProto, path: Path, batch: int | None) -> int:
    """Set axis 0 of every graph input to the batch; refuse other symbolic dims."""
    init_names = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in init_names]
    static = []
    for inp in inputs:
        dims = inp.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value"):
            static.append(dims[0].dim_value)
    if batch is None:
        symbolic = [
            (i.name, i.type.tensor_type.shape.dim[0].dim_param or "?")
            for i in inputs
            if i.type.tensor_type.shape.dim
            and not i.type.tensor_type.shape.dim[0].HasField("dim_value")
        ]
        if symbolic:
            name, param = symbolic[0]
            raise ModelError(
                f"{path}: input '{name}' has a symbolic batch dimension '{param}'; pass --batch B"
            )
        if not static:
            raise ModelError(f"{path}: cannot tell the batch size; pass --batch B")
        batch = static[0]
    if batch < 1:
        raise ModelError(f"{path}: --batch must be at least 1, got {batch}")
    for inp in inputs:
        dims = inp.type.tensor_type.shape.dim
        if not dims:
            raise ModelError(f"{path}: input '{inp.name}' has no shape; a batched input is needed")
        dims[0].ClearField("dim_param")
        dims[0].dim_value = batch
        for axis, d in enumerate(dims[1:], start=1):
            if not d.HasField("dim_value"):
                raise ModelError(
                    f"{path}: input '{inp.name}' axis {axis} is symbolic ('{d.dim_param}'); "
                    f"only the batch (axis 0) may be symbolic"
                )
    # Stale annotations from the exporter would clash with the bound batch.
    del model.graph.value_info[:]
    for out in model.graph.output:
        out.type.tensor_type.ClearField("shape")
    return batch


def _infer(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, data_prop=True)
    except Exception as e:  # inference errors come as several types
        raise ModelError(f"{path}: shape inference failed: {str(e).strip().splitlines()[0]}") from e


def _types(model: onnx.ModelProto) -> dict[str, TensorType]:
    types: dict[str, TensorType] = {}
    for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            types[vi.name] = TensorType(tuple(d.dim_value for d in tt.shape.dim), tt.elem_type)
    for init in model.graph.initializer:
        types[init.name] = TensorType(tuple(init.dims), init.data_type)
    return types


def _evaluate(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int) -> list[np.ndarray]:
    try:
        evaluator = ReferenceEvaluator(node, opsets={"": opset})
        return [np.asarray(v) for v in evaluator.run(None, feeds)]
    except Exception as e:  # the reference evaluator raises whatever numpy raises
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(
            f"node '{node.name or node.output[0]}' ({node.op_type}): its inputs are constants, "
            f"but evaluating it failed: {first}"
        ) from e


def _fold_pass(
    model: onnx.ModelProto, opset: int, float_inits: set[str]
) -> tuple[onnx.ModelProto, bool]:
    """Fold Shape nodes and nodes whose inputs are all non-weight constants."""
    types = _types(model)
    known = {
        i.name: numpy_helper.to_array(i)
        for i in model.graph.initializer
        if i.name not in float_inits
    }
    kept, changed = [], False
    for node in model.graph.node:
        if node.op_type == "Shape" and node.input[0] in types:
            # Python slicing clamps and wraps start/end exactly as the ONNX spec does.
            attrs = {a.name: a.i for a in node.attribute}
            window = slice(attrs.get("start", 0), attrs.get("end"))
            outs = [np.array(types[node.input[0]].shape[window], dtype=np.int64)]
        elif node.domain in ("", "ai.onnx") and all(not n or n in known for n in node.input):
            outs = _evaluate(node, {n: known[n] for n in node.input if n}, opset)
        else:
            kept.append(node)
            continue
        changed = True
        known.update(zip(node.output, outs, strict=False))
    if not changed:
        return model, False
    needed = {n for node in kept for n in node.input} | {o.name for o in model.graph.output}
    graph = model.graph
    inits = [i for i in graph.initializer if i.name in needed]
    present = {i.name for i in inits}
    inits += [
        numpy_helper.from_array(np.ascontiguousarray(v), name)
        for name, v in known.items()
        if name in needed and name not in present
    ]
    new_graph = onnx.helper.make_graph(
        kept, graph.name, list(graph.input), list(graph.output), inits
    )
    folded = onnx.helper.make_model(new_graph, opset_imports=list(model.opset_import))
    folded.ir_version = model.ir_version
    return folded, True


def prepare(path: Path, batch: int | None) -> Prepared:
    model = read_model(path)
    opset = default_opset(model, path)
    batch = _bind_batch(model, path, batch)
    # Float initializers are weights (or weight-like constants): never folded away.
    float_inits = {i.name for i in model.graph.initializer if i.data_type in _FLOAT_TYPES}
    model = _infer(model, path)
    for _ in range(_MAX_FOLD_PASSES):
        try:
            model, changed = _fold_pass(model, opset, float_inits)
        except ModelError as e:
            raise ModelError(f"{path}: {e}") from e
        if not changed:
            break
        model = _infer(model, path)
    init_names = {i.name for i in model.graph.initializer}
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return Prepared(
        path=path,
        sha256=file_sha256(path),
        opset=opset,
        opsets={imp.domain or "ai.onnx": imp.version for imp in model.opset_import},
        batch=batch,
        nodes=tuple(model.graph.node),
        types=_types(model),
        constants={k: v for k, v in values.items() if k not in float_inits},
        float_initializers={k: v for k, v in values.items() if k in float_inits},
        graph_inputs=tuple(i.name for i in model.graph.input if i.name not in init_names),
        graph_outputs=tuple(o.name for o in model.graph.output),
    )
