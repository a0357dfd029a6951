"""Inputs that once trained wrong or crashed: now refused in one line, or handled."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnx2soap.cli import main as cli
from onnx2soap.errors import ModelError
from onnx2soap.importer import load_model
from onnx2soap.ir import LossKind, TensorRole
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import Partitioner, analyze


def save(path: Path, nodes, inits, out_shape=("batch", 4)) -> Path:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, list(out_shape))],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def weight(name: str, shape=(4, 4)) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ones(shape, np.float32), name)


def test_a_bias_from_a_constant_node_is_read_as_a_constant_not_dropped(tmp_path: Path) -> None:
    const = helper.make_node(
        "Constant", [], ["c"], value=numpy_helper.from_array(np.full(4, 5.0, np.float32))
    )
    gemm = helper.make_node("Gemm", ["x", "W", "c"], ["y"], name="fc")
    path = save(tmp_path / "m.onnx", [const, gemm], [weight("W")])
    model = load_model(path, batch=2)
    (op,) = [op for op in model.graph.ops if op.name == "fc"]
    assert op.inputs[2] == "c" and model.graph.tensors["c"].role is TensorRole.CONSTANT
    np.testing.assert_array_equal(model.constants["c"], np.full(4, 5.0))
    assert "c" not in model.weights


def test_a_weight_read_twice_is_read_once_through_an_identity(tmp_path: Path) -> None:
    """Add(W, W): both operands read W's Identity, whose gradient sums both uses."""
    nodes = [
        helper.make_node("Add", ["W", "W"], ["w2"], name="sq"),
        helper.make_node("MatMul", ["x", "w2"], ["y"], name="mm"),
    ]
    path = save(tmp_path / "m.onnx", nodes, [weight("W")])
    graph = load_model(path, batch=2).graph
    share, add = graph.ops[0], graph.ops[1]
    assert share.type == "Identity" and share.inputs == ("W",)
    assert add.name == "sq" and add.inputs == (share.output, share.output)
    assert [t.name for t in graph.weights] == ["W"]


def test_duplicate_and_reserved_node_names_get_unique_op_names(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc"),
        helper.make_node("Relu", ["h"], ["r"], name="loss"),
        helper.make_node("MatMul", ["r", "W2"], ["y"], name="fc"),
    ]
    path = save(tmp_path / "m.onnx", nodes, [weight("W1"), weight("W2")])
    graph = load_model(path, batch=2).graph
    names = [op.name for op in graph.ops]
    assert names == ["fc", "loss", "fc_1", "loss_"]
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 2))
    assert len(pg.edges) == 3


def test_a_constant_expression_that_cannot_be_evaluated_is_one_line(tmp_path: Path, capsys) -> None:
    six = helper.make_node(
        "Constant", [], ["six"], value=numpy_helper.from_array(np.zeros(6, np.float32))
    )
    target = numpy_helper.from_array(np.array([5], np.int64), "five")
    bad = helper.make_node("Reshape", ["six", "five"], ["bad"], name="broken")
    shape = helper.make_node("Shape", ["bad"], ["s"], name="shape")
    relu = helper.make_node("Relu", ["x"], ["y"], name="relu")
    path = save(tmp_path / "m.onnx", [six, bad, shape, relu], [target])
    assert cli(["inspect", str(path), "--batch", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "node 'broken' (Reshape)" in err


def test_shape_with_start_folds_into_a_reshape(tmp_path: Path) -> None:
    """Reshape(x, Concat([-1], Shape(x, start=1))): the shape sub-graph folds to [-1, 4]."""
    minus_one = numpy_helper.from_array(np.array([-1], np.int64), "minus_one")
    nodes = [
        helper.make_node("Shape", ["x"], ["tail"], start=1, name="shape"),
        helper.make_node("Concat", ["minus_one", "tail"], ["target"], axis=0, name="cat"),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
    ]
    graph = load_model(
        save(tmp_path / "m.onnx", nodes, [minus_one]), batch=3, loss=LossKind.MSE
    ).graph
    (reshape, _) = graph.ops
    assert reshape.type == "Reshape" and graph.tensors[reshape.output].shape == (3, 4)


def _ids_model(path: Path, nodes, inits, inputs=None) -> Path:
    """A graph of ids [batch, 5] (and ``inputs``) to y [batch, 5, 3] float."""
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["batch", 5]),
            *(inputs or []),
        ],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 5, 3])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_integers_computed_from_a_float_tensor_are_refused_by_name(tmp_path: Path) -> None:
    """Where(x > 0, ids, ids + 1) computes integers from a float tensor computed at run
    time: no backward runs for integer outputs, so the comparison's producer would wait
    for a gradient that never comes. Refused, naming the op and the tensor."""
    nodes = [
        helper.make_node("Gemm", ["f", "w"], ["x"]),
        helper.make_node("Greater", ["x", "zero"], ["positive"]),
        helper.make_node("Add", ["ids", "one"], ["next"]),
        helper.make_node("Where", ["positive", "ids", "next"], ["picked"]),
        helper.make_node("Gather", ["table", "picked"], ["y"]),
    ]
    inits = [
        weight("w", (4, 5)),
        weight("table", (9, 3)),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
    ]
    features = [helper.make_tensor_value_info("f", onnx.TensorProto.FLOAT, ["batch", 4])]
    path = _ids_model(tmp_path / "cut.onnx", nodes, inits, inputs=features)
    refusal = r"node 'picked' \(Where\) computes integers from 'positive'"
    with pytest.raises(ModelError, match=refusal):
        load_model(path, 2)


