"""Products that read a transposed copy read the original: ``MatMul(x, Transpose(W))``
becomes one MatMul of W with ``transpose_b`` (``onnx2soap.ops.defs.matmul``), in the
importer's fused domain.

A tied LM head is written so by every exporter (``x @ Eᵀ`` with E the token embedding):
as written, each step copies the [vocabulary, width] weight into its transpose and, in
the backward, the transpose's gradient back, where BLAS multiplies by a transposed view
at no cost. Only a Transpose of the last two axes read by that one product is taken in.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnx2soap.importer.node_graph import NodeGraph, attribute, is_op
from onnx2soap.ops.registry import FUSED_DOMAIN


def _swaps_last_two(node: onnx.NodeProto, rank: int) -> bool:
    perm = attribute(node, "perm")
    swapped = [*range(rank - 2), rank - 1, rank - 2]
    return perm == swapped or (perm is None and rank == 2)


def fuse_transposed_operands(
    nodes: Sequence[onnx.NodeProto], ranks: dict[str, int], graph_outputs: Sequence[str]
) -> list[onnx.NodeProto]:
    """``nodes`` with each such pair made one MatMul, in the order they were."""
    g = NodeGraph(nodes, lambda name: None, graph_outputs)
    replaced: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for node in nodes:
        if not is_op(node, "MatMul"):
            continue
        source, rank = g.producer(node.input[1]), ranks.get(node.input[1], 0)
        if not is_op(source, "Transpose") or rank < 2 or g.readers(node.input[1]) != 1:
            continue
        if not _swaps_last_two(source, rank):
            continue
        replaced[id(node)] = helper.make_node(
            "MatMul",
            [node.input[0], source.input[0]],
            list(node.output),
            name=node.name,
            domain=FUSED_DOMAIN,
            transpose_b=1,
        )
        dropped.add(id(source))
    return [replaced.get(id(n), n) for n in nodes if id(n) not in dropped]
