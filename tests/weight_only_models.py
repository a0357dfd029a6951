"""A hand-built ONNX model whose weight reaches its MatMul only through weight-only ops
(Reshape, two Slices, a Concat that swaps them, a Transpose the importer folds into the
MatMul's read), shared by the copies tests (soap, sim, executor)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

CHAIN = ("reshape", "top", "bottom", "concat")  # the weight-only ops, in graph order


def weight_chain_model(path: Path) -> Path:
    """x [B, 4] @ Transpose(Concat(Slice(Reshape(W), 3:6), Slice(Reshape(W), 0:3))) ->
    Relu -> MatMul(W2 [6, 5]) -> logits [B, 5]; W is [3, 8], reshaped to [6, 4]."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((3, 8)) * 0.5).astype("f4"), "W")
    w2 = numpy_helper.from_array((rng.standard_normal((6, 5)) * 0.5).astype("f4"), "W2")
    ints = [
        numpy_helper.from_array(np.array(v, dtype=np.int64), n)
        for n, v in (("shape", [6, 4]), ("s0", [0]), ("s3", [3]), ("s6", [6]), ("ax0", [0]))
    ]
    nodes = [
        helper.make_node("Reshape", ["W", "shape"], ["Wr"], name="reshape"),
        helper.make_node("Slice", ["Wr", "s0", "s3", "ax0"], ["top"], name="top"),
        helper.make_node("Slice", ["Wr", "s3", "s6", "ax0"], ["bottom"], name="bottom"),
        helper.make_node("Concat", ["bottom", "top"], ["Wc"], name="concat", axis=0),
        helper.make_node("Transpose", ["Wc"], ["Wt"], name="transpose", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "Wt"], ["h"], name="matmul"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W2"], ["logits"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "weight-chain",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", 5])],
        [w, w2, *ints],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path
