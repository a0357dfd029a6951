"""The ONNX backend API (``onnx.backend.base.Backend``) on one device, with onnx2soap's kernels.

    from executor import backend
    rep = backend.prepare(model, device="CPU")   # onnx.ModelProto
    (y,) = rep.run([x])                           # or rep.run({"x": x})
    backend.run_model(model, [x]); backend.run_node(node, [x]); backend.supports_device("CUDA")

onnx2soap imports a model with one data input, batched along axis 0, and reads float
initializers as weights and integer ones as constants. So ``run`` binds the given values
into a copy of the model: the first float graph input the requested output depends on
stays the data input (its axis 0 is the batch), or, where it reads no float input, the
first integer or bool one (ids or a mask); every other input becomes an initializer
holding its value (a float one a weight, an integer one a constant), except a loss's
labels, which stay graph inputs as the importer expects. Integers narrower than 64 bits
(int8 to int32, uint8 to uint32) are widened to int64 on the way in, exactly, since the
IR's ids are int64 (where the widened model does not import, say an op that takes no
int64, the refusal of the model as given is raised). A model of an opset older than the
importer reads is read at its oldest opset when none of its nodes' schemas changed in
between (And of opset 7 is And of opset 13). That copy is imported by the real importer
(``prepare`` + ``build_graph``, no loss attached) and its ops run in graph order, each as
one task of its registry kernels over buffers cut from the whole tensors, exactly as a
one-device plan runs them.

Each output comes back in its ONNX element type: the one the graph declares, else the one
ONNX shape inference gives it (a comparison's bool, not the 0/1 float mask the IR
computes; int32 ids wrap back as int32 arithmetic would). A graph with several outputs
is imported once per output (the graph pruned to what that output needs);
``SoapBackendRep.run_each`` gives each output's value or the importer's refusal of it, so
the outputs onnx2soap supports are usable where another is refused (LayerNormalization's
Mean). Models the importer refuses raise its ``ModelError``, the temporary file's path
left out.
"""

from __future__ import annotations

import contextlib
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from executor.buffers import slice_from_full
from onnx2soap.errors import ModelError
from onnx2soap.importer.build import build_graph
from onnx2soap.importer.prepare import MIN_OPSET, Prepared
from onnx2soap.importer.prepare import prepare as prepare_model
from onnx2soap.ir import Graph, LossKind, Op
from onnx2soap.ops import TaskArgs, definition, registry
from onnx2soap.ops.base import RandomKey
from onnx2soap.ops.registry import schema_version
from onnx2soap.soap.partition import ParallelConfig, op_tasks, rect_shape

__all__ = [
    "SoapBackend",
    "SoapBackendRep",
    "is_compatible",
    "prepare",
    "run_model",
    "run_node",
    "supports_device",
]

_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE}

# Integer element types the importer does not read, fed as int64 (every value fits);
# uint64 does not fit, and stays refused.
_WIDENED = {
    onnx.TensorProto.INT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.INT32,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.UINT32,
}

# What a data input may be besides float: ids (int64, or widened to it) or a bool mask.
_ID_TYPES = {onnx.TensorProto.INT64, onnx.TensorProto.BOOL} | _WIDENED


def _array_module(device: str):
    """numpy for CPU, cupy for CUDA (refused where cupy or a GPU is missing)."""
    if Device(device).type == DeviceType.CPU:
        return np
    if not _cuda_available():
        raise ModelError(f"device {device!r}: cupy or a CUDA GPU is missing; use device='CPU'")
    import cupy

    return cupy


def _cuda_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


def _needed_nodes(graph: onnx.GraphProto, output: str) -> list[onnx.NodeProto]:
    """The nodes ``output`` depends on, in graph order."""
    needed, kept = {output}, []
    for node in reversed(graph.node):
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    return kept[::-1]


def _loss_labels(nodes: Sequence[onnx.NodeProto]) -> set[str]:
    """Inputs read as targets (input 1) by a loss node: the importer wants them as graph
    inputs, not constants."""
    losses = {d.name for d in registry().onnx_ops() if d.is_loss}
    return {n.input[1] for n in nodes if n.op_type in losses and len(n.input) > 1}


