"""One-node ONNX models from the op definitions' cases, and running a kernel over tasks.

A ``Case`` (``onnx2soap.ops.base``) lists the node's inputs: the data input ``x`` (the
graph's float input), weights (float initializers), constants (int or float
initializers the importer folds into the op), labels (a second graph input) and omitted
optionals. ``CaseLoader`` saves a case once, imports it with the real importer and caches
it, so hypothesis examples do not re-import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from executor.buffers import global_slices, local_slices, slice_from_full
from executor.data import id_bound
from onnx2soap.importer import ImportedModel, load_model
from onnx2soap.ir import Graph, LossKind, Op
from onnx2soap.ops import TaskArgs, definition
from onnx2soap.ops.base import Case, InputKind, RandomKey, Sample
from onnx2soap.soap import analyze
from onnx2soap.soap.partition import (
    ParallelConfig,
    Task,
    op_tasks,
    rect_shape,
    stat_groups,
    sum_groups,
)

_ONNX_TYPES = {
    "float32": onnx.TensorProto.FLOAT,
    "float64": onnx.TensorProto.DOUBLE,
    "int64": onnx.TensorProto.INT64,
    "bool": onnx.TensorProto.BOOL,
}


def _input_names(c: Case) -> list[str]:
    names, counts = [], {}
    prefix = {
        InputKind.DATA: "x",
        InputKind.WEIGHT: "w",
        InputKind.CONSTANT: "c",
        InputKind.LABELS: "labels",
    }
    for i in c.inputs:
        if i.kind is InputKind.OMITTED:
            names.append("")
            continue
        k = counts.get(i.kind, 0)
        counts[i.kind] = k + 1
        p = prefix[i.kind]
        names.append(p if i.kind in (InputKind.DATA, InputKind.LABELS) else f"{p}{k}")
    return names


# Ops onnx2soap attaches itself: their cases are built as an Identity with that loss.
ATTACHED_LOSSES = {"MeanSquaredError": LossKind.MSE}


def build_model(c: Case, path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    if c.op_type in ATTACHED_LOSSES:
        c = Case(c.id, "Identity", tuple(i for i in c.inputs if i.kind is InputKind.DATA))
    names = _input_names(c)
    inits, graph_inputs, nodes = [], [], []
    for name, i in zip(names, c.inputs, strict=True):
        if i.kind is InputKind.WEIGHT:
            value = sample(c, i.shape, rng, np.float32)
            inits.append(numpy_helper.from_array(value, name))
        elif i.kind is InputKind.CONSTANT and i.dtype.startswith("float"):
            # A Constant node, as the legacy exporter writes `x * 0.5`.
            value = np.array(i.values, dtype=i.dtype).reshape(i.shape)
            nodes.append(
                helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value))
            )
        elif i.kind is InputKind.CONSTANT:
            value = np.array(i.values, dtype=i.dtype).reshape(i.shape)
            inits.append(numpy_helper.from_array(value, name))
        elif i.kind in (InputKind.DATA, InputKind.LABELS):
            dtype = _ONNX_TYPES[i.dtype]
            graph_inputs.append(helper.make_tensor_value_info(name, dtype, i.shape))
    outputs = ["y", *(f"unread{k}" for k in range(c.extra_outputs))]
    node = helper.make_node(c.op_type, names, outputs, **dict(c.attrs))
    graph = helper.make_graph(
        [*nodes, node],
        c.id,
        graph_inputs,
        [helper.make_tensor_value_info("y", _ONNX_TYPES[c.output], None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", c.opset)])
    model.ir_version = 9  # what onnxruntime 1.17+ reads for opsets up to 19
    # The checker wants the output's shape: let shape inference write it.
    onnx.save(onnx.shape_inference.infer_shapes(model, strict_mode=True), str(path))


class CaseLoader:
    """Saves each case once under ``directory`` and imports it (cached). A plain class:
    hypothesis prints a dataclass field by field, cache included, on every failure."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._cache: dict[Case, tuple[Path, ImportedModel]] = {}

    def __repr__(self) -> str:
        return f"CaseLoader({str(self.directory)!r})"

    def __call__(self, c: Case) -> tuple[Path, ImportedModel]:
        if c not in self._cache:
            path = self.directory / f"{c.id}.onnx"
            build_model(c, path)
            is_loss = definition(c.op_type).is_loss
            loss = ATTACHED_LOSSES.get(c.op_type, None if is_loss else LossKind.NONE)
            self._cache[c] = (path, load_model(path, loss=loss))
        return self._cache[c]


def op_of(model: ImportedModel) -> Op:
    """The op a case is about: its loss if it has one, else its only op."""
    return model.graph.loss_op or model.graph.ops[0]


def ort_run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


# --- data -------------------------------------------------------------------------------


