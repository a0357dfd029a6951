"""One-node ONNX models for the kernel tests, and running a kernel over an op's tasks.

A ``Case`` is one ONNX node whose data input ``x`` is the graph's float input and whose
other operands are float initializers (weights). ``CaseLoader`` saves it, imports it with
the real importer and caches the result, so hypothesis examples do not re-import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from executor.buffers import global_slices, local_slices, slice_from_full
from executor.kernels import kernel_for
from executor.kernels.base import TaskArgs
from onnx2soap.importer import ImportedModel, load_model
from onnx2soap.ir import Graph, LossKind, Op
from onnx2soap.soap import analyze
from onnx2soap.soap.partition import ParallelConfig, Task, op_tasks, rect_shape

Attr = int | float | str | tuple[int, ...]


@dataclass(frozen=True)
class Case:
    id: str
    op_type: str
    x_shape: tuple[int, ...]
    weights: tuple[tuple[int, ...], ...] = ()
    attrs: tuple[tuple[str, Attr], ...] = ()
    opset: int = 17
    x_position: int = 0  # where x sits among the node's float inputs
    shape_input: tuple[int, ...] | None = None  # Reshape's constant shape

    def __str__(self) -> str:
        return self.id


def case(
    id: str,
    op_type: str,
    x_shape: Sequence[int],
    weights: Sequence[Sequence[int]] = (),
    *,
    opset: int = 17,
    x_position: int = 0,
    shape_input: Sequence[int] | None = None,
    **attrs: Attr | list[int],
) -> Case:
    """A hashable ``Case``; ONNX attributes as keywords (lists become tuples)."""
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs.items()))
    shape = tuple(shape_input) if shape_input is not None else None
    return Case(
        id, op_type, tuple(x_shape), tuple(map(tuple, weights)), frozen, opset, x_position, shape
    )


CASES = [
    # elementwise
    case("add_bias", "Add", (2, 3, 4, 5), [(3, 1, 1)]),
    case("add_vector", "Add", (2, 3, 5), [(5,)], x_position=1),
    case("add_both_broadcast", "Add", (2, 1, 4), [(3, 1)]),
    case("relu", "Relu", (2, 3, 4)),
    case("identity", "Identity", (3, 4)),
    # matrix products
    case("gemm", "Gemm", (4, 3), [(3, 5)]),
    case("gemm_bias1d", "Gemm", (4, 3), [(3, 5), (5,)]),
    case("gemm_bias2d", "Gemm", (4, 3), [(3, 5), (4, 5)], alpha=0.5, beta=2.0),
    case("gemm_bias_col", "Gemm", (4, 3), [(5, 3), (4, 1)], transB=1),
    case("gemm_trans", "Gemm", (3, 4), [(5, 3), (1, 5)], transA=1, transB=1, alpha=-1.5),
    case("matmul_2d", "MatMul", (4, 3), [(3, 5)]),
    case("matmul_weight_2d", "MatMul", (2, 3, 4, 5), [(5, 6)]),
    case("matmul_batch_bcast", "MatMul", (2, 1, 4, 5), [(3, 5, 6)]),
    case("matmul_weight_batch", "MatMul", (2, 4, 5), [(3, 1, 5, 6)]),
    # convolution
    case("conv2d", "Conv", (2, 3, 6, 7), [(4, 3, 3, 3), (4,)], pads=[1, 1, 1, 1]),
    case(
        "conv2d_strided_dilated",
        "Conv",
        (2, 2, 9, 8),
        [(3, 2, 3, 2)],
        strides=[2, 3],
        dilations=[2, 1],
        pads=[1, 2, 2, 0],
    ),
    case("conv2d_groups", "Conv", (2, 4, 6, 6), [(6, 2, 3, 3), (6,)], group=2, strides=[2, 1]),
    case("conv2d_depthwise", "Conv", (2, 3, 5, 5), [(3, 1, 3, 3)], group=3, pads=[2, 2, 2, 2]),
    case("conv2d_same_upper", "Conv", (1, 2, 7, 6), [(3, 2, 4, 3)], auto_pad="SAME_UPPER"),
    case(
        "conv2d_same_lower",
        "Conv",
        (1, 2, 7, 6),
        [(3, 2, 4, 2), (3,)],
        auto_pad="SAME_LOWER",
        strides=[2, 2],
    ),
    case("conv2d_valid", "Conv", (2, 2, 6, 6), [(2, 2, 2, 3)], auto_pad="VALID", strides=[2, 1]),
    case("conv1d", "Conv", (2, 3, 11), [(4, 3, 3), (4,)], strides=[2], dilations=[2], pads=[2, 1]),
    case("conv3d", "Conv", (1, 2, 4, 5, 4), [(3, 2, 2, 3, 2)], pads=[1, 0, 1, 0, 1, 1]),
    # pooling
    case("maxpool2d", "MaxPool", (2, 3, 7, 7), kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4),
    case(
        "maxpool2d_ceil",
        "MaxPool",
        (1, 2, 8, 7),
        kernel_shape=[3, 2],
        strides=[2, 2],
        pads=[1, 0, 1, 1],
        ceil_mode=1,
    ),
    case(
        "maxpool2d_dilated",
        "MaxPool",
        (1, 2, 9, 8),
        kernel_shape=[2, 3],
        strides=[1, 2],
        dilations=[3, 2],
        pads=[1, 2, 0, 1],
    ),
    case(
        "maxpool1d_same",
        "MaxPool",
        (2, 3, 10),
        kernel_shape=[4],
        strides=[3],
        auto_pad="SAME_LOWER",
    ),
    case("maxpool3d", "MaxPool", (1, 2, 5, 4, 5), kernel_shape=[2, 2, 3], strides=[2, 1, 2]),
    case(
        "avgpool2d", "AveragePool", (2, 3, 7, 7), kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4
    ),
    case(
        "avgpool2d_include_pad",
        "AveragePool",
        (2, 2, 7, 6),
        kernel_shape=[3, 2],
        strides=[2, 1],
        pads=[1, 1, 2, 0],
        count_include_pad=1,
    ),
    case(
        "avgpool2d_ceil",
        "AveragePool",
        (1, 2, 8, 6),
        kernel_shape=[3, 3],
        strides=[2, 2],
        pads=[1, 0, 1, 1],
        ceil_mode=1,
    ),
    case(
        "avgpool2d_ceil_include_pad",
        "AveragePool",
        (1, 2, 8, 6),
        kernel_shape=[3, 3],
        strides=[2, 2],
        pads=[1, 0, 1, 1],
        ceil_mode=1,
        count_include_pad=1,
    ),
    case(
        "avgpool2d_dilated",
        "AveragePool",
        (1, 2, 9, 8),
        opset=19,
        kernel_shape=[2, 3],
        strides=[2, 1],
        dilations=[2, 2],
        pads=[1, 2, 1, 1],
        count_include_pad=1,
    ),
    case(
        "avgpool2d_dilated_ceil",
        "AveragePool",
        (1, 2, 9, 8),
        opset=19,
        kernel_shape=[2, 2],
        strides=[2, 3],
        dilations=[2, 3],
        pads=[1, 1, 1, 0],
        ceil_mode=1,
    ),
    case(
        "avgpool1d_same_include_pad",
        "AveragePool",
        (2, 3, 10),
        kernel_shape=[4],
        strides=[3],
        auto_pad="SAME_UPPER",
        count_include_pad=1,
    ),
    case("avgpool3d", "AveragePool", (1, 2, 5, 4, 5), kernel_shape=[2, 2, 3], pads=[0, 1, 1] * 2),
    case("globalavgpool2d", "GlobalAveragePool", (2, 3, 4, 5)),
    case("globalavgpool1d", "GlobalAveragePool", (3, 2, 5)),
    case("reducemean_spatial", "ReduceMean", (2, 3, 4, 5), axes=[2, 3]),
    case("reducemean_dropped", "ReduceMean", (2, 3, 4, 5), axes=[-1, 1], keepdims=0),
    # opset 18 moved the axes to a constant input (what the dynamo exporter writes)
    case("reducemean_opset18", "ReduceMean", (2, 3, 4, 5), opset=18, shape_input=[2, 3]),
    # layout
    case("flatten", "Flatten", (2, 3, 4, 5)),
    case("reshape", "Reshape", (2, 3, 4, 5), shape_input=[0, -1, 5]),
    case("concat_middle", "Concat", (2, 3, 4), [(2, 2, 4), (2, 1, 4)], x_position=1, axis=1),
    case("concat_last", "Concat", (2, 3, 2), [(2, 3, 3), (2, 3, 1)], axis=-1),
]


def build_model(c: Case, path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), f"w{i}")
        for i, s in enumerate(c.weights)
    ]
    names = [f"w{i}" for i in range(len(c.weights))]
    names.insert(c.x_position, "x")
    if c.shape_input is not None:
        inits.append(numpy_helper.from_array(np.array(c.shape_input, np.int64), "shape"))
        names.append("shape")
    node = helper.make_node(c.op_type, names, ["y"], **dict(c.attrs))
    graph = helper.make_graph(
        [node],
        c.id,
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, c.x_shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
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
            self._cache[c] = (path, load_model(path, loss=LossKind.NONE))
        return self._cache[c]


def ort_run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


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


def task_args(task: Task, loss_scale: float = 1.0) -> TaskArgs:
    valid = tuple(r.valid for r in task.inputs)
    return TaskArgs(out_shape=rect_shape(task.output), valid=valid, loss_scale=loss_scale)


def buffers(task: Task, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [slice_from_full(np, a, r) for a, r in zip(arrays, task.inputs, strict=True)]


def forward_full(
    graph: Graph, op: Op, config: ParallelConfig, arrays: Sequence[np.ndarray]
) -> np.ndarray:
    """Every task's forward on its buffers, each tile placed at ``task.output``."""
    kernel = kernel_for(op.type)
    shape = graph.tensors[op.output].shape
    out = np.full(shape, np.nan, dtype=arrays[0].dtype)
    covered = np.zeros(shape, dtype=np.int64)
    for task in tasks_of(graph, op, config):
        tile = kernel.forward(np, op.attrs, buffers(task, arrays), task_args(task))
        assert tile.shape == rect_shape(task.output), (tile.shape, task.output)
        out[global_slices(task.output)] = tile
        covered[global_slices(task.output)] += 1
    assert (covered == 1).all(), "the task tiles must partition the output"
    return out


