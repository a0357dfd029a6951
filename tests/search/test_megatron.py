"""The Megatron-LM rule: the splits Megatron makes, found in real exports by their loop
nests (the tests name ops by type to check them; the rule does not), and a plan that
trains on N ranks exactly like one device."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnx2soap.importer import load_model
from onnx2soap.ir import DType
from onnx2soap.search.baselines import Rule, by_rule
from onnx2soap.search.megatron import megatron, node_size
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.presets import preset
from onnx2soap.soap import Partitioner, analyze, load_plan, validate
from tests.executor.mpi import assert_same_training, make_plan, mpirun, reference
from tests.optional import require


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    """The tests' GPT-2 (2 layers, 2 heads, width 16, vocabulary 64), dynamo export."""
    require("torch")
    require("transformers")
    from tests.sequence_models import export_sequence

    return export_sequence("gpt2", tmp_path_factory.mktemp("gpt2"), "dynamo")


@pytest.mark.parametrize(
    ("machine", "node"),
    [("flexflow-p100:2", 4), ("dgx-h100:2", 8), ("alpa-v100:2", 8), ("cpu:4", 4), ("cpu:1", 1)],
)
def test_node_size_is_what_the_fastest_routes_join(machine: str, node: int) -> None:
    assert node_size(preset(machine)) == node


def split(space, op, config) -> dict[str, int]:
    return {d.name: k for d, k in zip(space[op.name], config.degrees, strict=True) if k > 1}


def test_gpt2_splits_where_megatron_does(gpt2: Path) -> None:
    """On two nodes of four (8 devices), 2 heads allow tensor parallelism over 2: the
    vocabulary, the fused QKV projection in 3 x 2 column chunks (each device its own
    heads of query, key and value), attention by heads, the output projection and the
    MLP's second linear by rows (partial sums within a node), the first by columns, the
    LM head by columns (the vocabulary); everything with a rule over the batch by the
    4 pairs, the rest data parallel."""
    graph = load_model(gpt2, 8).graph
    space = analyze(graph)
    machine = preset("flexflow-p100:2")
    strategy = megatron(graph, space, machine.size, node_size(machine))
    validate(graph, space, strategy)
    pg = Partitioner(graph).partition(strategy)
    gemms = [op for op in graph.ops if op.type == "Gemm"]
    assert len(gemms) == 8
    for k, op in enumerate(gemms):  # per layer: QKV, output projection, MLP up, MLP down
        want = [{"n": 4, "co": 6}, {"n": 4, "ci": 2}, {"n": 4, "co": 2}, {"n": 4, "ci": 2}][k % 4]
        assert split(space, op, strategy[op.name]) == want, op.name
        if "ci" in want:  # summed within each node's pair of devices
            assert {g.devices for g in pg.sums[op.name]} == {(0, 1), (2, 3), (4, 5), (6, 7)}
    qkv = strategy[gemms[0].name]
    assert qkv.devices[:6] == (0, 1, 0, 1, 0, 1)  # query, key, value chunks in turn

    def batched(op) -> bool:
        return all(graph.tensors[t].batched for t in op.inputs)

    matmuls = [op for op in graph.ops if op.type == "MatMul"]
    assert not [m for m in matmuls if batched(m)]  # the attention's, fused
    heads = [op for op in graph.ops if op.type == "Attention"]
    assert len(heads) == 2
    for op in heads:
        assert split(space, op, strategy[op.name]) == {"n": 4, "h": 2}  # batch, heads
    head = next(m for m in matmuls if not batched(m))  # its weight: the tied embedding
    assert split(space, head, strategy[head.name]) == {"n": 4, "co": 2}  # the vocabulary
    lookup = next(op for op in graph.ops if op.nest.partial_dims and op.nest.free_dims)
    assert split(space, lookup, strategy[lookup.name]) == {"n": 4, "v": 2}
    norms = [op for op in graph.ops if op.type == "LayerNormalization"]
    assert all(split(space, op, strategy[op.name]) == {"n": 8} for op in norms)
    # nothing moves between QKV's projection and the attention's output projection
    inside = {op.name for op in graph.ops[graph.ops.index(gemms[0]) : graph.ops.index(gemms[1])]}
    crossing = [
        e.consumer
        for e, _, p, c in pg.moves()
        if e.producer in inside and e.consumer in inside and p.device != c.device
    ]
    assert crossing == []


