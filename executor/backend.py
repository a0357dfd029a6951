"""The ONNX backend API (``onnx.backend.base.Backend``) on one device, with onnx2soap's kernels.

    from executor import backend
    rep = backend.prepare(model, device="CPU")   # onnx.ModelProto
    (y,) = rep.run([x])                           # or rep.run({"x": x})
    backend.run_model(model, [x]); backend.run_node(node, [x]); backend.supports_device("CUDA")

onnx2soap imports a model with exactly one float data input, batched along axis 0, and
reads float initializers as weights and integer ones as constants. So ``run`` binds the
given values into a copy of the model: the first float graph input the requested output
depends on stays the data input (its axis 0 is the batch), every other input becomes an
initializer holding its value (a float one a weight, an integer one a constant), except a
loss's labels, which stay graph inputs as the importer expects. That copy is imported by
the real importer (``prepare`` + ``build_graph``, no loss attached) and its ops run in
graph order, each as one task of its registry kernels over buffers cut from the whole
tensors, exactly as a one-device plan runs them. A graph with several outputs is imported
once per output (the graph pruned to what that output needs). Models the importer refuses
raise its ``ModelError``, the temporary file's path left out.
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
from onnx2soap.importer.prepare import Prepared
from onnx2soap.importer.prepare import prepare as prepare_model
from onnx2soap.ir import Graph, LossKind, Op
from onnx2soap.ops import TaskArgs, definition, registry
from onnx2soap.ops.base import RandomKey
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
        self.output_types = {
            o.name: o.type.tensor_type.elem_type for o in model.graph.output if o.type.tensor_type
        }

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The outputs, in graph order, as numpy arrays in the dtype the model declares."""
        feeds = self._feeds(inputs)
        values = [self._run_output(name, feeds) for name in self.output_names]
        return namedtupledict("Outputs", self.output_names)(*values)

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

    def _run_output(self, output: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
        if output in feeds:  # a graph input that is also an output: no op computes it
            return feeds[output].copy()
        graph, prepared = self._import(output, feeds)
        values: dict[str, Any] = {
            **prepared.constants,
            **prepared.float_initializers,
            **{k: v for k, v in feeds.items() if k in graph.tensors},
        }
        result = _execute(self.xp, graph, values, _result_name(graph, output), self.seed)
        result = result.get() if hasattr(result, "get") else np.asarray(result)
        elem = self.output_types.get(output, 0)
        dtype = helper.tensor_dtype_to_np_dtype(elem) if elem else result.dtype
        return np.asarray(result, dtype=dtype)

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
            prepared = prepare_model(path, feeds[data].shape[0], allow_nonfinite=True)
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
    (a constant), a float one as ``floats_as`` says."""
    graph = model.graph
    types = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    nodes, used, floats = _used_inputs(model, output, feeds)
    if not floats:
        raise ModelError(
            f"output '{output}' depends on no float graph input; onnx2soap needs one float "
            "data input (batched along axis 0)"
        )
    data, labels = floats[0], _loss_labels(nodes)
    if feeds[data].ndim == 0 or feeds[data].shape[0] == 0:
        raise ModelError(
            f"the data input '{data}' is {'a scalar' if feeds[data].ndim == 0 else 'empty'}; "
            "onnx2soap batches the data along axis 0, at least one sample"
        )
    kept = {data} | (labels & set(used))
    inputs = [helper.make_tensor_value_info(n, types[n], feeds[n].shape) for n in used if n in kept]
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
    sub = helper.make_graph(
        nodes, graph.name or "backend", inputs, outputs, [*graph.initializer, *bound]
    )
    copy = helper.make_model(sub, opset_imports=list(model.opset_import))
    copy.ir_version = max(model.ir_version, 4)  # initializers need not be graph inputs
    # The checker wants the output's shape, which the caller need not give: infer it.
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