def sample(c: Case, shape: Sequence[int], rng: np.random.Generator, dtype=np.float64):
    """Random data drawn as the case asks (see ``Sample``)."""
    if c.sample is Sample.DISTINCT:
        size = math.prod(shape)
        return (rng.permutation(size).reshape(shape) / 7.0 - size / 14.0).astype(dtype)
    x = rng.standard_normal(shape)
    if c.sample is Sample.AWAY_FROM_ZERO:
        x = np.where(np.abs(x) < 0.05, 0.5, x)
    elif c.sample is Sample.POSITIVE:
        x = rng.uniform(0.5, 2.0, shape)
    return x.astype(dtype)


def labels_for(graph: Graph, op: Op, rng: np.random.Generator, dtype=np.float64) -> np.ndarray:
    t = graph.tensors[graph.labels]
    if t.dtype.is_float:
        return rng.standard_normal(t.shape).astype(dtype)
    classes = graph.tensors[op.inputs[0]].shape[op.attrs.class_axis]
    return rng.integers(0, classes, t.shape)


def operand_arrays(
    c: Case, model: ImportedModel, rng: np.random.Generator, ties: bool = False, dtype=np.float64
) -> list[np.ndarray]:
    """One array per operand of the case's op: data, weights (drawn fresh) and labels."""
    graph, op = model.graph, op_of(model)
    arrays = []
    for t in op.inputs:
        tensor = graph.tensors[t]
        if t == graph.labels:
            arrays.append(labels_for(graph, op, rng, dtype))
        elif t in graph.inputs and not tensor.dtype.is_float:  # token ids, or a 0/1 mask
            arrays.append(rng.integers(0, id_bound(graph, t), tensor.shape))
        elif t in model.constants:  # the value the op was built with, ids kept int
            width = dtype if tensor.dtype.is_float else np.int64
            arrays.append(np.asarray(model.constants[t], dtype=width))
        elif ties:  # small integers: windows full of equal maxima
            arrays.append(rng.integers(-2, 3, tensor.shape).astype(dtype))
        else:
            arrays.append(sample(c, tensor.shape, rng, dtype))
    return arrays


# --- running a kernel over tasks ------------------------------------------------------


def operand_shapes(graph: Graph, op: Op) -> list[tuple[int, ...]]:
    return [graph.tensors[t].shape for t in op.inputs]


def one_task(op: Op) -> ParallelConfig:
    return ParallelConfig((1,) * len(op.nest.dims), (0,))


def config_of(degrees: Sequence[int]) -> ParallelConfig:
    degrees = tuple(degrees)
    return ParallelConfig(degrees, tuple(range(math.prod(degrees))))


def tasks_of(graph: Graph, op: Op, config: ParallelConfig) -> tuple[Task, ...]:
    return op_tasks(op, config, operand_shapes(graph, op))


# Random ops draw from this key in the op tests (as in training step 3 of seed 7).
TEST_RANDOM = RandomKey(seed=7, step=3, op=0)


def task_args(
    task: Task, loss_scale: float = 1.0, full_shape=(), float_dtype=np.float64
) -> TaskArgs:
    """What the runtime gives a kernel while training (a random op draws its bits)."""
    return TaskArgs(
        float_dtype=np.dtype(float_dtype),
        out_shape=rect_shape(task.output),
        valid=tuple(r.valid for r in task.inputs),
        loss_scale=loss_scale,
        origin=tuple(lo for lo, _ in task.output),
        box=task.box,
        full_shape=tuple(full_shape),
        random=TEST_RANDOM,
    )


def loss_scale_of(graph: Graph, op: Op, arrays: Sequence[np.ndarray]) -> float:
    """The whole batch's divisor for a loss op (1 for other ops)."""
    if not op.is_loss:
        return 1.0
    labels = arrays[op.inputs.index(graph.labels)]
    return definition(op.type).loss_scale(op.attrs, labels, arrays[0].shape)


