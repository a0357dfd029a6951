"""Attention fused into one op: the chains torch's exporters write for attention, found
and replaced by ONNX's ``Attention`` (``onnx2soap.ops.defs.attention``) so that no step
holds the [queries, keys] scores.

The chain, as both exporters write it for transformers' eager attention, torch's
``scaled_dot_product_attention`` and ``nn.MultiheadAttention``::

    S = MatMul(Q', Kᵀ')              Q' = Q or Q·c, Kᵀ' = Kᵀ or Kᵀ·c (c scalars)
    S = S·c | S/c                    at most one scale, a scalar constant
    S = S + M (+ B)                  up to two added terms: a mask, T5's trainable position
                                     bias (its gradient made, tile by tile)
    P = Softmax(S, axis=-1)
    P = Cast/Identity/Dropout(P)     casts back to S's type (Llama's float32 island),
                                     at most one Dropout that drops in training (the
                                     fused op drops the probabilities as it would)
    O = MatMul(P, V)

Every tensor inside the chain must be read by the next link only (the probabilities
returned too, say, keep it as written). Q, Kᵀ and V must be 4-D [batch, heads, rows,
width] with one batch; Kᵀ's producer, a transpose, is composed with the swap of its last
two axes (no copy where the two cancel). A constant mask that is the causal one (0 on and
below the diagonal, below -1e9 above) becomes ``is_causal``; a mask made by ``Where(c, 0,
-big)`` becomes the boolean ``c``. The softmax then runs in the chain's own precision (as
FlashAttention's, whose probabilities never leave float32 registers): a float64 model
whose exporter rounded the probabilities to float32 agrees with it to that rounding.

What the pass cannot prove equal stays as written (``tests/importer/test_attention_fusion.py``
shows near misses left alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx2soap.importer.lazy import LazyValue, distinct_rows, distinct_shape_of
from onnx2soap.importer.node_graph import Constant, NodeGraph, attribute, is_op
from onnx2soap.ops.registry import FUSED_DOMAIN

# Below this a masked score adds nothing to a softmax: exp(-1e9) is 0 in every float type.
MASKED = -1e9


class _Graph(NodeGraph):
    """The nodes, with the shapes and element types inference gave their tensors."""

    def __init__(
        self,
        nodes: Sequence[onnx.NodeProto],
        constant: Constant,
        types: dict[str, tuple[tuple[int, ...], int]],
        graph_outputs: Sequence[str],
    ) -> None:
        super().__init__(nodes, constant, graph_outputs)
        self.shapes = {k: s for k, (s, _) in types.items()}
        self.elem_types = {k: t for k, (_, t) in types.items()}
        self._kinds: dict[tuple, _Mask | None] = {}

    def constant_kind(self, name: str, scores_shape: tuple[int, ...]) -> _Mask | None:
        """``_constant_kind`` of constant ``name``, worked out once: every layer of a
        decoder reads the one causal mask."""
        key = (name, scores_shape)
        if key not in self._kinds:
            self._kinds[key] = _constant_kind(self.constant(name), scores_shape)
        return self._kinds[key]


@dataclass(frozen=True)
class _Fused:
    """One chain: the nodes it replaces, the nodes standing in for them."""

    removed: tuple[int, ...]  # ids of the replaced nodes
    key_node: tuple[int, onnx.NodeProto | None]  # (id of Kᵀ's transpose, its stand-in)
    attention: onnx.NodeProto  # takes the place of the last MatMul


@dataclass(frozen=True)
class _Drop:
    """A Dropout between the softmax and the product with V: its ratio in training (0:
    the identity) and its seed attribute."""

    ratio: float
    seed: int


def _dropout(g: _Graph, node: onnx.NodeProto) -> _Drop | None:
    """What a Dropout node drops, None where that is not known when loading (a ratio
    or training flag computed at run time) or its mask is read."""
    if len(node.output) > 1 and node.output[1] and g.readers(node.output[1]):
        return None
    inputs = [*node.input, "", ""]
    ratio = 0.5 if not inputs[1] else g.scalar(inputs[1])
    seed = int(attribute(node, "seed", 0))
    if not inputs[2]:
        return _Drop(0.0, seed)  # training_mode omitted: false
    training = g.constant(inputs[2])
    if training is None or ratio is None or training.size != 1:
        return None
    return _Drop(ratio if bool(training.reshape(())) else 0.0, seed)


def _probabilities_end(
    g: _Graph, softmax: onnx.NodeProto
) -> tuple[list, onnx.NodeProto, _Drop] | None:
    """(the links after the softmax, the MatMul with V, the dropout), or None."""
    links, name, drop = [], softmax.output[0], _Drop(0.0, 0)
    want = g.elem_types.get(softmax.input[0])
    while True:
        reader = g.only_reader(name)
        if reader is None:
            return None
        if is_op(reader, "MatMul") and reader.input[0] == name:
            return (links, reader, drop) if g.elem_types.get(name) == want else None
        if is_op(reader, "Dropout"):
            found = _dropout(g, reader)
            if found is None or (found.ratio and drop.ratio):
                return None  # unknown, or a second one that drops
            drop = found if found.ratio else drop
        elif not (is_op(reader, "Cast") or is_op(reader, "Identity")):
            return None
        links.append(reader)
        name = reader.output[0]


def _strip_scale(g: _Graph, name: str, links: list) -> tuple[str, float]:
    """(the tensor under a scalar Mul or Div by a constant, the factor), or (name, 1)."""
    node = g.producer(name)
    if not (is_op(node, "Mul") or is_op(node, "Div")) or g.readers(name) != 1:
        return name, 1.0
    a, b = node.input
    for x, c in ((a, b), (b, a) if is_op(node, "Mul") else (None, None)):
        value = g.scalar(c) if c else None
        if x is not None and value:
            links.append(node)
            return x, value if is_op(node, "Mul") else 1.0 / value
    return name, 1.0


def _is_scores(g: _Graph, name: str) -> bool:
    """Whether ``name`` is a product of two 4-D tensors, under at most one scale."""
    base, _ = _strip_scale(g, name, [])
    node = g.producer(base)
    return is_op(node, "MatMul") and len(g.shapes.get(base, ())) == 4


def _split_masks(g: _Graph, name: str, links: list) -> tuple[str, list[str]]:
    """(the scores' tensor, the terms added to them: up to two, T5's trainable position
    bias beside its mask)."""
    terms: list[str] = []
    while len(terms) < 2:
        node = g.producer(name)
        if not is_op(node, "Add") or g.readers(name) != 1:
            break
        a, b = node.input
        for scores, term in ((a, b), (b, a)):
            if _is_scores_chain(g, scores) and not _is_scores(g, term):
                links.append(node)
                terms.append(term)
                name = scores
                break
        else:
            break
    return name, terms


def _is_scores_chain(g: _Graph, name: str) -> bool:
    """Whether ``name`` leads to the product through Adds, at most one scale."""
    node = g.producer(name)
    if is_op(node, "Add"):
        return any(_is_scores_chain(g, x) for x in node.input)
    return _is_scores(g, name)


def _causal_rows(block: np.ndarray, first: int) -> bool:
    """Whether rows ``first``... of a square mask's distinct values, every batch and head,
    are the causal one's: 0 on and below the diagonal, at most ``MASKED`` above. Keys
    before the first row are below every row's diagonal, keys past the last above it:
    only the square band between is compared position by position."""
    rows = block.shape[-2]
    band = block[..., first : first + rows]
    below = np.tri(rows, band.shape[-1], dtype=bool)  # key <= query, the diagonal included
    return bool(
        (block[..., :first] == 0).all()
        and (block[..., first + rows :] <= MASKED).all()
        and np.where(below, band == 0, band <= MASKED).all()
    )


def _boolean(g: _Graph, mask: str) -> str | None:
    """``c`` of a mask made as Where(c, 0, -big) and read by the chain alone."""
    node = g.producer(mask)
    if not is_op(node, "Where") or g.readers(mask) != 1:
        return None
    keep, drop = g.scalar(node.input[1]), g.scalar(node.input[2])
    return node.input[0] if keep == 0.0 and drop is not None and drop <= MASKED else None


@dataclass(frozen=True)
class _Mask:
    name: str  # "" where none is read (none, or the causal one)
    causal: bool


def _mask_input(g: _Graph, terms: list[str], scores_shape: tuple[int, ...]) -> _Mask | None:
    """The one mask the added terms come to: constants that add nothing dropped, the
    causal one made ``is_causal``; None where two terms are left (their sum would be a
    [b, h, m, n] tensor of its own)."""
    kept, causal = [], False
    for term in terms:
        shape = g.shapes.get(term)
        if shape is None or len(shape) > 4 or not _broadcasts(shape, scores_shape):
            return None
        kind = g.constant_kind(term, tuple(scores_shape)) if g.constant(term) is not None else None
        if kind is None:
            kept.append(term)
        elif kind.causal:
            if causal:
                return None
            causal = True
    if len(kept) > 1:
        return None
    if not kept:
        return _Mask("", causal)
    condition = _boolean(g, kept[0]) if not causal else None
    return _Mask(condition or kept[0], causal)


def _broadcasts(shape: tuple[int, ...], scores_shape: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, scores_shape) == tuple(scores_shape)
    except ValueError:
        return False


def _constant_kind(value: np.ndarray | LazyValue, scores_shape: tuple[int, ...]) -> _Mask | None:
    """A constant mask that adds nothing (ViT's zeros), or the causal one, or None: read
    on its distinct values (a broadcast view's, a lazy one's) a block of rows at a time,
    so a lazy mask (``importer/lazy.py``) is never computed whole."""
    shape = distinct_shape_of(value)
    square = len(shape) >= 2 and shape[-1] == shape[-2] and scores_shape[-1] == scores_shape[-2]
    zero, causal = True, square and value.dtype.kind == "f"
    for first, block in distinct_rows(value):
        zero = zero and not block.any()
        causal = causal and _causal_rows(block, first)
        if not (zero or causal):
            return None
    if zero:
        return _Mask("", False)
    return _Mask("", True) if causal else None


def _operands(g: _Graph, product: onnx.NodeProto, links: list) -> tuple[str, str, float]:
    """(Q, Kᵀ, the scale folded into them) of the scores' MatMul: Q·c and Kᵀ·c as
    ``nn.MultiheadAttention`` and torch's SDPA decomposition write them."""
    q, kt = product.input
    scaled_q, fq = _strip_scale(g, q, links)
    scaled_kt, fk = _strip_scale(g, kt, links)
    return scaled_q, scaled_kt, fq * fk


def _fits(g: _Graph, q: str, kt: str, v: str) -> bool:
    sq, skt, sv = (g.shapes.get(x, ()) for x in (q, kt, v))
    if not len(sq) == len(skt) == len(sv) == 4:
        return False
    (b, h, _, e), (bk, hk, ek, n), (bv, hv, nv, _) = sq, skt, sv
    return b == bk == bv and e == ek and hk == hv and n == nv and hk > 0 and h % hk == 0


def _key(g: _Graph, kt: str, ids: dict[int, int], name: str):
    """K [b, hk, n, e] from Kᵀ: (the tensor, (id of the transpose replaced, its stand-in))."""
    node = g.producer(kt)
    if is_op(node, "Transpose") and g.readers(kt) == 1:
        perm = list(attribute(node, "perm", [3, 2, 1, 0]))
        composed = [perm[0], perm[1], perm[3], perm[2]]
        if composed == [0, 1, 2, 3]:
            return node.input[0], (ids[id(node)], None)
        out = f"{name}/K"
        stand_in = helper.make_node("Transpose", [node.input[0]], [out], name=out, perm=composed)
        return out, (ids[id(node)], stand_in)
    out = f"{name}/K"
    return out, (-1, helper.make_node("Transpose", [kt], [out], name=out, perm=[0, 1, 3, 2]))


def _unrepeated(g: _Graph, name: str) -> str:
    """The key or value heads before transformers' ``repeat_kv`` (Unsqueeze at axis 2,
    Expand to ``g`` copies, Reshape merging them into the heads): the Attention op reads
    each key head for its ``g`` query heads itself, so no step makes the copies."""
    reshape = g.producer(name)
    if not is_op(reshape, "Reshape"):
        return name
    source = reshape.input[0]
    while is_op(g.producer(source), "Identity"):
        source = g.producer(source).input[0]
    expand, merged = g.producer(source), g.shapes.get(name, ())
    if not is_op(expand, "Expand") or len(merged) != 4:
        return name
    big, small = g.shapes.get(expand.output[0], ()), g.shapes.get(expand.input[0], ())
    unsqueeze = g.producer(expand.input[0])
    if len(big) != 5 or len(small) != 5 or small[2] != 1 or not is_op(unsqueeze, "Unsqueeze"):
        return name
    b, hk, group, n, e = big
    axes = g.constant(unsqueeze.input[1]) if len(unsqueeze.input) > 1 else None
    axes = list(attribute(unsqueeze, "axes", [])) if axes is None else axes.ravel().tolist()
    if axes not in ([2], [-3]) or merged != (b, hk * group, n, e) or small != (b, hk, 1, n, e):
        return name
    return unsqueeze.input[0]


def _attention_name(softmax: str) -> str:
    """The fused op's name: the softmax's, "Softmax" made "Attention" ("h0/attn/Softmax"
    -> "h0/attn/Attention"), else with "/attention" after it."""
    for word, fused in (("Softmax", "Attention"), ("softmax", "attention")):
        if softmax.endswith(word):
            return softmax[: -len(word)] + fused
    return f"{softmax}/attention"


def _match(g: _Graph, softmax: onnx.NodeProto, ids: dict[int, int]) -> _Fused | None:
    rank = len(g.shapes.get(softmax.input[0], ()))
    if rank != 4 or attribute(softmax, "axis", -1) not in (-1, 3):
        return None
    end = _probabilities_end(g, softmax)
    if end is None:
        return None
    links, last, drop = end
    links = [*links, softmax, last]
    scores, terms = _split_masks(g, softmax.input[0], links)
    scores, outer = _strip_scale(g, scores, links)
    product = g.producer(scores)
    if not is_op(product, "MatMul") or g.readers(scores) != 1:
        return None
    links.append(product)
    q, kt, inner = _operands(g, product, links)
    v = last.input[1]
    masked = _mask_input(g, terms, g.shapes[softmax.input[0]])
    if masked is None or not _fits(g, q, kt, v):
        return None
    name = _attention_name(softmax.name or softmax.output[0])
    k, key_node = _key(g, kt, ids, name)
    if key_node[1] is None:  # K as it is (its transpose cancelled): maybe repeated
        k, v = _unrepeated(g, k), _unrepeated(g, v)
        if g.shapes.get(k, ())[1:2] != g.shapes.get(v, ())[1:2]:
            return None
    inputs = [q, k, v] + ([masked.name] if masked.name else [])
    attention = helper.make_node(
        "Attention",
        inputs,
        [last.output[0]],
        name=name,
        domain=FUSED_DOMAIN,
        # a float attribute is float32: a float64 model's scale goes as a 0-d tensor
        scale=numpy_helper.from_array(np.array(outer * inner, np.float64)),
        is_causal=int(masked.causal),
        **({"dropout_ratio": drop.ratio, "dropout_seed": drop.seed} if drop.ratio else {}),
    )
    return _Fused(tuple(ids[id(n)] for n in links), key_node, attention)


@dataclass(frozen=True)
class Fusion:
    nodes: list[onnx.NodeProto]
    # the keys transposed for the Attention nodes: name -> (shape, ONNX element type)
    types: dict[str, tuple[tuple[int, ...], int]]


def fuse_attention(
    nodes: Sequence[onnx.NodeProto],
    constant: Constant,
    types: dict[str, tuple[tuple[int, ...], int]],
    graph_outputs: Sequence[str],
) -> Fusion:
    """``nodes`` with every attention chain replaced by one Attention node (in
    ``FUSED_DOMAIN``), in an order that still computes every input before its reader."""
    g = _Graph(nodes, constant, types, graph_outputs)
    ids = {id(n): i for i, n in enumerate(nodes)}
    removed: set[int] = set()
    at: dict[int, list[onnx.NodeProto]] = {}
    for node in nodes:
        if not is_op(node, "Softmax") or ids[id(node)] in removed:
            continue
        fused = _match(g, node, ids)
        if fused is None or removed & set(fused.removed):
            continue
        removed.update(fused.removed)
        last = ids[id(g.producer(fused.attention.output[0]))]  # the MatMul with V
        at.setdefault(last, []).append(fused.attention)
        where, stand_in = fused.key_node
        if where >= 0:
            removed.add(where)
            if stand_in is not None:
                at.setdefault(where, []).append(stand_in)
        else:  # a Kᵀ with no transpose of its own: transposed right before the product
            at.setdefault(last, []).insert(0, stand_in)
    result, made = [], {}
    for i, node in enumerate(nodes):
        for new in at.get(i, []):
            result.append(new)
            if new.op_type == "Transpose":  # a key: its source's shape, permuted
                shape, elem = types[new.input[0]]
                perm = attribute(new, "perm")
                made[new.output[0]] = (tuple(shape[p] for p in perm), elem)
        if i not in removed:
            result.append(node)
    return Fusion(result, made)
