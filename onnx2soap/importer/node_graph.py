"""The prepared model's nodes as the importer's fusions walk them: each tensor's producer
and readers, and the values of its constants (``importer/attention.py``, ``gelu.py``,
``transposed.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import helper

Constant = Callable[[str], "np.ndarray | None"]


def is_op(node: onnx.NodeProto | None, op_type: str) -> bool:
    """Whether ``node`` is an ``op_type`` of ONNX's default domain."""
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def attribute(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class NodeGraph:
    """``nodes`` in their order, the graph's outputs counted as readers."""

    def __init__(
        self, nodes: Sequence[onnx.NodeProto], constant: Constant, graph_outputs: Sequence[str]
    ) -> None:
        self.nodes, self.constant = nodes, constant
        self.outputs = frozenset(graph_outputs)
        self._producers = {o: n for n in nodes for o in n.output}
        self._readers: dict[str, list[onnx.NodeProto]] = {}
        for n in nodes:
            for i in n.input:
                self._readers.setdefault(i, []).append(n)

    def producer(self, name: str) -> onnx.NodeProto | None:
        return self._producers.get(name)

    def readers(self, name: str) -> int:
        return len(self._readers.get(name, ())) + (name in self.outputs)

    def only_reader(self, name: str) -> onnx.NodeProto | None:
        """The node that alone reads ``name`` (None: several, none, or the graph too)."""
        if self.readers(name) != 1 or name in self.outputs:
            return None
        return self._readers[name][0]

    def scalar(self, name: str) -> float | None:
        """The value of a one-element float constant, else None."""
        value = self.constant(name)
        if value is None or value.size != 1 or value.dtype.kind != "f":
            return None
        return float(value.reshape(()))

    def times_scalar(self, name: str, op_type: str = "Mul") -> tuple[str, float] | None:
        """(the other operand, the scalar) where ``name`` is made by an ``op_type`` of a
        tensor and a scalar constant, either way round."""
        node = self.producer(name)
        if not is_op(node, op_type):
            return None
        for x, c in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            value = self.scalar(c)
            if value is not None:
                return x, value
        return None
