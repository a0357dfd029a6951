"""The importer fuses attention chains into one Attention op, and leaves near misses as
written. Hand-built chains, each imported and run forward on one device against
onnxruntime on the file as written (the unfused chain)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx2soap.importer import lazy, load_model
from onnx2soap.ir import LossKind, TensorRole
from tests.executor.test_forward_onnxruntime import (
    BATCH,
    executor_forward,
    onnxruntime_forward,
)

HEADS, KV_HEADS, ROWS, WIDTH = 4, 2, 5, 3


def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    """A Constant node, as the exporters write scales and masks (float initializers
    are weights)."""
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def _chain(
    *,
    scale_node: str = "Mul",
    mask: str = "causal",
    softmax_axis: int = -1,
    dropout_ratio: float | None = None,
    probabilities_out: bool = False,
    kv_heads: int = HEADS,
    shared_keys: bool = False,
    bias: bool = False,
    scale_initializer: bool = False,
) -> onnx.ModelProto:
    """x [B, H, R, W] as Q; K and V weights; Kᵀ by a Transpose; the scores scaled, masked,
    softmaxed, (dropped out,) multiplied by V."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1 if shared_keys else BATCH, kv_heads, ROWS, WIDTH))
    k = k.astype(np.float32)
    v = rng.standard_normal((BATCH, kv_heads, ROWS, WIDTH)).astype(np.float32)
    inits = [numpy_helper.from_array(k, "k"), numpy_helper.from_array(v, "v")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])]
    if kv_heads != HEADS:  # Llama's repeat_kv: Unsqueeze, Expand, Reshape
        nodes = []
        for name in ("k", "v"):
            inits.append(numpy_helper.from_array(np.array([2], np.int64), f"{name}_axis"))
            shape = [BATCH, kv_heads, HEADS // kv_heads, ROWS, WIDTH]
            inits.append(numpy_helper.from_array(np.array(shape, np.int64), f"{name}_big"))
            merged = [BATCH, HEADS, ROWS, WIDTH]
            inits.append(numpy_helper.from_array(np.array(merged, np.int64), f"{name}_merged"))
            nodes += [
                helper.make_node("Unsqueeze", [name, f"{name}_axis"], [f"{name}_u"]),
                helper.make_node("Expand", [f"{name}_u", f"{name}_big"], [f"{name}_e"]),
                helper.make_node("Reshape", [f"{name}_e", f"{name}_merged"], [f"{name}_r"]),
            ]
        nodes.append(helper.make_node("Transpose", ["k_r"], ["kt"], perm=[0, 1, 3, 2]))
    scale = 0.5 if scale_node == "Mul" else 2.0
    if scale_initializer:  # a 0-d float initializer, as benchmarks/gpt_onnx.py writes it
        inits.append(numpy_helper.from_array(np.array(scale, np.float32), "c"))
    else:
        nodes.append(_constant("c", np.array(scale, np.float32)))
    nodes.append(helper.make_node("MatMul", ["x", "kt"], ["s"]))
    nodes.append(helper.make_node(scale_node, ["s", "c"], ["scaled"]))
    scores = "scaled"
    if bias:  # T5's relative position bias: a weight's, trained through the scores
        value = rng.standard_normal((1, HEADS, ROWS, ROWS)).astype(np.float32)
        inits.append(numpy_helper.from_array(value, "bias"))
        nodes.append(helper.make_node("Add", ["scaled", "bias"], ["biased"]))
        scores = "biased"
    if mask.startswith("iota"):
        nodes += _iota_mask(mask)
        nodes.append(helper.make_node("Add", [scores, "mask"], ["masked"]))
        scores = "masked"
    elif mask != "none":
        above = np.triu(np.ones((ROWS, ROWS), bool), 1)
        value = np.where(above, np.float32(-3.4e38), 0).astype(np.float32)
        if mask == "padding":
            value = np.zeros((BATCH, 1, 1, ROWS), np.float32)
            value[0, ..., -1] = -3.4e38
        nodes.append(_constant("mask", value))
        nodes.append(helper.make_node("Add", [scores, "mask"], ["masked"]))
        scores = "masked"
    nodes.append(helper.make_node("Softmax", [scores], ["p"], axis=softmax_axis))
    probabilities = "p"
    if dropout_ratio is not None:
        nodes.append(_constant("ratio", np.array(dropout_ratio, np.float32)))
        nodes.append(_constant("training", np.array(True)))
        nodes.append(helper.make_node("Dropout", ["p", "ratio", "training"], ["pd"]))
        probabilities = "pd"
    values = "v" if kv_heads == HEADS else "v_r"
    nodes.append(helper.make_node("MatMul", [probabilities, values], ["y"]))
    shape = [BATCH, HEADS, ROWS, WIDTH]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
    if probabilities_out:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes,
        "attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _iota_mask(kind: str) -> list[onnx.NodeProto]:
    """ "mask" [B, 1, R, R] folded from positions, as transformers' SDPA masks are: the
    keys' and queries' iotas compared, Where(seen, 0, -big), expanded to the batch.
    ``iota-causal`` is the causal one; ``iota-strict`` masks the diagonal too,
    ``iota-future`` sees only the keys ahead, ``iota-last-row`` masks the last query's
    every key (a difference in the last rows only)."""
    compare = {"iota-strict": "Less", "iota-future": "GreaterOrEqual"}.get(kind, "LessOrEqual")
    nodes = [
        _constant("zero", np.array(0, np.int64)),
        _constant("rows", np.array(ROWS, np.int64)),
        _constant("one", np.array(1, np.int64)),
        helper.make_node("Range", ["zero", "rows", "one"], ["position"]),
        _constant("key_axes", np.array([0, 1, 2], np.int64)),
        _constant("query_axes", np.array([0, 1, 3], np.int64)),
        helper.make_node("Unsqueeze", ["position", "key_axes"], ["key_at"]),
        helper.make_node("Unsqueeze", ["position", "query_axes"], ["query_at"]),
        helper.make_node(compare, ["key_at", "query_at"], ["seen"]),
    ]
    if kind == "iota-last-row":
        nodes += [
            _constant("last", np.array(ROWS - 1, np.int64)),
            helper.make_node("Less", ["query_at", "last"], ["not_last"]),
            helper.make_node("And", ["seen", "not_last"], ["seen_before_last"]),
        ]
    seen = "seen_before_last" if kind == "iota-last-row" else "seen"
    return [
        *nodes,
        _constant("keep", np.array(0, np.float32)),
        _constant("drop", np.array(-3.4e38, np.float32)),
        helper.make_node("Where", [seen, "keep", "drop"], ["mask_rows"]),
        _constant("batched", np.array([BATCH, 1, ROWS, ROWS], np.int64)),
        helper.make_node("Expand", ["mask_rows", "batched"], ["mask"]),
    ]


def _save(model: onnx.ModelProto, tmp_path: Path) -> Path:
    path = tmp_path / "attention.onnx"
    onnx.save(model, path)
    return path


def _types(path: Path, loss: LossKind = LossKind.NONE) -> list[str]:
    return [op.type for op in load_model(path, BATCH, loss).graph.ops]


def _equals_onnxruntime(path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((BATCH, HEADS, ROWS, WIDTH)).astype(np.float32)
    np.testing.assert_allclose(
        executor_forward(path, x), onnxruntime_forward(path, x), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "chain",
    [
        {},
        {"scale_node": "Div"},
        {"mask": "none"},
        {"mask": "padding"},
        {"kv_heads": KV_HEADS},
        {"dropout_ratio": 0.0},
        {"dropout_ratio": 0.1},
        {"bias": True},
        {"bias": True, "mask": "none"},
        {"scale_initializer": True},
    ],
    ids=str,
)
def test_chain_becomes_one_attention_op(tmp_path: Path, chain) -> None:
    path = _save(_chain(**chain), tmp_path)
    graph = load_model(path, BATCH, LossKind.NONE).graph
    (op,) = [op for op in graph.ops if op.type == "Attention"]
    assert not [o for o in graph.ops if o.type in ("Softmax", "MatMul", "Dropout")]
    assert op.attrs.scale == pytest.approx(0.5)
    assert op.attrs.causal == (chain.get("mask", "causal") == "causal")
    assert op.attrs.has_mask == (chain.get("mask") == "padding" or chain.get("bias", False))
    if chain.get("bias"):  # the bias is the mask, and takes its gradient
        assert op.inputs[3] == "bias" and graph.tensors["bias"].role is TensorRole.WEIGHT
    assert op.attrs.dropout == pytest.approx(chain.get("dropout_ratio", 0.0))
    kv_heads = chain.get("kv_heads", HEADS)  # repeat_kv's copies are never made
    assert graph.tensors[op.inputs[1]].shape[1] == graph.tensors[op.inputs[2]].shape[1] == kv_heads
    assert "Expand" not in [o.type for o in graph.ops]
    if not chain.get("dropout_ratio"):  # onnxruntime drops at random in training mode
        _equals_onnxruntime(path)


@pytest.mark.parametrize(
    "near_miss",
    [
        {"probabilities_out": True},  # the probabilities are read elsewhere
        {"softmax_axis": 2},  # normalized over the queries
        {"shared_keys": True},  # one K for every sample: [1, H, R, W]
        {"bias": True, "mask": "padding"},  # two terms: their sum would be [B, H, R, R]
    ],
    ids=str,
)
def test_near_misses_stay_as_written(tmp_path: Path, near_miss) -> None:
    model = _chain(**near_miss)
    if near_miss.get("probabilities_out"):
        del model.graph.output[1:]  # one output to train, but "p" still read twice
        model.graph.node.append(helper.make_node("Identity", ["p"], ["p_copy"]))
        model.graph.node.append(helper.make_node("MatMul", ["p_copy", "v"], ["y2"]))
        model.graph.node.append(helper.make_node("Add", ["y", "y2"], ["sum"]))
        model.graph.output[0].name = "sum"
    path = _save(model, tmp_path)
    types = _types(path)
    assert "Attention" not in types and "Softmax" in types
    _equals_onnxruntime(path)


@pytest.mark.parametrize(
    "mask", ["iota-causal", "iota-strict", "iota-future", "iota-last-row"], ids=str
)
def test_big_masks_are_read_a_block_of_rows_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mask: str
) -> None:
    """A mask too big to fold (here every elementwise result is: ``LAZY_ELEMENTS`` 0)
    is kept lazy and checked two rows at a time: the causal one becomes ``is_causal``
    without ever being computed whole; one that differs (on the diagonal, everywhere, in
    its last row only) stays an operand, computed, and the forward equals
    onnxruntime's on the file as written."""
    monkeypatch.setattr(lazy, "LAZY_ELEMENTS", 0)
    monkeypatch.setattr(lazy, "BLOCK_ELEMENTS", 2 * ROWS)
    computed = []
    whole = lazy.LazyValue.__array__

    def counted(self, dtype=None, copy=None):
        computed.append(self.shape)
        return whole(self, dtype, copy)

    monkeypatch.setattr(lazy.LazyValue, "__array__", counted)
    path = _save(_chain(mask=mask), tmp_path)
    graph = load_model(path, BATCH, LossKind.NONE).graph
    (op,) = [op for op in graph.ops if op.type == "Attention"]
    causal = mask == "iota-causal"
    assert op.attrs.causal == causal and op.attrs.has_mask == (not causal)
    assert computed == ([] if causal else [(BATCH, 1, ROWS, ROWS)])
    _equals_onnxruntime(path)