class SoapBackendRep(BackendRep):
    """A model ready to run on one device. ``run`` imports it with the given values bound
    (the batch and any shape-determining integer inputs come from them) and runs it."""

    def __init__(self, model: onnx.ModelProto, device: str = "CPU", seed: int = 0) -> None:
        self.model = model
        self.seed = seed  # of the random ops' draws
        self.device = device
        self.xp = _array_module(device)
        inits = {i.name for i in model.graph.initializer}
        self.input_names = tuple(i.name for i in model.graph.input if i.name not in inits)
        self.output_names = tuple(o.name for o in model.graph.output)
        self.output_types = _output_types(model)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The outputs, in graph order, as numpy arrays in their ONNX element types; the
        first refused output raises the importer's ``ModelError``."""
        results = self.run_each(inputs)
        for value in results.values():
            if isinstance(value, ModelError):
                raise value
        return namedtupledict("Outputs", self.output_names)(*results.values())

    def run_each(self, inputs: Any) -> dict[str, np.ndarray | ModelError]:
        """Every output computed on its own, in graph order: its value (as ``run`` gives
        it), or the ``ModelError`` refusing it. Inputs that cannot be read at all raise."""
        feeds = self._feeds(inputs)
        results: dict[str, np.ndarray | ModelError] = {}
        for name in self.output_names:
            try:
                results[name] = self._run_output(name, feeds)
            except ModelError as e:
                results[name] = e
        return results

    def _feeds(self, inputs: Any) -> dict[str, np.ndarray]:
        """The inputs by name, each in the element type the model declares for it."""
        given = self._given(inputs)
        types = {i.name: i.type.tensor_type.elem_type for i in self.model.graph.input}
        return {
            n: np.asarray(v, dtype=helper.tensor_dtype_to_np_dtype(types[n])) if types.get(n) else v
            for n, v in given.items()
        }

    def _given(self, inputs: Any) -> dict[str, np.ndarray]:
        if isinstance(inputs, Mapping):
            missing = [n for n in self.input_names if n not in inputs]
            if missing:
                raise ModelError(
                    f"inputs {missing} are not given; the model reads {self.input_names}"
                )
            return {n: np.asarray(inputs[n]) for n in self.input_names}
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        inputs = list(inputs)
        if len(inputs) != len(self.input_names):
            raise ModelError(
                f"{len(inputs)} inputs given; the model reads {len(self.input_names)}: "
                f"{list(self.input_names)}"
            )
        return {n: np.asarray(v) for n, v in zip(self.input_names, inputs, strict=True)}

    def _run_output(self, output: str, given: dict[str, np.ndarray]) -> np.ndarray:
        if output in given:  # a graph input that is also an output: no op computes it
            return self._typed(output, given[output])
        feeds = _widened(self.model, given)
        try:
            graph, prepared = self._import(output, feeds)
        except IllTyped:  # an op of the model takes no int64 there: refused as given
            feeds = given
            graph, prepared = self._import(output, feeds)
        values: dict[str, Any] = {
            **prepared.constants,
            **{name: t.read() for name, t in prepared.float_initializers.items()},
            **{k: v for k, v in feeds.items() if k in graph.tensors},
        }
        values = _in_ir_dtypes(graph, values)
        result = _execute(self.xp, graph, values, _result_name(graph, output), self.seed)
        return self._typed(output, result.get() if hasattr(result, "get") else result)

    def _typed(self, output: str, result: Any) -> np.ndarray:
        """``result`` as a fresh numpy array in the output's ONNX element type: a mask
        computed as 0/1 becomes bool; ids wrap into a narrower integer type as that
        type's arithmetic would have."""
        result = np.asarray(result)
        elem = self.output_types.get(output, 0)
        return result.astype(helper.tensor_dtype_to_np_dtype(elem) if elem else result.dtype)

    def _import(self, output: str, feeds: dict[str, np.ndarray]):
        """The graph computing ``output``, with the other float inputs bound as weights
        or, where a converter wants a constant there (Clip's min, Pow's exponent), as
        constants; the importer's refusal if neither imports."""
        try:
            return _import_bound(self.model, output, feeds, FloatBinding.WEIGHT)
        except ModelError as as_weights:
            if not _binds_floats(self.model, output, feeds) or "constant" not in str(as_weights):
                raise
            try:
                return _import_bound(self.model, output, feeds, FloatBinding.CONSTANT)
            except ModelError as as_constants:
                raise as_constants from as_weights


