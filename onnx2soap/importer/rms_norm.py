"""RMSNorm written out as a chain, fused into one ``RMSNormalization``
(``onnx2soap.ops.defs.rmsnorm``): transformers' LlamaRMSNorm (Llama, Mistral, Qwen2) and
T5LayerNorm as torch's exporters write them,

    x' = Cast(x, float32)                              the float32 island (optional)
    s  = ReduceMean(Pow(x', 2) | Mul(x', x'), [-1])    keepdims
    r  = Sqrt(s + ε)                                   ε a scalar constant
    n  = x' · Reciprocal(r) | x' · Div(1, r) | Div(x', r)
    y  = w · Cast(n, type of x)                        the weight multiply (optional)

each piece keeping its own tile for the backward, where one op keeps x and a number a
row. The fused node is in the importer's fused domain (read at opset 23's semantics
whatever the model imports): it reads x, keeps the file's ε as a float64 tensor (exact
where ONNX's float attribute would round it) and has no scale where the chain multiplies
by no weight.

Casts between float types may sit between x and the square or the product, on the
inverse and after n (T5 casts the inverse back to x's type and multiplies x itself,
where Llama multiplies x's float32 copy): the executor runs every float in the run's one dtype, a
Cast between floats passing its input, and the fused node computes the statistic in
float32 (``stash_type`` 1) as the island does. The output's type must be x's. The
reduction must be over the last axis alone, the weight vary along it alone, and every
tensor inside the chain be read by the chain alone; anything else stays as written
(``tests/importer/test_rms_norm_fusion.py`` shows near misses left alone).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx2soap.importer.node_graph import Constant, NodeGraph, attribute, is_op
from onnx2soap.importer.weights import FLOAT_TYPES
from onnx2soap.ops.registry import FUSED_DOMAIN


class Typed(Protocol):
    """What inference gave a tensor (``prepare.TensorType``)."""

    shape: tuple[int, ...]
    elem_type: int


@dataclass(frozen=True)
class _Norm:
    """One chain: x, ε, the weight (None: none multiplies), its nodes, the last one."""

    x: str
    epsilon: float
    scale: str | None
    nodes: tuple[onnx.NodeProto, ...]
    end: onnx.NodeProto


class _Graph(NodeGraph):
    def __init__(
        self,
        nodes: Sequence[onnx.NodeProto],
        constant: Constant,
        types: Mapping[str, Typed],
        graph_outputs: Sequence[str],
    ) -> None:
        super().__init__(nodes, constant, graph_outputs)
        self.types = types

    def elem_type(self, name: str) -> int | None:
        t = self.types.get(name)
        return None if t is None else t.elem_type

    def rank(self, name: str) -> int:
        t = self.types.get(name)
        return -1 if t is None else len(t.shape)

    def equals(self, name: str, value: float) -> bool:
        """Whether ``name`` is a one-element constant (float or integer) equal to it."""
        found = self.constant(name)
        return found is not None and found.size == 1 and float(found.reshape(())) == value

    def float_cast(self, node: onnx.NodeProto | None) -> bool:
        return (
            is_op(node, "Cast")
            and self.elem_type(node.input[0]) in FLOAT_TYPES
            and attribute(node, "to") in FLOAT_TYPES
        )

    def source(self, name: str, casts: list) -> str:
        """``name`` with the float Casts that made it read through (added to ``casts``)."""
        while self.float_cast(node := self.producer(name)):
            casts.append(node)
            name = node.input[0]
        return name

    def through_casts(self, name: str, casts: list) -> str:
        """Forward along float Casts that alone read each link (added to ``casts``)."""
        while self.float_cast(node := self.only_reader(name)):
            casts.append(node)
            name = node.output[0]
        return name


def _over_last_axis(g: _Graph, reduce: onnx.NodeProto) -> bool:
    """A ReduceMean keeping its dims over the last axis alone (axes an attribute before
    opset 18, a constant input from it on)."""
    if attribute(reduce, "keepdims", 1) != 1:
        return False
    axes = attribute(reduce, "axes")
    if axes is None and len(reduce.input) > 1 and reduce.input[1]:
        found = g.constant(reduce.input[1])
        axes = None if found is None else found.ravel().tolist()
    rank = g.rank(reduce.input[0])
    return axes is not None and len(axes) == 1 and rank >= 2 and axes[0] in (-1, rank - 1)


def _squared(g: _Graph, name: str) -> tuple[onnx.NodeProto, str] | None:
    """(the node, its input) where ``name`` is Pow(x, 2) or Mul(x, x)."""
    node = g.producer(name)
    if is_op(node, "Pow") and g.equals(node.input[1], 2.0):
        return node, node.input[0]
    if is_op(node, "Mul") and node.input[0] == node.input[1]:
        return node, node.input[0]
    return None


def _epsilon(g: _Graph, add: onnx.NodeProto | None, mean: str) -> float | None:
    """ε of ``mean + ε`` (either order), a finite scalar >= 0."""
    if not is_op(add, "Add"):
        return None
    other = add.input[1] if add.input[0] == mean else add.input[0]
    value = g.scalar(other)
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def _normalizing(g: _Graph, root: str, links: list) -> tuple[onnx.NodeProto, str] | None:
    """(the node making n, the x it multiplies) from r = Sqrt(...): x · 1/r, x / r."""
    step = g.only_reader(root)
    if is_op(step, "Div") and step.input[1] == root and step.input[0] != root:
        if not g.equals(step.input[0], 1.0):
            return step, step.input[0]  # x / r
    elif not is_op(step, "Reciprocal"):
        return None
    links.append(step)  # 1 / r
    inverse = g.through_casts(step.output[0], links)
    times = g.only_reader(inverse)
    if not is_op(times, "Mul") or times.input[0] == times.input[1]:
        return None
    return times, times.input[1] if times.input[0] == inverse else times.input[0]


def _weight(g: _Graph, mul: onnx.NodeProto | None, n: str, x: str) -> str | None:
    """The other operand of ``mul`` where it is a float tensor varying along x's last axis
    alone ([h], [1, h], ...): the norm's scale."""
    if not is_op(mul, "Mul") or mul.input[0] == mul.input[1]:
        return None
    w = mul.input[1] if mul.input[0] == n else mul.input[0]
    shape, size = g.types.get(w), g.types[x].shape[-1]
    if shape is None or g.elem_type(w) not in FLOAT_TYPES or not shape.shape:
        return None
    lead = shape.shape[:-1]
    ok = len(shape.shape) <= g.rank(x) and all(s == 1 for s in lead)
    return w if ok and shape.shape[-1] == size else None


