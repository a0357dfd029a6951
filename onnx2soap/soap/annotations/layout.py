"""The shardings a node's annotation states under a strategy: its ops' outputs and the
inputs they read, by the node's names for them (``NodeOps.names``).

The writer writes them; the reader of our own files compares them with the file's, so
an annotation edited by another tool after we wrote it is refused rather than run as
the metadata says.
"""

from __future__ import annotations

from collections.abc import Mapping

from onnx2soap.ir import Graph, Op
from onnx2soap.soap.annotations.nodes import NodeOps
from onnx2soap.soap.annotations.sharding import Sharding, input_shardings, output_sharding
from onnx2soap.soap.partition import ParallelConfig


def node_shardings(
    node: NodeOps, ops: Mapping[str, Op], configs: Mapping[str, ParallelConfig], graph: Graph
) -> tuple[Sharding, ...]:
    """One sharding per tensor of the node that an op of it writes or reads in a layout
    the standard can state, in the order first met; a tensor two ops of the node read
    in different layouts (a Split's parts never do) gets none."""
    found: dict[str, Sharding | None] = {}
    for name in node.ops:
        op, config = ops[name], configs[name]
        shapes = [graph.tensors[t].shape for t in op.inputs]
        stated = [output_sharding(op, config), *input_shardings(op, config, shapes).values()]
        for s in stated:
            if s.tensor not in node.names:
                continue  # a tensor the node does not name (a fused chain's inner one)
            named = Sharding(node.names[s.tensor], s.cuts, s.holders)
            found[named.tensor] = named if found.get(named.tensor, named) == named else None
    return tuple(s for s in found.values() if s is not None)
