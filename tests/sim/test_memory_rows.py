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


def test_optimizer_state_counts_like_its_weights(export_model):
    """Adam keeps two arrays per trainable shard: data parallelism on 4 devices holds every
    weight on each, so each device holds 2 x 4 bytes x the parameter count more."""
    from executor.optim import SLOTS
    from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
    from onnx2soap.sim.memory import OPTIMIZER_SLOTS

    assert {k.value: len(v) for k, v in SLOTS.items()} == OPTIMIZER_SLOTS
    graph = load_model(export_model("mlp"), 8).graph
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 4))
    machine = resolve_machine("cpu:4")
    sgd = Simulator(machine, RooflineCost()).evaluate(pg).peak_memory_bytes
    adam = Simulator(machine, RooflineCost(), optimizer_slots=2).evaluate(pg).peak_memory_bytes
    params = sum(t.numel for t in graph.weights)
    assert all(a - s == 2 * 4 * params for a, s in zip(adam, sgd, strict=True))
