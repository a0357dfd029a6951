"""A product of a transposed weight reads the weight itself (``transpose_b``): a tied LM
head's Transpose is gone, and the forward, gradients and a split plan are what the file
as written computes (onnxruntime for the forward, finite differences for the backward)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.ir import LossKind
from onnx2soap.ops import definition
from tests.executor.test_forward_onnxruntime import (
    BATCH,
    executor_forward,
    onnxruntime_forward,
)
from tests.ops.harness import backward_full, config_of, forward_full, one_task

TOKENS, WIDTH, VOCABULARY = 4, 3, 5


def _tied_head(tmp_path: Path, transposed_read_twice: bool = False) -> Path:
    """x [B, T, W] @ Eᵀ with E [V, W] a weight, plus E's rows summed into the input so
    that E is read twice (tied), as an embedding and a head are."""
    rng = np.random.default_rng(0)
    e = rng.standard_normal((VOCABULARY, WIDTH)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceSum", ["E", "axes"], ["rows"], keepdims=0),
        helper.make_node("Add", ["x", "rows"], ["h"]),
        helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
        helper.make_node("MatMul", ["h", "Et"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, TOKENS, VOCABULARY])]
    if transposed_read_twice:  # Eᵀ read by a second product: kept as written
        nodes.append(helper.make_node("MatMul", ["h", "Et"], ["y2"]))
        nodes.append(helper.make_node("Add", ["y", "y2"], ["sum"]))
        shape = [BATCH, TOKENS, VOCABULARY]
        outputs = [helper.make_tensor_value_info("sum", TensorProto.FLOAT, shape)]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, TOKENS, WIDTH])],
        outputs,
        [
            numpy_helper.from_array(e, "E"),
            numpy_helper.from_array(np.array([0], np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "tied.onnx"
    onnx.save(model, path)
    return path


def test_tied_head_reads_the_weight_transposed(tmp_path: Path) -> None:
    path = _tied_head(tmp_path)
    graph = load_model(path, BATCH, LossKind.NONE).graph
    assert "Transpose" not in [op.type for op in graph.ops]
    (head,) = [op for op in graph.ops if op.type == "MatMul"]
    assert head.attrs.transpose_b
    assert graph.tensors[head.inputs[1]].shape == (VOCABULARY, WIDTH)
    x = np.random.default_rng(1).standard_normal((BATCH, TOKENS, WIDTH)).astype(np.float32)
    np.testing.assert_allclose(
        executor_forward(path, x), onnxruntime_forward(path, x), rtol=1e-5, atol=1e-6
    )


def test_a_transpose_read_twice_stays(tmp_path: Path) -> None:
    graph = load_model(_tied_head(tmp_path, True), BATCH, LossKind.NONE).graph
    assert "Transpose" in [op.type for op in graph.ops]
    assert not any(op.attrs.transpose_b for op in graph.ops if op.type == "MatMul")


@pytest.mark.parametrize("degrees", [(1, 1, 1, 1), (2, 2, 1, 1), (1, 1, 5, 3), (3, 2, 5, 1)])
def test_transposed_gradients_equal_finite_differences_under_any_split(
    tmp_path: Path, degrees
) -> None:
    """d(sum(R * y)) / d(h, E), by central differences on the whole op, equals the
    gradients summed over the tasks of a split of (batch, rows, vocabulary, width)."""
    graph = load_model(_tied_head(tmp_path), BATCH, LossKind.NONE).graph
    (op,) = [op for op in graph.ops if op.type == "MatMul"]
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(graph.tensors[t].shape) for t in op.inputs]
    projection = rng.standard_normal(graph.tensors[op.output].shape)
    config = config_of(degrees)
    got = backward_full(graph, op, config, arrays, projection)
    np.testing.assert_allclose(
        forward_full(graph, op, config, arrays), forward_full(graph, op, one_task(op), arrays)
    )
    kernel = definition(op.type)
    assert graph.tensors[op.inputs[1]].shape == (VOCABULARY, WIDTH)  # E itself (shared)
    for k, (array, grad) in enumerate(zip(arrays, got, strict=True)):
        for index in list(np.ndindex(array.shape))[::3]:
            bumped = [a.copy() for a in arrays]
            bumped[k][index] += 1e-6
            up = (projection * kernel.forward(np, op.attrs, bumped, _args(op, graph))).sum()
            bumped[k][index] -= 2e-6
            down = (projection * kernel.forward(np, op.attrs, bumped, _args(op, graph))).sum()
            assert grad[index] == pytest.approx((up - down) / 2e-6, rel=1e-6, abs=1e-6)


def _args(op, graph):
    from onnx2soap.ops import TaskArgs

    shape = graph.tensors[op.output].shape
    return TaskArgs(out_shape=shape, valid=())