def backward_full(
    graph: Graph,
    op: Op,
    config: ParallelConfig,
    arrays: Sequence[np.ndarray],
    grad_output: np.ndarray,
) -> list[np.ndarray]:
    """Every task's backward; each buffer gradient's in-tensor part summed into a full
    gradient (what the executor's halo and replica reductions do)."""
    kernel = kernel_for(op.type)
    grads = [np.zeros_like(a) for a in arrays]
    for task in tasks_of(graph, op, config):
        bufs = buffers(task, arrays)
        args = task_args(task)
        out = kernel.forward(np, op.attrs, bufs, args)
        tile_grad = grad_output[global_slices(task.output)].copy()
        task_grads = kernel.backward(np, op.attrs, bufs, out, tile_grad, args)
        assert len(task_grads) == len(bufs)
        for full, g, b, region in zip(grads, task_grads, bufs, task.inputs, strict=True):
            assert g.shape == b.shape and g.dtype == b.dtype
            full[global_slices(region.data)] += g[local_slices(region.data, region.buffer)]
    return grads


def splittable_degrees(graph: Graph, op: Op) -> list[tuple[str, int, bool]]:
    """(name, size, splittable) per dim of ``op``."""
    return [(d.name, d.size, d.splittable) for d in analyze(graph)[op.name]]


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
