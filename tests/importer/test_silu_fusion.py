"""SiLU written out (``x · Sigmoid(x)``, either order) comes in as one Swish, and
``x · Sigmoid(c · x)`` as one with alpha c; its forward equals onnxruntime's on the file
as written. A sigmoid read elsewhere, or multiplied by another tensor, stays as written."""

from __future__ import annotations

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


def _silu(
    tmp_path: Path,
    *,
    sigmoid_first: bool = False,
    alpha: float | None = None,
    leak: bool = False,
    other: bool = False,
) -> Path:
    """y = x · sigmoid(x) (or of alpha · x), as torch's exporters write ``F.silu``."""
    nodes, inits = [], []
    argument = "x"
    if alpha is not None:
        value = numpy_helper.from_array(np.array(alpha, np.float32), "alpha")
        nodes.append(helper.make_node("Constant", [], ["alpha"], value=value))
        nodes.append(helper.make_node("Mul", ["x", "alpha"], ["ax"]))
        argument = "ax"
    nodes.append(helper.make_node("Sigmoid", [argument], ["s"]))
    factor = "x"
    if other:  # a gate multiplied by another tensor (a weight here): no SiLU
        inits.append(numpy_helper.from_array(np.ones(WIDTH, np.float32), "w"))
        factor = "w"
    operands = ["s", factor] if sigmoid_first else [factor, "s"]
    nodes.append(helper.make_node("Mul", operands, ["y"]))
    output = "y"
    if leak:  # the sigmoid read beside the product
        nodes.append(helper.make_node("Add", ["y", "s"], ["z"]))
        output = "z"
    graph = helper.make_graph(
        nodes,
        "silu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [BATCH, WIDTH])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "silu.onnx"
    onnx.save(model, path)
    return path


def _check_forward(path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((BATCH, WIDTH)).astype(np.float32) * 4
    np.testing.assert_allclose(
        executor_forward(path, x), onnxruntime_forward(path, x), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("sigmoid_first", [False, True])
def test_silu_is_one_swish(tmp_path: Path, sigmoid_first: bool) -> None:
    path = _silu(tmp_path, sigmoid_first=sigmoid_first)
    (op,) = load_model(path, BATCH, LossKind.NONE).graph.ops
    assert (op.type, op.inputs, op.attrs.alpha) == ("Swish", ("x",), 1.0)
    _check_forward(path)


def test_a_scaled_argument_is_alpha(tmp_path: Path) -> None:
    path = _silu(tmp_path, alpha=1.702)
    (op,) = load_model(path, BATCH, LossKind.NONE).graph.ops
    assert op.type == "Swish" and op.attrs.alpha == float(np.float32(1.702))
    _check_forward(path)


@pytest.mark.parametrize("near_miss", [{"leak": True}, {"other": True}], ids=str)
def test_near_misses_stay_as_written(tmp_path: Path, near_miss) -> None:
    path = _silu(tmp_path, **near_miss)
    types = [op.type for op in load_model(path, BATCH, LossKind.NONE).graph.ops]
    assert "Swish" not in types and "Sigmoid" in types
    _check_forward(path)