def _widened(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` with the inputs of a narrow integer type (``_WIDENED``) as int64; the same
    dict where there are none."""
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    narrow = [n for n in feeds if types.get(n) in _WIDENED]
    if not narrow:
        return feeds
    return {n: v.astype(np.int64) if n in narrow else v for n, v in feeds.items()}


def _read_opsets(
    opsets: Sequence[onnx.OperatorSetIdProto], nodes: Sequence[onnx.NodeProto]
) -> list[onnx.OperatorSetIdProto]:
    """The opset imports to save the copy with: an ai.onnx opset older than the importer
    reads is raised to the oldest it reads where every node's schema is the same at
    both (the nodes then mean what they meant), else left for the importer to refuse."""
    lifted = []
    for imp in opsets:
        old = imp.version
        if imp.domain in ("", "ai.onnx") and old < MIN_OPSET:
            same = all(
                (v := schema_version(n.op_type, old)) is not None
                and v == schema_version(n.op_type, MIN_OPSET)
                for n in nodes
                if n.domain in ("", "ai.onnx")
            )
            if same:
                imp = helper.make_opsetid(imp.domain, MIN_OPSET)
        lifted.append(imp)
    return lifted


def _output_types(model: onnx.ModelProto) -> dict[str, int]:
    """Each graph output's ONNX element type: declared, else inferred (0 if neither)."""
    declared = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    if all(declared.values()):
        return declared
    inferred: dict[str, int] = {}
    with contextlib.suppress(Exception):  # a model shape inference cannot read: as given
        typed = onnx.shape_inference.infer_shapes(model)
        for v in [*typed.graph.value_info, *typed.graph.output]:
            inferred.setdefault(v.name, v.type.tensor_type.elem_type)
    return {n: elem or inferred.get(n, 0) for n, elem in declared.items()}


def _in_ir_dtypes(graph: Graph, values: dict[str, Any]) -> dict[str, Any]:
    """The values the ops read, each in its tensor's IR dtype, as the executor holds them:
    a bool constant (a 0/1 float tensor in the IR) in the run's float dtype, a bool mask
    input as 0/1 ids."""
    floats = [v for k, v in values.items() if k in graph.tensors and v.dtype.kind == "f"]
    run_dtype = np.float64 if any(v.dtype == np.float64 for v in floats) else np.float32
    converted = {}
    for name, value in values.items():
        tensor = graph.tensors.get(name)
        if tensor is None:
            continue
        if tensor.dtype.is_float and value.dtype.kind != "f":
            value = value.astype(run_dtype)
        elif not tensor.dtype.is_float and value.dtype.kind == "b":
            value = value.astype(np.int64)
        converted[name] = value
    return converted


class IllTyped(ModelError):
    """The copy with narrow integer inputs widened to int64 breaks an op's type
    constraints (MaxPool takes uint8, not int64): the model is to be read as given."""


class FloatBinding(Enum):
    """How a float input other than the data input is bound into the imported copy."""

    WEIGHT = "weight"  # a float initializer: a tensor operand
    CONSTANT = "constant"  # a Constant node, folded: what ``ctx.constant`` reads


def _import_bound(
    model: onnx.ModelProto, output: str, feeds: dict[str, np.ndarray], floats: FloatBinding
) -> tuple[Graph, Prepared]:
    with tempfile.TemporaryDirectory(prefix="onnx2soap-backend-") as tmp:
        path = Path(tmp) / "model.onnx"
        data = _bind_inputs(model, output, feeds, path, floats)
        try:
            prepared = prepare_model(path, feeds[data].shape[0])
            has_loss = any(d.is_loss for d in _definitions(prepared.nodes, prepared.opset))
            graph = build_graph(prepared, None if has_loss else LossKind.NONE)
        except ModelError as e:
            raise ModelError(str(e).replace(f"{path}: ", "").replace(str(path), "model")) from e
    return graph, prepared


def _definitions(nodes: Sequence[onnx.NodeProto], opset: int):
    reg = registry()
    return [d for n in nodes if (d := reg.for_node(n.op_type, n.domain, opset)) is not None]


def _result_name(graph: Graph, output: str) -> str:
    """The tensor holding ``output``: the loss's own output, or the (alias-resolved)
    graph output."""
    loss = graph.loss_op
    if loss is not None:
        if loss.output != output:
            raise ModelError(
                f"output '{output}': of a model with a loss only the loss ('{loss.output}') "
                "can be computed"
            )
        return loss.output
    return graph.output


def _used_inputs(model: onnx.ModelProto, output: str, feeds: dict[str, np.ndarray]):
    """The nodes ``output`` needs, the given inputs they read, and the float ones."""
    nodes = _needed_nodes(model.graph, output)
    read = {i for n in nodes for i in n.input}
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    used = [n for n in feeds if n in read]
    return nodes, used, [n for n in used if types.get(n) in _FLOAT_TYPES]


def _data_input(model: onnx.ModelProto, output: str, used: list[str], floats: list[str]) -> str:
    """The input that stays the data input: the first float one, else the first ids or
    mask one."""
    if floats:
        return floats[0]
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    ids = [n for n in used if types.get(n) in _ID_TYPES]
    if not ids:
        raise ModelError(
            f"output '{output}' depends on no float, integer or bool graph input; onnx2soap "
            "needs one data input (batched along axis 0)"
        )
    return ids[0]


def _binds_floats(model: onnx.ModelProto, output: str, feeds: dict[str, np.ndarray]) -> bool:
    """Whether a float input besides the data input is bound (to a weight or constant)."""
    nodes, _, floats = _used_inputs(model, output, feeds)
    return len(set(floats) - _loss_labels(nodes)) > 1


def _bind_inputs(
    model: onnx.ModelProto,
    output: str,
    feeds: dict[str, np.ndarray],
    path: Path,
    floats_as: FloatBinding = FloatBinding.WEIGHT,
) -> str:
    """Save at ``path`` the model computing only ``output``, with every input but the data
    input (returned) and the labels bound to its value: an integer one as an initializer
    (a constant), a float one as ``floats_as`` says. The inputs kept are declared in
    their feeds' types (narrow integers widened)."""
    graph = model.graph
    nodes, used, floats = _used_inputs(model, output, feeds)
    data, labels = _data_input(model, output, used, floats), _loss_labels(nodes)
    if feeds[data].ndim == 0 or feeds[data].shape[0] == 0:
        raise ModelError(
            f"the data input '{data}' is {'a scalar' if feeds[data].ndim == 0 else 'empty'}; "
            "onnx2soap batches the data along axis 0, at least one sample"
        )
    kept = {data} | (labels & set(used))
    inputs = [
        helper.make_tensor_value_info(
            n, helper.np_dtype_to_tensor_dtype(feeds[n].dtype), feeds[n].shape
        )
        for n in used
        if n in kept
    ]
    # np.array, not np.ascontiguousarray: the latter makes a 0-d value 1-d.
    values = {n: numpy_helper.from_array(np.array(feeds[n], order="C"), n) for n in used}
    as_node = set(floats) if floats_as is FloatBinding.CONSTANT else set()
    bound = [values[n] for n in used if n not in kept and n not in as_node]
    constants = [
        helper.make_node("Constant", [], [n], value=values[n])
        for n in used
        if n not in kept and n in as_node
    ]
    nodes = [*constants, *nodes]
    outputs = [o for o in graph.output if o.name == output]
    types = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    widened = any(types.get(n) in _WIDENED and feeds[n].dtype == np.int64 for n in used)
    if widened:  # what is computed from a widened input is widened: inference types it
        outputs = [onnx.ValueInfoProto(name=output)]
    sub = helper.make_graph(
        nodes, graph.name or "backend", inputs, outputs, [*graph.initializer, *bound]
    )
    copy = helper.make_model(sub, opset_imports=_read_opsets(model.opset_import, sub.node))
    copy.ir_version = max(model.ir_version, 4)  # initializers need not be graph inputs
    # The checker wants the output's shape, which the caller need not give: infer it.
    if widened:
        try:
            copy = onnx.shape_inference.infer_shapes(copy, check_type=True, strict_mode=True)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as e:
            raise IllTyped(f"with its narrow integers read as int64: {e}") from e
    with contextlib.suppress(Exception):
        copy = onnx.shape_inference.infer_shapes(copy)
    onnx.save(copy, str(path))
    return data


def _execute(xp, graph: Graph, values: dict[str, Any], result: str, seed: int):
    """Every op of ``graph`` in order, as one task of its kernels on ``xp``."""
    arrays = {k: xp.asarray(v) for k, v in values.items()}
    for op in graph.ops:
        # Keyed by the op's name, not its index: each output runs its own pruned graph,
        # and an op they share must draw the same values for all of them.
        key = RandomKey(seed, 0, zlib.crc32(op.name.encode()))
        arrays[op.output] = _run_op(xp, graph, op, arrays, key)
    if result not in arrays:
        raise ModelError(f"output '{result}' is computed by no op of the imported model")
    return arrays[result]


def _run_op(xp, graph: Graph, op: Op, arrays: dict[str, Any], random: RandomKey):
    """One task covering the whole op, given what the runtime gives a training task: the
    random key (a training-mode Dropout drops, as the spec says) and the statistics,
    which one task sums alone."""
    missing = [t for t in op.inputs if t not in arrays]
    if missing:
        raise ModelError(f"op '{op.name}' ({op.type}) reads {missing}, which hold no value")
    operands = [arrays[t] for t in op.inputs]
    config = ParallelConfig((1,) * len(op.nest.dims), (0,))
    (task,) = op_tasks(op, config, [a.shape for a in operands])
    d = definition(op.type)
    scale = 1.0
    if op.is_loss:  # the divisor of a mean loss over the whole batch
        labels = operands[op.inputs.index(graph.labels)]
        labels = labels.get() if hasattr(labels, "get") else labels
        scale = d.loss_scale(op.attrs, np.asarray(labels), tuple(operands[0].shape))
    buffers = [slice_from_full(xp, a, r) for a, r in zip(operands, task.inputs, strict=True)]
    out_shape = rect_shape(task.output)
    args = TaskArgs(
        out_shape=out_shape,
        valid=tuple(r.valid for r in task.inputs),
        loss_scale=scale,
        origin=(0,) * len(out_shape),
        full_shape=out_shape,
        random=random,
        float_dtype=np.dtype(np.float64)
        if any(getattr(b, "dtype", None) == np.float64 for b in buffers)
        else np.dtype(np.float32),
    )
    if d.statistics is not None:  # one task: its partial statistics are all there are
        partial = d.statistics.forward(xp, op.attrs, buffers, args)
        args = replace(args, stats=d.statistics.combine_forward(xp, partial[None]))
    return d.forward(xp, op.attrs, buffers, args)


class SoapBackend(Backend):
    """onnx2soap's kernels behind the ONNX backend API, one device."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> SoapBackendRep:
        if isinstance(model, (str, Path)):
            model = onnx.load(str(model))
        return SoapBackendRep(model, device, seed=int(kwargs.get("seed", 0)))

    @classmethod
    def run_model(
        cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any
    ) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(
        cls,
        node: onnx.NodeProto,
        inputs: Any,
        device: str = "CPU",
        outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """One node on ``inputs`` (a list for the node's present inputs, or a dict)."""
        present = [n for n in node.input if n]
        if isinstance(inputs, Mapping):
            inputs = [inputs[n] for n in present]
        arrays = [np.asarray(v) for v in inputs]
        value_infos = [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for n, a in zip(present, arrays, strict=True)
        ]
        outputs = [o for o in node.output if o]
        if outputs_info:
            out_infos = [
                helper.make_tensor_value_info(
                    n, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape
                )
                for n, (dtype, shape) in zip(outputs, outputs_info, strict=True)
            ]
        else:
            out_infos = [onnx.ValueInfoProto(name=n) for n in outputs]
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        graph = helper.make_graph([node], "node", value_infos, out_infos)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        if not outputs_info:  # let shape inference type the outputs
            inferred = onnx.shape_inference.infer_shapes(model)
            typed = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.output]}
            del model.graph.output[:]
            model.graph.output.extend(typed.get(n, onnx.ValueInfoProto(name=n)) for n in outputs)
        return cls.prepare(model, device).run(arrays)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            kind = Device(device).type
        except (AttributeError, ValueError):
            return False
        return kind == DeviceType.CPU or (kind == DeviceType.CUDA and _cuda_available())


is_compatible = SoapBackend.is_compatible
prepare = SoapBackend.prepare
run_model = SoapBackend.run_model
run_node = SoapBackend.run_node
supports_device = SoapBackend.supports_device
