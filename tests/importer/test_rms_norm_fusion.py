"""RMSNorm written out comes in as one RMSNormalization: LlamaRMSNorm's float32 island,
T5LayerNorm's cast of the inverse back to x's type, the ``x / Sqrt`` and ``Div(1, ·)``
forms, a square as ``Mul(x, x)``, ReduceMean's axes as an input or an attribute, with
and without the weight multiply. Each file's forward equals onnxruntime's on the file
as written; near misses (a reduction over another axis, the inverse read elsewhere, an
ε that is a weight) stay as written, and a weight that varies along the rows stays a
product after the fused norm."""

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

ROWS, WIDTH = 5, 8
EPSILON = np.float32(1e-6)  # what the dynamo exporter writes: a FLOAT constant


def _constant(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def _statistic(xs: str, *, square: str, axes: tuple[int, ...], opset: int, eps: str) -> list:
    """r = Sqrt(ReduceMean(xs², axes) + ε)."""
    nodes = []
    if square == "Pow":
        nodes += [_constant("two", np.float32(2)), helper.make_node("Pow", [xs, "two"], ["sq"])]
    else:
        nodes.append(helper.make_node("Mul", [xs, xs], ["sq"]))
    if opset >= 18:
        nodes.append(_constant("axes", np.array(axes, np.int64)))
        nodes.append(helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1))
    else:
        nodes.append(helper.make_node("ReduceMean", ["sq"], ["mean"], axes=list(axes)))
    nodes.append(helper.make_node("Add", ["mean", eps], ["var"]))
    nodes.append(helper.make_node("Sqrt", ["var"], ["r"]))
    return nodes


def _chain(
    tmp_path: Path,
    *,
    form: str = "llama",
    square: str = "Pow",
    axes: tuple[int, ...] = (-1,),
    opset: int = 18,
    weight: str = "vector",
    leak: bool = False,
    eps_weight: bool = False,
) -> Path:
    """x [B, R, W] normalized over its last axis as an exporter writes it.

    form: "llama" (float64 x cast to float32 and n back), "t5" (float64 x; its float32
    copy squared, the inverse cast back and multiplied by x itself), "div" (float32,
    n = x / r), "div_one" (float32, n = x · Div(1, r)).
    weight: "vector" [W], "rows" [R, W] (varies along the rows), "none".
    leak: the inverse is read by the output too. eps_weight: ε is a [1] weight."""
    wide = form in ("llama", "t5")
    dtype, np_dtype = (TensorProto.DOUBLE, np.float64) if wide else (TensorProto.FLOAT, np.float32)
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    if eps_weight:
        inits.append(numpy_helper.from_array(np.array([EPSILON]), "eps"))
    else:
        nodes.append(_constant("eps", EPSILON))
    xs = "x"
    if wide:
        nodes.append(helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT))
        xs = "x32"
    nodes += _statistic(xs, square=square, axes=axes, opset=opset, eps="eps")
    if form == "div":
        nodes.append(helper.make_node("Div", [xs, "r"], ["n"]))
    else:
        if form == "div_one":
            nodes += [
                _constant("one", np.float32(1)),
                helper.make_node("Div", ["one", "r"], ["inv"]),
            ]
        else:
            nodes.append(helper.make_node("Reciprocal", ["r"], ["inv"]))
        if form == "t5":
            nodes.append(helper.make_node("Cast", ["inv"], ["inv64"], to=dtype))
            nodes.append(helper.make_node("Mul", ["x", "inv64"], ["n"]))
        else:
            nodes.append(helper.make_node("Mul", [xs, "inv"], ["n"]))
    if form == "llama":
        nodes.append(helper.make_node("Cast", ["n"], ["n64"], to=dtype))
    last = "n64" if form == "llama" else "n"
    if weight != "none":
        shape = (WIDTH,) if weight == "vector" else (ROWS, WIDTH)
        inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np_dtype), "w"))
        nodes.append(helper.make_node("Mul", ["w", last], ["y"]))
        last = "y"
    if leak:  # the inverse (float32 in the island) read beside the chain
        inverse = "r" if form == "div" else "inv"
        nodes.append(helper.make_node("Cast", [inverse], ["inv_out"], to=dtype))
        nodes.append(helper.make_node("Add", [last, "inv_out"], ["z"]))
        last = "z"
    graph = helper.make_graph(
        nodes,
        "rms_norm",
        [helper.make_tensor_value_info("x", dtype, [BATCH, ROWS, WIDTH])],
        [helper.make_tensor_value_info(last, dtype, [BATCH, ROWS, WIDTH])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    path = tmp_path / "rms_norm.onnx"
    onnx.save(model, path)
    return path


def _check_forward(path: Path, dtype) -> None:
    """The fused file on the executor (float64) against onnxruntime on the file as
    written (its statistic in float32)."""
    x = (np.random.default_rng(1).standard_normal((BATCH, ROWS, WIDTH)) * 3).astype(dtype)
    np.testing.assert_allclose(
        executor_forward(path, x), onnxruntime_forward(path, x), rtol=1e-5, atol=1e-6
    )


FUSED = [
    {"form": "llama"},
    {"form": "t5"},
    {"form": "div", "weight": "none"},
    {"form": "div_one", "square": "Mul", "opset": 13},
    {"form": "llama", "axes": (2,)},
]


@pytest.mark.parametrize("chain", FUSED, ids=str)
def test_rms_norm_chains_are_one_op(tmp_path: Path, chain) -> None:
    path = _chain(tmp_path, **chain)
    graph = load_model(path, BATCH, LossKind.NONE).graph
    (op,) = graph.ops
    assert op.type == "RMSNormalization"
    assert op.attrs.epsilon == float(EPSILON)  # the file's constant, to the bit
    assert op.attrs.axis == 2
    assert op.attrs.scaled == (chain.get("weight", "vector") == "vector")
    assert op.inputs[0] == "x"
    _check_forward(path, np.float64 if chain["form"] in ("llama", "t5") else np.float32)


NEAR_MISSES = [{"axes": (1,)}, {"leak": True}, {"eps_weight": True}]


@pytest.mark.parametrize("near_miss", NEAR_MISSES, ids=str)
def test_near_misses_stay_as_written(tmp_path: Path, near_miss) -> None:
    path = _chain(tmp_path, form="llama", **near_miss)
    types = [op.type for op in load_model(path, BATCH, LossKind.NONE).graph.ops]
    assert "RMSNormalization" not in types and "ReduceMean" in types
    _check_forward(path, np.float64)


def test_a_weight_along_the_rows_stays_a_product(tmp_path: Path) -> None:
    """[R, W] is no scale of the norm (it varies along the rows, which split): the norm
    is fused without one and the product stays."""
    path = _chain(tmp_path, form="llama", weight="rows")
    graph = load_model(path, BATCH, LossKind.NONE).graph
    assert [op.type for op in graph.ops] == ["RMSNormalization", "Mul"]
    assert not graph.ops[0].attrs.scaled
    _check_forward(path, np.float64)
