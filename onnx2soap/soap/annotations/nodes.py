"""Which ONNX node computes which op of the graph, and by which names the node knows the
op's tensors.

An op belongs to the node among whose outputs is the op's output: a node of several
outputs (Split, LSTM) computes an op per output, a fusion's op (attention, GELU) is its
chain's last node. Some ops have no node: the loss onnx2soap attaches, the Identity that
reads a shared weight once, a fusion's stand-in transposes. Some nodes have no op:
constants folded at load, a fusion's inner nodes, Identity and Cast nodes that pass
their input through (their readers read the input itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import onnx

from onnx2soap.ir import Graph

# Nodes the importer reads through when they have no op of their own (``passes_input``,
# and an Identity of a weight): a reader's input named by one is the node's input.
PASS_THROUGH = frozenset({"Identity", "Cast"})


@dataclass(frozen=True)
class NodeOps:
    """A node and the ops it computes; ``names``: an op tensor's name in the node (a
    tensor read through a pass-through node or a shared weight's Identity is known to
    the node by another name), for the node's inputs and outputs the ops use."""

    index: int
    ops: tuple[str, ...]
    names: Mapping[str, str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", MappingProxyType(dict(self.names)))


@dataclass(frozen=True)
class Placement:
    nodes: tuple[NodeOps, ...]  # the nodes that compute an op, in file order
    free: tuple[str, ...]  # the ops no node computes, in graph order

    def node_of(self) -> dict[str, NodeOps]:
        return {op: n for n in self.nodes for op in n.ops}


def node_label(node: onnx.NodeProto, index: int) -> str:
    """How errors name a node: its name, else its first output, else its position."""
    return node.name or (node.output[0] if node.output else f"#{index}")


def place(proto: onnx.GraphProto, graph: Graph) -> Placement:
    producer = {out: i for i, n in enumerate(proto.node) for out in n.output if out}
    of_node: dict[int, list[str]] = {}
    free = []
    for op in graph.ops:
        i = producer.get(op.output)
        if i is None:
            free.append(op.name)
        else:
            of_node.setdefault(i, []).append(op.name)
    computing = set(of_node)
    # A free Identity (a shared weight read once): its readers read its output, which
    # the nodes know by the weight's name.
    shared = {
        op.output: op.inputs[0] for op in graph.ops if op.name in free and op.type == "Identity"
    }
    by_name = {op.name: op for op in graph.ops}
    nodes = []
    for i in sorted(of_node):
        node = proto.node[i]
        ops = [by_name[name] for name in of_node[i]]
        names = {op.output: op.output for op in ops}
        read = {t for op in ops for t in op.inputs}
        for given in node.input:
            if not given:
                continue
            source = _through(proto, producer, computing, given)
            tensor = (
                source
                if source in read
                else next((t for t in read if shared.get(t) == source), None)
            )
            if tensor is not None:
                names.setdefault(tensor, given)
        nodes.append(NodeOps(i, tuple(of_node[i]), names))
    return Placement(tuple(nodes), tuple(free))


def _through(
    proto: onnx.GraphProto, producer: Mapping[str, int], computing: set[int], name: str
) -> str:
    """``name`` followed back through pass-through nodes that compute no op."""
    for _ in range(len(proto.node)):
        i = producer.get(name)
        if i is None or i in computing:
            return name
        node = proto.node[i]
        if node.op_type not in PASS_THROUGH or node.domain not in ("", "ai.onnx"):
            return name
        if not node.input or not node.input[0]:
            return name
        name = node.input[0]
    return name
