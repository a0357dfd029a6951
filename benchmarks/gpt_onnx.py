"""A GPT-2-shaped decoder written with ``onnx.helper``: no torch, no weights' bytes.

Token and position embeddings, ``layers`` pre-norm blocks (LayerNorm, Q/K/V projections
with biases, heads by Reshape and Transpose, scaled scores, Softmax, the heads put back,
the output projection, a residual Add; LayerNorm, an MLP of ``4 * width`` with Gelu, a
residual Add), a final LayerNorm and an untied LM head; cross-entropy is attached on
import. Every op of layer k is named ``h{k}/...``, so a test can check by name what the
search finds by structure. Weights are external data on a sparse file (``os.truncate``,
as ``sparse_mlp.py``): a full-size model costs no disk, and planning never reads them.
The causal mask is left out: a mask changes no shape or split, only values.

    write_gpt(folder, GptShape(layers=12, width=768, heads=12, vocabulary=50257, tokens=128))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 20  # Gelu
ITEMSIZE = 4  # float32


@dataclass(frozen=True)
class GptShape:
    layers: int = 12
    width: int = 768
    heads: int = 12
    vocabulary: int = 50257
    tokens: int = 128

    @property
    def ffn(self) -> int:
        return 4 * self.width


GPT2_SMALL = GptShape()


class _Builder:
    def __init__(self, data: Path) -> None:
        self.data, self.offset = data, 0
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []

    def weight(self, name: str, *shape: int) -> str:
        t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
        t.data_location = TensorProto.EXTERNAL
        size = int(np.prod(shape)) * ITEMSIZE
        for key, value in (("location", self.data.name), ("offset", self.offset), ("length", size)):
            t.external_data.add(key=key, value=str(value))
        self.inits.append(t)
        self.offset += size
        return name

    def ints(self, name: str, values: list[int]) -> str:
        self.inits.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    def scalar(self, name: str, value: float) -> str:
        # 0-d: a constant the exporter stored, never trained
        self.inits.append(numpy_helper.from_array(np.array(value, np.float32), name))
        return name

    def op(self, kind: str, name: str, inputs: list[str], **attrs) -> str:
        self.nodes.append(helper.make_node(kind, inputs, [name], name=name, **attrs))
        return name

    def linear(self, name: str, x: str, fan_in: int, fan_out: int) -> str:
        y = self.op("MatMul", f"{name}/MatMul", [x, self.weight(f"{name}.w", fan_in, fan_out)])
        return self.op("Add", f"{name}/Add", [y, self.weight(f"{name}.b", fan_out)])

    def norm(self, name: str, x: str, width: int) -> str:
        scale, bias = self.weight(f"{name}.g", width), self.weight(f"{name}.b", width)
        return self.op("LayerNormalization", name, [x, scale, bias], axis=-1, epsilon=1e-5)


def write_gpt(folder: Path, shape: GptShape = GPT2_SMALL, name: str = "gpt") -> Path:
    """``folder/NAME.onnx``, its weights in ``folder/NAME.onnx.data`` (a sparse file)."""
    folder.mkdir(parents=True, exist_ok=True)
    path, data = folder / f"{name}.onnx", folder / f"{name}.onnx.data"
    b = _Builder(data)
    d, t, h = shape.width, shape.tokens, shape.heads
    heads = b.ints("heads_shape", [-1, t, h, d // h])  # -1: the batch
    merged = b.ints("merged_shape", [-1, t, d])
    scale = b.scalar("score_scale", float(1 / np.sqrt(d // h)))
    tokens = b.op("Gather", "wte/Gather", [b.weight("wte", shape.vocabulary, d), "ids"])
    x = b.op("Add", "wpe/Add", [tokens, b.weight("wpe", t, d)])
    for k in range(shape.layers):
        p = f"h{k}"
        n = b.norm(f"{p}/ln_1", x, d)
        q, kk, v = (b.linear(f"{p}/attn/{w}", n, d, d) for w in "qkv")
        split = {
            w: b.op("Reshape", f"{p}/attn/{w}/Reshape", [y, heads])
            for w, y in zip("qkv", (q, kk, v), strict=True)
        }
        qh = b.op("Transpose", f"{p}/attn/q/Transpose", [split["q"]], perm=[0, 2, 1, 3])
        kh = b.op("Transpose", f"{p}/attn/k/Transpose", [split["k"]], perm=[0, 2, 3, 1])
        vh = b.op("Transpose", f"{p}/attn/v/Transpose", [split["v"]], perm=[0, 2, 1, 3])
        s = b.op("MatMul", f"{p}/attn/scores", [qh, kh])
        s = b.op("Mul", f"{p}/attn/scale", [s, scale])
        s = b.op("Softmax", f"{p}/attn/Softmax", [s], axis=-1)
        a = b.op("MatMul", f"{p}/attn/context", [s, vh])
        a = b.op("Transpose", f"{p}/attn/merge/Transpose", [a], perm=[0, 2, 1, 3])
        a = b.op("Reshape", f"{p}/attn/merge/Reshape", [a, merged])
        x = b.op("Add", f"{p}/attn/residual", [x, b.linear(f"{p}/attn/out", a, d, d)])
        n = b.norm(f"{p}/ln_2", x, d)
        f = b.op("Gelu", f"{p}/mlp/Gelu", [b.linear(f"{p}/mlp/up", n, d, shape.ffn)])
        x = b.op("Add", f"{p}/mlp/residual", [x, b.linear(f"{p}/mlp/down", f, shape.ffn, d)])
    x = b.norm("ln_f", x, d)
    logits = b.op("MatMul", "lm_head", [x, b.weight("lm_head.w", d, shape.vocabulary)])
    graph = helper.make_graph(
        b.nodes,
        name,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", t])],
        [helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["N", t, shape.vocabulary])],
        b.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    with open(data, "wb") as f:
        f.truncate(b.offset)
    onnx.save(model, path)
    return path
