"""What a fused RMSNorm keeps for its backward: its input and one number a row (the
inverse rms its forward stashes), as Megatron-LM counts a norm, where the chain an
exporter writes kept its input, the normalized tile and its statistic's pieces. The
memory model prices the same (``sim/memory.py``: the stash with the inputs kept)."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.ir import Graph, Op, TensorRole
from onnx2soap.ops import definition
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim.memory import _op_bytes
from onnx2soap.soap import Partitioner, analyze
from onnx2soap.soap.saved import kept_for_backward

BATCH, TOKENS, WIDTH, VOCABULARY = 4, 8, 32, 16
ROWS = BATCH * TOKENS
TILE = ROWS * WIDTH * 4  # a [B, T, W] float32 tile
CHAIN = ("Pow", "ReduceMean", "Add", "Sqrt", "Reciprocal", "Mul")


def _model(path: Path) -> Path:
    """x -> MatMul(W1) -> LlamaRMSNorm as the dynamo exporter writes it in float32 ->
    MatMul(W2) -> logits [B, T, V]."""
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    def constant(name: str, value) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value))

    nodes = [
        constant("two", np.float32(2)),
        constant("axes", np.array([-1], np.int64)),
        constant("eps", np.float32(1e-6)),
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Pow", ["h", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"]),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["r"]),
        helper.make_node("Reciprocal", ["r"], ["inv"]),
        helper.make_node("Mul", ["h", "inv"], ["n"]),
        helper.make_node("Mul", ["w", "n"], ["normed"]),
        helper.make_node("MatMul", ["normed", "W2"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", TOKENS, WIDTH])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", TOKENS, VOCABULARY])],
        [weight("W1", WIDTH, WIDTH), weight("w", WIDTH), weight("W2", WIDTH, VOCABULARY)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _saved(graph: Graph, ops: list[Op]) -> dict[str, int]:
    """The activations ``ops`` keep for their backward, with their bytes (float32)."""
    kept: dict[str, int] = {}
    for op in ops:
        inputs, output = kept_for_backward(graph, op, False)
        names = [op.inputs[k] for k in inputs] + ([op.output] if output else [])
        for name in names:
            if graph.tensors[name].role is TensorRole.ACTIVATION:
                kept[name] = graph.tensors[name].numel * 4
    return kept


def test_the_fused_norm_keeps_its_input_and_a_number_a_row(tmp_path: Path) -> None:
    graph = load_model(_model(tmp_path / "norm.onnx"), BATCH).graph
    (norm,) = (op for op in graph.ops if op.type == "RMSNormalization")
    assert not any(op.type in CHAIN for op in graph.ops)
    assert _saved(graph, [norm]) == {"h": TILE}
    statistic = definition(norm.type).stash_bytes(norm.attrs, (BATCH, TOKENS, WIDTH), 4)
    assert statistic == ROWS * 4
    # the memory model: the input buffer and the stash from the forward to the backward
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))
    memory = _op_bytes(graph, norm, pg.tasks[norm.name], pg.groups[norm.name], 4)
    assert dict(memory.kept_inputs) == {0: TILE + statistic}
    assert not memory.kept_tiles


def test_the_chain_as_written_keeps_the_normalized_tile_too(tmp_path, monkeypatch) -> None:
    """With the fusion off, the chain keeps h, the normalized n (for the weight's
    gradient) and the statistic's pieces: a tile and more above the fused norm."""
    prepare = importlib.import_module("onnx2soap.importer.prepare")
    monkeypatch.setattr(prepare, "fuse_rms_norm", lambda nodes, *rest: list(nodes))
    graph = load_model(_model(tmp_path / "norm.onnx"), BATCH).graph
    chain = [op for op in graph.ops if op.type in CHAIN]
    assert len(chain) == 7
    kept = _saved(graph, chain)
    assert kept["h"] == kept["n"] == TILE
    assert sum(kept.values()) >= 2 * TILE + ROWS * 4 > TILE + ROWS * 4