def _tail(g: _Graph, n_node: onnx.NodeProto, x: str) -> tuple[list, str | None] | None:
    """The links from the node making n to the chain's end: float Casts, then at most
    the weight multiply, cut after the last whose output has x's type."""
    tail: list = [n_node]
    name = g.through_casts(n_node.output[0], tail)
    mul = g.only_reader(name)
    scale = _weight(g, mul, name, x)
    if scale is not None:
        tail.append(mul)
    want = g.elem_type(x)
    ends = [i for i, node in enumerate(tail) if g.elem_type(node.output[0]) == want]
    if not ends:
        return None
    tail = tail[: ends[-1] + 1]
    return tail, scale if tail[-1] is mul else None


def _inside_only(g: _Graph, nodes: Sequence[onnx.NodeProto], end: onnx.NodeProto) -> bool:
    """Whether every tensor the chain makes, but its end's, is read by the chain alone."""
    reads: dict[str, int] = {}
    for node in nodes:
        for name in node.input:
            reads[name] = reads.get(name, 0) + 1
    made = (o for node in nodes if node is not end for o in node.output)
    return all(name not in g.outputs and reads.get(name, 0) == g.readers(name) for name in made)


def _match(g: _Graph, reduce: onnx.NodeProto) -> _Norm | None:
    """The chain around ``reduce``, a ReduceMean, or None."""
    squared = _squared(g, reduce.input[0]) if _over_last_axis(g, reduce) else None
    add = g.only_reader(reduce.output[0])
    epsilon = _epsilon(g, add, reduce.output[0])
    if squared is None or epsilon is None:
        return None
    root = g.only_reader(add.output[0])
    if not is_op(root, "Sqrt"):
        return None
    links = [squared[0], reduce, add, root]
    x = g.source(squared[1], links)
    found = _normalizing(g, root.output[0], links)
    if found is None or g.source(found[1], links) != x or g.rank(x) < 2:
        return None
    tail = _tail(g, found[0], x)
    if tail is None:
        return None
    # once each: Llama's one Cast of x is read by the square and by the product
    nodes = tuple({id(n): n for n in (*links, *tail[0])}.values())
    end = tail[0][-1]
    if not _inside_only(g, nodes, end):
        return None
    return _Norm(x, epsilon, tail[1], nodes, end)


def _fused(norm: _Norm) -> onnx.NodeProto:
    inputs = [norm.x] if norm.scale is None else [norm.x, norm.scale]
    return helper.make_node(
        "RMSNormalization",
        inputs,
        [norm.end.output[0]],
        name=norm.end.name or norm.end.output[0],
        domain=FUSED_DOMAIN,
        axis=-1,
        epsilon=numpy_helper.from_array(np.array(norm.epsilon, np.float64)),
        stash_type=1,
    )


def fuse_rms_norm(
    nodes: Sequence[onnx.NodeProto],
    constant: Constant,
    types: Mapping[str, Typed],
    graph_outputs: Sequence[str],
) -> list[onnx.NodeProto]:
    """``nodes`` with each such chain one RMSNormalization node, where its end was."""
    g = _Graph(nodes, constant, types, graph_outputs)
    replaced: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for reduce in nodes:
        if not is_op(reduce, "ReduceMean"):
            continue
        norm = _match(g, reduce)
        if norm is None or any(id(n) in dropped for n in norm.nodes):
            continue
        dropped.update(id(n) for n in norm.nodes)
        replaced[id(norm.end)] = _fused(norm)
    return [replaced.get(id(n), n) for n in nodes if id(n) not in dropped or id(n) in replaced]
