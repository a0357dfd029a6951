"""``--data FILE.npz``: the data input by its ONNX name (or "input" for a single-input
model) and "labels", batched along axis 0."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from executor.dataset import open_dataset
from onnx2soap.errors import UserError
from onnx2soap.importer import load_model


@pytest.fixture
def graph(tmp_path: Path):
    weight = numpy_helper.from_array(np.ones((5, 3), np.float32), "W")
    node = helper.make_node("MatMul", ["pixels", "W"], ["logits"], name="fc")
    g = helper.make_graph(
        [node],
        "named",
        [helper.make_tensor_value_info("pixels", onnx.TensorProto.FLOAT, ["batch", 5])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", 3])],
        [weight],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "named.onnx"
    onnx.save(model, str(path))
    return load_model(path, batch=4).graph


@pytest.mark.parametrize("name", ["pixels", "input"])
def test_the_data_input_by_its_onnx_name_or_input(graph, tmp_path: Path, name: str) -> None:
    x = np.arange(30.0).reshape(6, 5)
    path = tmp_path / "d.npz"
    np.savez(path, **{name: x}, labels=np.array([0, 1, 2, 0, 1, 2]))
    data = open_dataset(path, graph, np.dtype(np.float64))
    batch = data.batch(1)  # one full batch of 4 in 6 samples: step 1 wraps to batch 0
    np.testing.assert_array_equal(batch.inputs["pixels"], x[:4])
    np.testing.assert_array_equal(batch.labels, [0, 1, 2, 0])


def test_a_missing_data_array_names_what_is_needed(graph, tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((4, 5)), labels=np.zeros(4, np.int64))
    with pytest.raises(UserError, match=r"missing arrays \['pixels'\].*'pixels' \(or 'input'\)"):
        open_dataset(path, graph, np.dtype(np.float64))