def test_integer_ops_take_integer_constants_as_operands(tmp_path: Path) -> None:
    """RoBERTa's positions: (cumsum(ids != pad) * mask + pad) as int64 ops with integer
    constants beside them; no gradient flows through any of them, the embedding's does."""
    nodes = [
        helper.make_node("Equal", ["ids", "pad"], ["is_pad"]),
        helper.make_node("Not", ["is_pad"], ["mask"]),
        helper.make_node("Cast", ["mask"], ["m"], to=onnx.TensorProto.INT64),
        helper.make_node("CumSum", ["m", "axis"], ["count"]),
        helper.make_node("Mul", ["count", "m"], ["kept"]),
        helper.make_node("Add", ["kept", "pad"], ["positions"]),
        helper.make_node("Gather", ["table", "positions"], ["y"]),
    ]
    inits = [
        weight("table", (7, 3)),
        numpy_helper.from_array(np.array(1, np.int64), "pad"),
        numpy_helper.from_array(np.array(1, np.int64), "axis"),
    ]
    graph = load_model(_ids_model(tmp_path / "positions.onnx", nodes, inits), 2).graph
    ints = [op for op in graph.ops if not graph.tensors[op.output].dtype.is_float]
    # the Cast of the 0/1 mask to int64 is the mask itself: read in its stead
    assert [op.type for op in ints] == ["Equal", "Not", "CumSum", "Mul", "Add"]
    assert all(not graph.differentiable(op.output) for op in ints)
    assert graph.tensors["pad"].role is TensorRole.CONSTANT  # an int64 operand, read whole
    (gather,) = (op for op in graph.ops if op.type == "Gather")
    assert graph.differentiable(gather.output)


def test_an_activation_passed_on_unchanged_is_read_in_the_copy_s_stead(tmp_path: Path) -> None:
    """Identity of an activation and a Cast of floats to FLOAT are the activation itself
    (torch's ``.to`` of the same dtype returns self): no op, so no step makes or keeps a
    copy; the readers read the original. An Identity of a weight was so already; a
    Cast of floats to the run's float dtype too; a graph output reached through one is
    the original's."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Identity", ["r"], ["copy"], name="clone"),
        helper.make_node("Cast", ["copy"], ["cast"], to=onnx.TensorProto.FLOAT, name="cast"),
        helper.make_node("MatMul", ["cast", "W"], ["h"], name="fc"),
        helper.make_node("Identity", ["h"], ["y"], name="out"),
    ]
    graph = load_model(save(tmp_path / "m.onnx", nodes, [weight("W")]), batch=2).graph
    relu, fc, loss = graph.ops
    assert (relu.name, fc.name) == ("relu", "fc") and loss.is_loss
    assert fc.inputs[0] == relu.output and loss.inputs[0] == fc.output
