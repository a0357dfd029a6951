"""The executor's one-device forward equals onnxruntime on the same ONNX model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from mpi4py import MPI

from executor.device import CpuDevice
from executor.program import compile_program
from executor.runtime import Batch, Runtime
from executor.transport import MpiTransport
from onnx2soap.importer import load_model
from onnx2soap.ir import LossKind
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import Partitioner, analyze

BATCH = 3
CASES = [
    ("mlp", "legacy"),
    ("mlp", "dynamo"),
    ("cnn", "legacy"),
    ("cnn", "dynamo"),
    ("spatial", "legacy"),
    ("spatial", "dynamo"),  # AdaptiveAvgPool2d becomes ReduceMean
    ("matmul", "legacy"),
    ("matmul", "dynamo"),
]


def executor_forward(path: Path, x: np.ndarray) -> np.ndarray:
    """Forward of the whole model on one device in float64 (no loss attached)."""
    model = load_model(path, BATCH, LossKind.NONE)
    graph = model.graph
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))
    rt = Runtime(
        pg,
        compile_program(pg, 0),
        MpiTransport(MPI.COMM_SELF, CpuDevice()),
        {**model.weights, **model.state},
        np.float64,
        model.constants,
    )
    tiles = rt.forward(Batch({graph.input: x.astype(np.float64)}, np.zeros(BATCH, np.int64)))
    return tiles[(graph.producer(graph.output).name, 0)]


def onnxruntime_forward(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def check(path: Path) -> None:
    shape = load_model(path, BATCH, LossKind.NONE).graph
    x = np.random.default_rng(0).standard_normal(shape.tensors[shape.input].shape)
    x = x.astype(np.float32)
    expected = onnxruntime_forward(path, x)
    got = executor_forward(path, x)
    assert got.shape == expected.shape
    # onnxruntime computes in float32; the executor here in float64
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize(("name", "exporter"), CASES)
def test_forward_equals_onnxruntime(export_model, name: str, exporter: str) -> None:
    check(export_model(name, exporter))


def test_committed_example_forward_equals_onnxruntime(example_onnx: Path) -> None:
    check(example_onnx)
