"""Context parallelism's head-tail balancing (search/context.py) on a causal attention
block: the causal work each device gets under contiguous chunks and under head and tail
chunks, against counts worked by hand; the ops around the attention cut alike; the
simulated step of a compute-bound case; where it is not applied."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx2soap.errors import UserError
from onnx2soap.importer import load_model
from onnx2soap.ir import LossKind
from onnx2soap.search.context import context_parallel, head_tail_device
from onnx2soap.search.plan_request import PlanRequest, decide
from onnx2soap.sim import RooflineCost, make_simulator
from onnx2soap.sim.presets import preset
from onnx2soap.soap import Partitioner, analyze
from onnx2soap.soap.strategy import validate


def _block(path: Path, tokens: int, heads: int, kv_heads: int, width: int, causal: int = 1):
    """x [1, tokens, heads·width] → Q, K, V projections (``kv_heads`` key heads) →
    Attention → output projection; its graph with a mean-squared loss."""
    d, kv = heads * width, kv_heads * width
    rng = np.random.default_rng(0)
    shapes = {"wq": (d, d), "wk": (d, kv), "wv": (d, kv), "wo": (d, d)}
    inits = [
        numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
        for n, s in shapes.items()
    ]
    for n, h in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        split = np.array([-1, tokens, h, width], np.int64)
        inits.append(numpy_helper.from_array(split, f"split_{n}"))
    inits.append(numpy_helper.from_array(np.array([-1, tokens, d], np.int64), "merge"))
    nodes = []
    for n in "qkv":
        nodes += [
            helper.make_node("MatMul", ["x", f"w{n}"], [f"{n}0"]),
            helper.make_node("Reshape", [f"{n}0", f"split_{n}"], [f"{n}1"]),
            helper.make_node("Transpose", [f"{n}1"], [n], perm=[0, 2, 1, 3]),
        ]
    nodes += [
        helper.make_node("Attention", ["q", "k", "v"], ["a"], is_causal=causal),
        helper.make_node("Transpose", ["a"], ["a1"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["a1", "merge"], ["a2"]),
        helper.make_node("MatMul", ["a2", "wo"], ["y"]),
        helper.make_node("Add", ["y", "x"], ["out"]),  # a residual add, per position
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, tokens, d])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, tokens, d])
    graph = helper.make_graph(nodes, "block", [x], [out], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), path)
    return load_model(path, loss=LossKind.MSE).graph


def _attention_work(graph, strategy) -> dict[int, int]:
    """Each device's causal work points in the attention."""
    (att,) = [op for op in graph.ops if op.type == "Attention"]
    pg = Partitioner(graph).partition(strategy)
    work: dict[int, int] = {}
    for task in pg.tasks[att.name]:
        work[task.device] = work.get(task.device, 0) + att.nest.work_points(task.box)
    return work


def test_head_tail_gives_every_device_the_same_causal_work(tmp_path: Path) -> None:
    """4,096 tokens on 4 devices, rows in blocks of 128 (each block over the keys up to
    its last row: block j of the sequence, 1-based, reads 128·j keys). Contiguous: device
    c holds blocks 8c+1 .. 8c+8, 64c + 36 of the 528 block-units: 36/528 (about 1/16) on
    the first, 228/528 (about 7/16) on the last. Head-tail (8 chunks of 4 blocks, chunk
    i and 7 - i on device i): (16i + 10) + (16(7 - i) + 10) = 132, a quarter each."""
    graph = _block(tmp_path / "block.onnx", 4096, 4, 1, 16)
    space = analyze(graph)
    contiguous = context_parallel(graph, space, 4, 4, head_tail=False)
    work = _attention_work(graph, contiguous)
    total = sum(work.values())
    assert [work[c] * 528 for c in range(4)] == [(64 * c + 36) * total for c in range(4)]
    assert work[0] / total == pytest.approx(1 / 16, abs=0.01)
    assert work[3] / total == pytest.approx(7 / 16, abs=0.01)
    balanced = context_parallel(graph, space, 4, 4)
    validate(graph, space, balanced)
    work = _attention_work(graph, balanced)
    assert sorted(work) == [0, 1, 2, 3] and len(set(work.values())) == 1
    assert sum(work.values()) == total


