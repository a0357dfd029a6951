"""MLPs of H×H float32 MatMul layers whose weights are ONNX external data.

A model of any size costs no disk: the weights' file is made by ``os.truncate`` (a
sparse file of zeros), unless ``fill`` asks for random values (small models that train).
Written with ``onnx.helper``, so neither torch nor the weights' bytes are needed.

    x[N, H] -> (MatMul W_i -> Relu) x layers -> logits[N, H]   (cross-entropy attached)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 17
ITEMSIZE = 4  # float32


class Fill(Enum):
    ZEROS = "zeros"  # a sparse file: no disk, no time
    RANDOM = "random"  # values written (scaled like torch's Linear init)


@dataclass(frozen=True)
class SparseMlp:
    model: Path
    data: Path
    layers: int
    hidden: int

    @property
    def weight_bytes(self) -> int:
        return self.layers * self.hidden * self.hidden * ITEMSIZE


def write_sparse_mlp(
    folder: Path,
    layers: int,
    hidden: int,
    *,
    fill: Fill = Fill.ZEROS,
    seed: int = 0,
    name: str = "mlp",
) -> SparseMlp:
    """``folder/NAME.onnx`` with its weights in ``folder/NAME.onnx.data``."""
    folder.mkdir(parents=True, exist_ok=True)
    model_path, data_path = folder / f"{name}.onnx", folder / f"{name}.onnx.data"
    size = hidden * hidden * ITEMSIZE
    inits, nodes, x = [], [], "x"
    for i in range(layers):
        w = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=(hidden, hidden))
        w.data_location = TensorProto.EXTERNAL
        for key, value in (("location", data_path.name), ("offset", i * size), ("length", size)):
            w.external_data.add(key=key, value=str(value))
        inits.append(w)
        nodes.append(helper.make_node("MatMul", [x, w.name], [f"m{i}"], name=f"matmul{i}"))
        last = i == layers - 1
        if not last:
            nodes.append(helper.make_node("Relu", [f"m{i}"], [f"h{i}"], name=f"relu{i}"))
        x = f"m{i}" if last else f"h{i}"
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", hidden])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    with open(data_path, "wb") as f:
        if fill is Fill.RANDOM:
            rng = np.random.default_rng(seed)
            bound = 1 / np.sqrt(hidden)
            for _ in range(layers):
                w = rng.uniform(-bound, bound, (hidden, hidden)).astype("<f4")
                f.write(w.tobytes())
    if fill is Fill.ZEROS:
        with open(data_path, "r+b") as f:
            f.truncate(layers * size)
    onnx.save(model, model_path)
    return SparseMlp(model_path, data_path, layers, hidden)