def buffers(task: Task, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [slice_from_full(np, a, r) for a, r in zip(arrays, task.inputs, strict=True)]


def all_task_args(
    graph: Graph,
    op: Op,
    config: ParallelConfig,
    arrays: Sequence[np.ndarray],
    grad_output: np.ndarray | None = None,
) -> list[TaskArgs]:
    """Every task's ``TaskArgs``. For an op with statistics: each stat group's partial
    sums added up, as the executor's ``ReduceStats`` does (and, given ``grad_output``, the
    backward's too)."""
    d = definition(op.type)
    scale = loss_scale_of(graph, op, arrays)
    shape = graph.tensors[op.output].shape
    tasks = tasks_of(graph, op, config)
    floats = [a.dtype for a in arrays if a.dtype.kind == "f"]
    # ops of ids only (a Cast to float) produce float32, as onnxruntime does here
    args = [task_args(t, scale, shape, floats[0] if floats else np.float32) for t in tasks]
    if not op.nest.sync_dims:
        return args
    stats = d.statistics
    phases = (
        ("stats", stats.forward, stats.combine_forward),
        ("grad_stats", stats.backward, stats.combine_backward),
    )
    for field, partial, combine in phases:
        if field == "grad_stats" and grad_output is None:
            break
        sums = {}
        for group in stat_groups(op, tasks):
            parts = []
            for i in group.tasks:
                bufs = buffers(tasks[i], arrays)
                if field == "stats":
                    parts.append(partial(np, op.attrs, bufs, args[i]))
                else:
                    out = d.forward(np, op.attrs, bufs, args[i])
                    tile = grad_output[global_slices(tasks[i].output)]
                    parts.append(partial(np, op.attrs, bufs, out, tile, args[i]))
            combined = combine(np, np.stack(parts))  # in the group's task order
            sums.update({i: combined for i in group.tasks})
        args = [replace(a, **{field: sums[i]}) for i, a in enumerate(args)]
    return args


def forward_full(
    graph: Graph, op: Op, config: ParallelConfig, arrays: Sequence[np.ndarray]
) -> np.ndarray:
    """Every task's forward on its buffers, each tile placed at ``task.output`` (a loss's
    partial losses summed)."""
    d = definition(op.type)
    scale = loss_scale_of(graph, op, arrays)
    shape = graph.tensors[op.output].shape
    floats = [a.dtype for a in arrays if a.dtype.kind == "f"]
    if graph.tensors[op.output].dtype.is_float:
        dtype = floats[0] if floats else np.dtype(np.float32)
    else:
        dtype = np.dtype(np.int64)
    if op.is_loss:
        tiles = [
            d.forward(np, op.attrs, buffers(t, arrays), task_args(t, scale, shape))
            for t in tasks_of(graph, op, config)
        ]
        return np.asarray(sum(tiles), dtype=dtype)
    out = np.zeros(shape, dtype=dtype)
    covered = np.zeros(shape, dtype=np.int64)
    args = all_task_args(graph, op, config, arrays)
    tasks = tasks_of(graph, op, config)
    for task in tasks:
        tile = d.forward(np, op.attrs, buffers(task, arrays), args[task.index])
        assert tile.shape == rect_shape(task.output), (tile.shape, task.output)
        out[global_slices(task.output)] += tile  # partial sums add up; others cover once
        covered[global_slices(task.output)] += 1
    shares = {len(g.tasks) for g in sum_groups(op, tasks)} or {1}
    assert len(shares) == 1 and (covered == shares.pop()).all(), "tiles must cover the output"
    return out


def backward_full(
    graph: Graph,
    op: Op,
    config: ParallelConfig,
    arrays: Sequence[np.ndarray],
    grad_output: np.ndarray,
) -> list[np.ndarray | None]:
    """Every task's backward; each buffer gradient's in-tensor part summed into a full
    gradient (what the executor's halo and replica reductions do). None for operands
    that take no gradient (labels)."""
    d = definition(op.type)
    grads: list[np.ndarray | None] = [np.zeros_like(a) for a in arrays]
    every = all_task_args(graph, op, config, arrays, None if op.is_loss else grad_output)
    for task in tasks_of(graph, op, config):
        bufs = buffers(task, arrays)
        args = every[task.index]
        out = d.forward(np, op.attrs, bufs, args)
        tile_grad = grad_output if op.is_loss else grad_output[global_slices(task.output)]
        task_grads = d.backward(np, op.attrs, bufs, out, np.array(tile_grad, copy=True), args)
        assert len(task_grads) == len(bufs)
        for k, (g, b, region) in enumerate(zip(task_grads, bufs, task.inputs, strict=True)):
            if g is None:
                grads[k] = None
                continue
            assert g.shape == b.shape and g.dtype == b.dtype
            grads[k][global_slices(region.data)] += g[local_slices(region.data, region.buffer)]
    return grads


def splittable_degrees(graph: Graph, op: Op) -> list[tuple[str, int, bool]]:
    """(name, most pieces it can be cut into, splittable) per dim of ``op``."""
    return [(d.name, d.max_degree, d.splittable) for d in analyze(graph)[op.name]]


def central_difference(
    f: Callable[[], float], array: np.ndarray, index: tuple[int, ...], eps: float
) -> float:
    """d f / d array[index], perturbing ``array`` in place (restored afterwards)."""
    keep = array[index]
    array[index] = keep + eps
    plus = f()
    array[index] = keep - eps
    minus = f()
    array[index] = keep
    return (plus - minus) / (2 * eps)


def traced_peak(run) -> tuple[int, object]:
    """Bytes numpy allocated at the peak of ``run()`` above what was held before (the
    executor's ``--trace`` measure), and its result."""
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = run()
        return tracemalloc.get_traced_memory()[1] - base, out
    finally:
        tracemalloc.stop()