def test_the_ops_around_the_attention_are_cut_alike(tmp_path: Path) -> None:
    """Every op along the sequence in 8 chunks on devices 0, 1, 2, 3, 3, 2, 1, 0: tiles
    cross devices only into the attention (its keys and values, read whole)."""
    graph = _block(tmp_path / "block.onnx", 256, 4, 2, 8)
    space = analyze(graph)
    strategy = context_parallel(graph, space, 4, 4)
    types = {op.name: op.type for op in graph.ops}
    split = [op.name for op in graph.ops if 8 in strategy[op.name].degrees]
    assert {types[n] for n in split} >= {"MatMul", "Reshape", "Transpose", "Attention", "Add"}
    assert all(strategy[n].devices == (0, 1, 2, 3, 3, 2, 1, 0) for n in split)
    pg = Partitioner(graph).partition(strategy)
    crossing = {
        (e.tensor, types[e.consumer])
        for e in pg.edges
        for o in e.overlaps
        if pg.tasks[e.producer][o.src_task].device != pg.tasks[e.consumer][o.dst_task].device
    }
    assert crossing == {("k", "Attention"), ("v", "Attention")}


def test_head_tail_simulates_a_shorter_step_where_attention_dominates(tmp_path: Path) -> None:
    """On 4 P100s (the roofline) at 4,096 tokens with one key head for 8 query heads the
    attention's compute dominates: the busiest device of the contiguous plan holds 228 of
    528 units of it, every device of the head-tail plan 132, so the step is shorter,
    though K and V move in twice the pieces."""
    graph = _block(tmp_path / "block.onnx", 4096, 8, 1, 64)
    space = analyze(graph)
    simulator = make_simulator(preset("flexflow-p100:1"), RooflineCost())
    partitioner = Partitioner(graph)
    steps = [
        simulator.evaluate(partitioner.partition(context_parallel(graph, space, 4, 4, h)))
        for h in (False, True)
    ]
    contiguous, balanced = (s.step_time_s for s in steps)
    assert balanced < 0.85 * contiguous, (contiguous, balanced)


def test_two_nodes_each_cut_head_tail(tmp_path: Path) -> None:
    """Two sequences over 2 nodes of 4: by samples over the nodes, each node's devices
    holding their head and tail chunks."""
    _block(tmp_path / "block.onnx", 64, 2, 2, 8)
    graph = load_model(tmp_path / "block.onnx", 2, LossKind.MSE).graph
    space = analyze(graph)
    strategy = context_parallel(graph, space, 8, 4)
    (att,) = [op for op in graph.ops if op.type == "Attention"]
    config = strategy[att.name]
    n, m = (att.nest.dim_index(d) for d in "nm")
    assert config.degrees[n] == 2 and config.degrees[m] == 8
    assert config.devices == (0, 1, 2, 3, 3, 2, 1, 0, 4, 5, 6, 7, 7, 6, 5, 4)
    assert [head_tail_device(c, 4) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_without_a_causal_mask_or_when_turned_off_the_chunks_are_contiguous(
    tmp_path: Path,
) -> None:
    graph = _block(tmp_path / "full.onnx", 256, 4, 2, 8, causal=0)
    space = analyze(graph)
    assert context_parallel(graph, space, 4, 4) == context_parallel(graph, space, 4, 4, False)
    (att,) = [op for op in graph.ops if op.type == "Attention"]
    assert context_parallel(graph, space, 4, 4)[att.name].devices == (0, 1, 2, 3)
    with pytest.raises(UserError, match="--no-head-tail goes with --strategy context"):
        decide(PlanRequest(model="m.onnx", devices=4, strategy="megatron", head_tail=False))
    decide(PlanRequest(model="m.onnx", devices=4, strategy="context", head_tail=False))
