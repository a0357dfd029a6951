"""GELU's tanh form, written out as a chain, fused into one ``Gelu`` (approximate
"tanh"): transformers' ``gelu_new`` (GPT-2's) as both of torch's exporters write it,

    0.5 · x · (1 + tanh(c · (x + k · x³)))     c ≈ √(2/π), k ≈ 0.044715

a Pow, four Muls, two Adds and a Tanh, each keeping a [tokens, 4h] tensor for its
backward where one op keeps x. The fused node keeps the file's c and k (float32-rounded
scalars in a float64 export: the fusion changes no value) as onnx2soap's own attributes,
float64 tensors, in the importer's fused domain. A chain with other constants, or a link
read elsewhere, stays as written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx2soap.ops.registry import FUSED_DOMAIN

Constant = Callable[[str], "np.ndarray | None"]
SCALE, CUBIC = math.sqrt(2.0 / math.pi), 0.044715


class _Chain:
    def __init__(self, nodes: Sequence[onnx.NodeProto], constant: Constant, outputs) -> None:
        self.constant = constant
        self.producer = {o: n for n in nodes for o in n.output}
        self.readers: dict[str, list[onnx.NodeProto]] = {o: [] for o in outputs}
        for o in outputs:
            self.readers[o].append(None)  # the graph reads it
        for n in nodes:
            for i in n.input:
                self.readers.setdefault(i, []).append(n)

    def scalar(self, name: str) -> float | None:
        value = self.constant(name)
        if value is None or value.size != 1 or value.dtype.kind != "f":
            return None
        return float(value.reshape(()))

    def only(self, name: str, op_type: str) -> onnx.NodeProto | None:
        """The one reader of ``name``, if it is an ``op_type``."""
        readers = self.readers.get(name, [])
        if len(readers) != 1 or readers[0] is None:
            return None
        node = readers[0]
        return node if node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        ok = node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")
        return node if ok else None

    def times_constant(self, name: str, op_type: str = "Mul") -> tuple[str, float] | None:
        """(the other operand, the scalar) of an ``op_type`` of ``name``'s producer."""
        node = self.made_by(name, op_type)
        if node is None:
            return None
        for x, c in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            value = self.scalar(c)
            if value is not None:
                return x, value
        return None


def _near(value: float | None, want: float) -> bool:
    """Equal to ``want`` as float32 or float64 rounds it (an exporter's scalar)."""
    return value is not None and abs(value - want) <= 1e-6 * want


def _input_of_tanh(c: _Chain, tanh: onnx.NodeProto) -> tuple[str, float, float, list] | None:
    """(x, c, k, the nodes) of tanh(c · (x + k · x³)), or None."""
    scaled = c.times_constant(tanh.input[0])
    if scaled is None or not _near(scaled[1], SCALE):
        return None
    inner, scale = scaled
    total = c.made_by(inner, "Add")
    if total is None or c.only(tanh.input[0], "Tanh") is None or len(c.readers[inner]) != 1:
        return None
    for x, cubic_term in ((total.input[0], total.input[1]), (total.input[1], total.input[0])):
        found = c.times_constant(cubic_term)
        if found is None or not _near(found[1], CUBIC) or len(c.readers[cubic_term]) != 1:
            continue
        power = c.made_by(found[0], "Pow")
        if power is None or power.input[0] != x or c.scalar(power.input[1]) != 3.0:
            continue
        if len(c.readers[found[0]]) != 1:
            continue
        nodes = [power, c.made_by(cubic_term, "Mul"), total, c.made_by(tanh.input[0], "Mul")]
        return x, scale, found[1], nodes
    return None


def _output_of_tanh(c: _Chain, tanh: onnx.NodeProto, x: str) -> tuple[onnx.NodeProto, list] | None:
    """(the last Mul, the nodes) of 0.5 · x · (1 + t), in either order of its products."""
    plus = c.only(tanh.output[0], "Add")
    if plus is None:
        return None
    other = plus.input[1] if plus.input[0] == tanh.output[0] else plus.input[0]
    last = c.only(plus.output[0], "Mul")
    if c.scalar(other) != 1.0 or last is None:
        return None
    factor = last.input[1] if last.input[0] == plus.output[0] else last.input[0]
    half = c.times_constant(factor)
    if half is not None and half == (x, 0.5) and len(c.readers[factor]) == 1:
        return last, [plus, c.made_by(factor, "Mul"), last]  # (0.5 · x) · (1 + t)
    if factor == x:  # (x · (1 + t)) · 0.5
        end = c.only(last.output[0], "Mul")
        if end is not None and 0.5 in (c.scalar(end.input[0]), c.scalar(end.input[1])):
            return end, [plus, last, end]
    return None


def fuse_tanh_gelu(
    nodes: Sequence[onnx.NodeProto], constant: Constant, graph_outputs: Sequence[str]
) -> list[onnx.NodeProto]:
    """``nodes`` with each such chain one Gelu node, where its last Mul was."""
    c = _Chain(nodes, constant, graph_outputs)
    replaced: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for tanh in nodes:
        if tanh.op_type != "Tanh" or tanh.domain not in ("", "ai.onnx"):
            continue
        found = _input_of_tanh(c, tanh)
        if found is None:
            continue
        x, scale, cubic, before = found
        after = _output_of_tanh(c, tanh, x)
        if after is None:
            continue
        last, tail = after
        chain = [*before, tanh, *tail]
        if any(id(n) in dropped for n in chain):
            continue
        dropped.update(id(n) for n in chain)
        replaced[id(last)] = helper.make_node(
            "Gelu",
            [x],
            [last.output[0]],
            name=last.name or last.output[0],
            domain=FUSED_DOMAIN,
            approximate="tanh",
            tanh_scale=numpy_helper.from_array(np.array(scale, np.float64)),
            cubic=numpy_helper.from_array(np.array(cubic, np.float64)),
        )
    return [replaced.get(id(n), n) for n in nodes if id(n) not in dropped or id(n) in replaced]
