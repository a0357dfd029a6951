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
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx2soap.importer.node_graph import Constant, NodeGraph, is_op
from onnx2soap.ops.registry import FUSED_DOMAIN

SCALE, CUBIC = math.sqrt(2.0 / math.pi), 0.044715


def _near(value: float | None, want: float) -> bool:
    """Equal to ``want`` as float32 or float64 rounds it (an exporter's scalar)."""
    return value is not None and abs(value - want) <= 1e-6 * want


def _input_of_tanh(c: NodeGraph, tanh: onnx.NodeProto) -> tuple[str, float, float, list] | None:
    """(x, c, k, the nodes) of tanh(c · (x + k · x³)), or None."""
    scaled = c.times_scalar(tanh.input[0])
    if scaled is None or not _near(scaled[1], SCALE) or c.only_reader(tanh.input[0]) is not tanh:
        return None
    inner, scale = scaled
    total = c.producer(inner)
    if not is_op(total, "Add") or c.readers(inner) != 1:
        return None
    for x, cubic_term in ((total.input[0], total.input[1]), (total.input[1], total.input[0])):
        found = c.times_scalar(cubic_term)
        if found is None or not _near(found[1], CUBIC) or c.readers(cubic_term) != 1:
            continue
        power = c.producer(found[0])
        if not is_op(power, "Pow") or power.input[0] != x or c.scalar(power.input[1]) != 3.0:
            continue
        if c.readers(found[0]) != 1:
            continue
        nodes = [power, c.producer(cubic_term), total, c.producer(tanh.input[0])]
        return x, scale, found[1], nodes
    return None


def _only(c: NodeGraph, name: str, op_type: str) -> onnx.NodeProto | None:
    """The one reader of ``name``, if it is an ``op_type``."""
    node = c.only_reader(name)
    return node if is_op(node, op_type) else None


def _output_of_tanh(
    c: NodeGraph, tanh: onnx.NodeProto, x: str
) -> tuple[onnx.NodeProto, list] | None:
    """(the last Mul, the nodes) of 0.5 · x · (1 + t), in either order of its products."""
    plus = _only(c, tanh.output[0], "Add")
    if plus is None:
        return None
    other = plus.input[1] if plus.input[0] == tanh.output[0] else plus.input[0]
    last = _only(c, plus.output[0], "Mul")
    if c.scalar(other) != 1.0 or last is None:
        return None
    factor = last.input[1] if last.input[0] == plus.output[0] else last.input[0]
    half = c.times_scalar(factor)
    if half is not None and half == (x, 0.5) and c.readers(factor) == 1:
        return last, [plus, c.producer(factor), last]  # (0.5 · x) · (1 + t)
    if factor == x:  # (x · (1 + t)) · 0.5
        end = _only(c, last.output[0], "Mul")
        if end is not None and 0.5 in (c.scalar(end.input[0]), c.scalar(end.input[1])):
            return end, [plus, last, end]
    return None


def fuse_tanh_gelu(
    nodes: Sequence[onnx.NodeProto], constant: Constant, graph_outputs: Sequence[str]
) -> list[onnx.NodeProto]:
    """``nodes`` with each such chain one Gelu node, where its last Mul was."""
    c = NodeGraph(nodes, constant, graph_outputs)
    replaced: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for tanh in nodes:
        if not is_op(tanh, "Tanh"):
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
