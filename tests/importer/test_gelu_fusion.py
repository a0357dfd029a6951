"""GELU's tanh form written out (transformers' gelu_new) comes in as one Gelu op, in
both orders of its products; its forward equals onnxruntime's on the file as written; a
chain with another constant, or a link read elsewhere, stays as written."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.ir import LossKind
from tests.executor.test_forward_onnxruntime import (
    BATCH,
    executor_forward,
    onnxruntime_forward,
)

WIDTH = 6


def _constant(name: str, value: float) -> onnx.NodeProto:
    tensor = numpy_helper.from_array(np.array(value, np.float32), name)
    return helper.make_node("Constant", [], [name], value=tensor)


def _gelu_new(
    tmp_path: Path, *, half_last: bool = False, cubic: float = 0.044715, leak: bool = False
) -> Path:
    """y = 0.5 · x · (1 + tanh(√(2/π) · (x + cubic · x³))), as torch's exporters write it."""
    nodes = [
        _constant("three", 3.0),
        _constant("cubic", cubic),
        _constant("scale", math.sqrt(2 / math.pi)),
        _constant("one", 1.0),
        _constant("half", 0.5),
        helper.make_node("Pow", ["x", "three"], ["cube"]),
        helper.make_node("Mul", ["cube", "cubic"], ["term"]),
        helper.make_node("Add", ["x", "term"], ["inner"]),
        helper.make_node("Mul", ["inner", "scale"], ["scaled"]),
        helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["plus"]),
    ]
    if half_last:  # (x · (1 + t)) · 0.5
        nodes += [
            helper.make_node("Mul", ["x", "plus"], ["xp"]),
            helper.make_node("Mul", ["xp", "half"], ["y"]),
        ]
    else:  # (0.5 · x) · (1 + t)
        nodes += [
            helper.make_node("Mul", ["half", "x"], ["hx"]),
            helper.make_node("Mul", ["hx", "plus"], ["y"]),
        ]
    output = "y"
    if leak:  # tanh's output read by another op too
        nodes.append(helper.make_node("Add", ["y", "t"], ["z"]))
        output = "z"
    graph = helper.make_graph(
        nodes,
        "gelu_new",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [BATCH, WIDTH])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "gelu_new.onnx"
    onnx.save(model, path)
    return path


def _check_forward(path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((BATCH, WIDTH)).astype(np.float32) * 3
    np.testing.assert_allclose(
        executor_forward(path, x), onnxruntime_forward(path, x), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("half_last", [False, True])
def test_gelu_new_is_one_gelu(tmp_path: Path, half_last: bool) -> None:
    path = _gelu_new(tmp_path, half_last=half_last)
    types = [op.type for op in load_model(path, BATCH, LossKind.NONE).graph.ops]
    assert types == ["Gelu"]
    _check_forward(path)


@pytest.mark.parametrize("near_miss", [{"cubic": 0.05}, {"leak": True}], ids=str)
def test_near_misses_stay_as_written(tmp_path: Path, near_miss) -> None:
    path = _gelu_new(tmp_path, **near_miss)
    types = [op.type for op in load_model(path, BATCH, LossKind.NONE).graph.ops]
    assert "Gelu" not in types and "Tanh" in types
    _check_forward(path)
