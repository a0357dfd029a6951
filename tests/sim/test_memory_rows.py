"""The memory model counts only the batch rows a device's tasks read, as the executor
holds them (hand-computed for data parallelism over 4 devices)."""

from __future__ import annotations

from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim.memory import _batch_bytes
from onnx2soap.soap import Partitioner, analyze


def test_each_device_counts_its_quarter_of_the_batch(export_model):
    graph = load_model(export_model("mlp"), 8).graph
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 4))
    (name,) = graph.inputs
    features = graph.tensors[name].shape[1]  # the MLP's input is [batch, features]
    constants = sum(t.numel * 4 for t in graph.constants)
    labels = 8 * 8  # int64 class ids, whole on every device
    for device in range(4):
        assert _batch_bytes(pg, device, 4) == 2 * features * 4 + labels + constants
