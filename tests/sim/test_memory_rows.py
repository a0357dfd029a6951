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
    weight on each, so each device holds 2 x 4 bytes x the parameter count more to the
    end of the step; its update holds three arrays of the largest weight's size besides
    (the MLP's 64 x 64), where this small model peaks."""
    from executor.optim import SLOTS
    from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
    from onnx2soap.sim.memory import OPTIMIZER_SLOTS, op_held

    assert {k.value: len(v) for k, v in SLOTS.items()} == OPTIMIZER_SLOTS
    graph = load_model(export_model("mlp"), 8).graph
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 4))
    params = sum(t.numel for t in graph.weights)

    def held(device: int, slots: int) -> int:
        return sum(
            n
            for op in graph.ops
            for d, n in op_held(graph, op, pg.tasks[op.name], pg.groups[op.name], 4, slots)
            if d == device
        )

    assert all(held(d, 2) - held(d, 0) == 2 * 4 * params for d in range(4))
    machine = resolve_machine("cpu:4")
    sgd = Simulator(machine, RooflineCost()).evaluate(pg).peak_memory_bytes
    adam = Simulator(machine, RooflineCost(), optimizer_slots=2).evaluate(pg).peak_memory_bytes
    largest = max(t.numel for t in graph.weights)
    assert largest == 64 * 64
    assert all(a - s > 2 * 4 * params for a, s in zip(adam, sgd, strict=True))
    assert all(a - s <= 2 * 4 * params + 3 * 4 * largest for a, s in zip(adam, sgd, strict=True))


def test_python_objects_count_on_cpu_ranks_only(tmp_path):
    """The runtime's Python objects live in a CPU rank's memory, not a GPU's. Gemm and
    its cross-entropy split over samples on 2 devices: each device runs the Gemm's and
    the loss's forward and backward and W's all-reduce (5 instructions) and assembles
    the logits piece and its gradient piece (2 pieces), and that is all it holds more
    on CPU ranks than on the same devices taken for GPUs."""
    from dataclasses import replace

    from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
    from onnx2soap.sim.memory import PER_INSTRUCTION, PER_PIECE
    from onnx2soap.soap import ParallelConfig, Strategy
    from tests.sim.tiny import tiny_graph

    graph = tiny_graph(tmp_path)
    space = analyze(graph)
    split = {
        op.name: ParallelConfig((2,) + (1,) * (len(space[op.name]) - 1), (0, 1)) for op in graph.ops
    }
    assert all(space[op.name][0].name == "n" for op in graph.ops)
    pg = Partitioner(graph).partition(Strategy(2, split))
    cpu = resolve_machine("cpu:2")
    gpu = replace(cpu, transfers_use_compute=False)  # the same devices, taken for GPUs
    on_cpu = Simulator(cpu, RooflineCost()).evaluate(pg).peak_memory_bytes
    on_gpu = Simulator(gpu, RooflineCost()).evaluate(pg).peak_memory_bytes
    expected = 5 * PER_INSTRUCTION + 2 * PER_PIECE
    assert [c - g for c, g in zip(on_cpu, on_gpu, strict=True)] == [expected, expected]


def test_a_backward_kernel_peaks_before_the_gradients_of_the_ops_before_it_exist():
    """The backward runs in reverse graph order: while the second op's backward kernel
    runs, the first op's gradients are not yet made. Hand-computed on one device: held
    at the step's end 1,000 bytes, of which the first op's gradients 300 and the second
    op's 100; the second op's kernel holds 400 more while it runs, the first op's 50."""
    from onnx2soap.sim.memory import OpMemory, total

    first = OpMemory(
        held=((0, 500),), outputs=(), grads=((0, 300),), forward=(), backward=((0, 50),)
    )
    second = OpMemory(
        held=((0, 500),), outputs=(), grads=((0, 100),), forward=(), backward=((0, 400),)
    )
    # the second's kernel: 1,000 - 300 + 400, over the first's: 1,000 + 50
    assert total([1000], [first, second]) == (1000 - 300 + 400,)
    late = OpMemory(
        held=((0, 500),), outputs=(), grads=((0, 100),), forward=(), backward=((0, 10),)
    )
    assert total([1000], [first, late]) == (1000 + 50,)  # the first's, over everything
    idle = OpMemory(held=((0, 500),), outputs=(), grads=((0, 300),), forward=(), backward=())
    assert total([1000], [idle, late]) == (1000,)  # no kernel peaks over the step's end
