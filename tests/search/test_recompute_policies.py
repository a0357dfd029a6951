"""``--recompute selective-op``: torchtitan's per-op policy, checked by name on a GPT
written with ``onnx.helper`` (benchmarks/gpt_onnx.py names every op of layer k
``h{k}/...``): every op but the products and the loss is recomputed, and so is every
second product of each layer, counted from one in each (torchtitan's ``mm`` counter
starts again in every checkpointed block); the LM head, outside the layers, is kept."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpt_onnx import GptShape, write_gpt
from onnx2soap.importer import load_model
from onnx2soap.search.pipeline_rule import (
    SEARCHED,
    Recompute,
    recompute_list,
    selective_recompute,
)


def test_every_second_product_of_each_layer_is_recomputed(tmp_path: Path) -> None:
    shape = GptShape(layers=3, width=32, heads=2, vocabulary=64, tokens=8)
    graph = load_model(write_gpt(tmp_path, shape), 2).graph
    names = recompute_list(Recompute.SELECTIVE_OP, graph)
    recomputed = set(names)
    assert recomputed >= set(selective_recompute(graph))
    for k in range(shape.layers):
        products = [op.name for op in graph.ops if op.type == "MatMul" and f"h{k}/" in op.name]
        assert len(products) == 6  # Q, K, V, the output projection, the MLP's two
        assert [p in recomputed for p in products] == [False, True] * 3, products
    kept = [op.name for op in graph.ops if op.type == "MatMul" and op.name not in recomputed]
    assert len(kept) == 3 * shape.layers + 1  # and the LM head, outside every layer
    assert kept[-1] == "lm_head"
    assert graph.loss_op.name not in recomputed
    assert list(names) == [op.name for op in graph.ops if op.name in recomputed]  # graph order


def test_the_search_does_not_offer_a_published_policy() -> None:
    assert Recompute.SELECTIVE_OP not in SEARCHED
    assert set(SEARCHED) | {Recompute.SELECTIVE_OP} == set(Recompute)
