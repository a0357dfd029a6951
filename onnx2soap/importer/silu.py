"""SiLU written out, fused into one ``Swish`` (ONNX opset 24: x · sigmoid(alpha · x)):
``Mul(x, Sigmoid(x))`` in either order, as both of torch's exporters write ``F.silu``
(transformers' LLaMA-family MLP gates), and ``Mul(x, Sigmoid(c · x))`` with a scalar
constant c as alpha (kept exact, a float64 tensor), in the importer's fused domain.

As written, Sigmoid keeps its output for its backward and the product both of its
operands: two [tokens, ffn] tiles where Swish keeps x alone. A sigmoid (or its scaled
input) read elsewhere, or a product with another tensor, stays as written.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx2soap.importer.node_graph import Constant, NodeGraph, is_op
from onnx2soap.ops.registry import FUSED_DOMAIN


def _argument(g: NodeGraph, sigmoid: onnx.NodeProto) -> tuple[str, float, list]:
    """(x, alpha, the nodes) of sigmoid(alpha · x): the Mul by a scalar read by the
    sigmoid alone taken in, else alpha 1."""
    inner = sigmoid.input[0]
    scaled = g.times_scalar(inner)
    if scaled is not None and g.only_reader(inner) is sigmoid:
        return scaled[0], scaled[1], [g.producer(inner), sigmoid]
    return inner, 1.0, [sigmoid]


def _swish(x: str, alpha: float, product: onnx.NodeProto) -> onnx.NodeProto:
    extra = {} if alpha == 1.0 else {"alpha": numpy_helper.from_array(np.array(alpha))}
    return helper.make_node(
        "Swish",
        [x],
        [product.output[0]],
        name=product.name or product.output[0],
        domain=FUSED_DOMAIN,
        **extra,
    )


def fuse_silu(
    nodes: Sequence[onnx.NodeProto], constant: Constant, graph_outputs: Sequence[str]
) -> list[onnx.NodeProto]:
    """``nodes`` with each ``x · sigmoid(alpha · x)`` one Swish node, where the product
    was."""
    g = NodeGraph(nodes, constant, graph_outputs)
    replaced: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for sigmoid in nodes:
        if not is_op(sigmoid, "Sigmoid"):
            continue
        product = g.only_reader(sigmoid.output[0])
        if not is_op(product, "Mul") or product.input[0] == product.input[1]:
            continue
        x, alpha, chain = _argument(g, sigmoid)
        s = sigmoid.output[0]
        if (product.input[1] if product.input[0] == s else product.input[0]) != x:
            continue
        chain.append(product)
        if any(id(n) in dropped for n in chain):
            continue
        dropped.update(id(n) for n in chain)
        replaced[id(product)] = _swish(x, alpha, product)
    return [replaced.get(id(n), n) for n in nodes if id(n) not in dropped or id(n) in replaced]