def test_mlp_alternates_columns_and_rows(mlp_onnx: Path) -> None:
    """One node of 4: fc1 by columns, its Relu along, fc2 by rows (its sum whole), the
    second Relu and the loss data parallel, fc3 by columns again."""
    graph = load_model(mlp_onnx, 16).graph
    space = analyze(graph)
    strategy = megatron(graph, space, 4, 4)
    got = [split(space, op, strategy[op.name]) for op in graph.ops]
    assert got == [{"co": 4}, {"f": 4}, {"ci": 4}, {"n": 4}, {"co": 4}, {"n": 4}]


def test_by_rule_reads_the_nodes_off_the_simulator(mlp_onnx: Path) -> None:
    """Without a machine every device is one node; with flexflow-p100:2, tensor parallel
    over a node's 4 and data parallel over the 2 nodes."""
    graph = load_model(mlp_onnx, 16).graph
    space = analyze(graph)
    sim = Simulator(preset("flexflow-p100:2"), RooflineCost())
    fc2 = graph.ops[2].name
    one_node = by_rule(Rule.MEGATRON, graph, space, 8)
    two_nodes = by_rule(Rule.MEGATRON, graph, space, 8, 0, sim)
    names = [d.name for d in space[fc2]]
    assert dict(zip(names, one_node[fc2].degrees, strict=True)) == {"n": 1, "co": 1, "ci": 8}
    assert dict(zip(names, two_nodes[fc2].degrees, strict=True)) == {"n": 2, "co": 1, "ci": 4}
    assert two_nodes[fc2].devices == tuple(range(8))


@pytest.mark.mpi
def test_megatron_gpt2_trains_like_one_device(gpt2: Path, tmp_path: Path) -> None:
    """4 ranks: tensor parallel over pairs, data parallel over the two pairs, float64."""
    batch, steps, lr = 4, 2, 0.05
    plan, one = tmp_path / "megatron.json", tmp_path / "one.json"
    make_plan(gpt2, plan, 4, batch, "megatron")
    make_plan(gpt2, one, 1, batch, "data-parallel")
    losses, weights = reference(one, steps, DType.FLOAT64, lr)
    run = mpirun(plan, 4, tmp_path, "--steps", str(steps), "--lr", str(lr), "--dtype", "float64")
    assert_same_training(run, losses, weights, rtol=1e-10)
    graph = load_model(gpt2, batch).graph
    space = analyze(graph)
    strategy = load_plan(plan).strategy(graph, space)
    summed = [op.type for op in graph.ops if Partitioner(graph).partition(strategy).sums[op.name]]
    assert sorted(summed) == ["Gather"] + ["Gemm"] * 4  # the vocabulary, the rows


def test_fewer_samples_than_devices_cut_the_ops_without_a_rule_inside_each_node(
    mlp_onnx: Path,
) -> None:
    """2 samples on two nodes of 4: the second Relu (no rule) by samples over the nodes and
    by its features over each node's devices (sequence parallelism's cut), the loss by
    samples on each node's first device; by samples alone they ran on devices 0 and 1."""
    graph = load_model(mlp_onnx, 2).graph
    space = analyze(graph)
    strategy = megatron(graph, space, 8, 4)
    validate(graph, space, strategy)
    relu2, loss = graph.ops[3].name, graph.ops[5].name
    assert split(space, graph.ops[3], strategy[relu2]) == {"n": 2, "f": 4}
    assert sorted(strategy[relu2].devices) == list(range(8))
    assert split(space, graph.ops[5], strategy[loss]) == {"n": 2}
    assert strategy[loss].devices == (0, 4)
    # every device works: the plan's tasks cover all 8
    used = {d for op in graph.ops for d in strategy[op.name].devices}
    assert used == set(range(8))
