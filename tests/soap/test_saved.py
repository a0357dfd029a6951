"""``soap/saved.py``: what an op keeps for its backward, given which of its operands take
a gradient (``Saved.only_for``), against autograd's own saved tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.soap.saved import kept_for_backward, wanted_gradients
from tests.optional import require


def _model(path: Path) -> Path:
    """x @ W1 -> * 0.5 -> Softmax -> * h (h: the scaled product, an activation)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc"),
        helper.make_node("Mul", ["h", "half"], ["scaled"], name="scale"),
        helper.make_node("Softmax", ["scaled"], ["p"], axis=-1, name="softmax"),
        helper.make_node("Mul", ["p", "h"], ["y"], name="gate"),
    ]
    inits = [
        numpy_helper.from_array(np.ones((4, 4), np.float32), "W1"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_each_op_keeps_what_autograd_saves(tmp_path: Path) -> None:
    """A linear on data keeps the data (its weight's gradient reads it), not the weight;
    a product with a constant keeps nothing of the activation; Softmax keeps its
    output; a product of two activations keeps both. torch's autograd graph saves the
    same (its ``_saved_*`` attributes), the reference."""
    torch = require("torch")
    graph = load_model(_model(tmp_path / "m.onnx"), batch=2).graph
    kept = {op.name: kept_for_backward(graph, op, False) for op in graph.ops}
    assert kept["fc"] == (frozenset({0}), False)
    assert kept["scale"] == (frozenset({1}), False)  # the constant only
    assert kept["softmax"] == (frozenset(), True)
    assert kept["gate"] == (frozenset({0, 1}), False)
    assert wanted_gradients(graph, graph.ops[0]) == (False, True)  # data, W1
    assert wanted_gradients(graph, graph.ops[1]) == (True, False)  # h, the constant

    w = torch.ones(4, 4, requires_grad=True)
    h = torch.ones(2, 4) @ w
    scaled = h * 0.5
    p = torch.softmax(scaled, -1)
    y = p * h
    # autograd saves an operand only where another's gradient reads it: the attribute
    # is then a tensor, else None (the data of mm, the constant factor of mul)
    assert h.grad_fn._saved_self is not None and h.grad_fn._saved_mat2 is None
    assert scaled.grad_fn._saved_self is None
    assert p.grad_fn._saved_result is not None
    assert y.grad_fn._saved_self is not None and y.grad_fn._saved_other is not None
