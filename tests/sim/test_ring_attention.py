"""Ring attention in the simulator: a query task split along the sequence computes on
its own block of keys while the others' arrive, each block its share of the task's
time. A two-device step computed by hand; the blocks' order and shares under a causal
head-tail cut; delta simulation against the full one on context-parallel plans."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from onnx2soap.importer import load_model
from onnx2soap.ir import LossKind
from onnx2soap.search.context import context_parallel
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.delta import DeltaSimulator
from onnx2soap.sim.machine import ComputeDevice
from onnx2soap.sim.presets import cpu, preset
from onnx2soap.sim.simulate import simulate
from onnx2soap.soap import ParallelConfig, Partitioner, Strategy, analyze, candidates
from onnx2soap.soap.streamed import key_blocks
from tests.search.test_context import _block

NS = 1e-9


def _self_attention(path: Path):
    """x [1, 1, 8, 2] is the queries; K = Relu(x), V = Sigmoid(x); mean-squared loss."""
    nodes = [
        helper.make_node("Relu", ["x"], ["k"], name="keys"),
        helper.make_node("Sigmoid", ["x"], ["v"], name="values"),
        helper.make_node("Attention", ["x", "k", "v"], ["a"], name="att"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8, 2])
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 1, 8, 2])
    graph = helper.make_graph(nodes, "g", [x], [a])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), path)
    return load_model(path, loss=LossKind.MSE).graph


def test_a_query_task_starts_on_its_own_keys_before_the_others_arrive(tmp_path: Path) -> None:
    """2 devices of 1 GFLOP/s (1 FLOP a ns, memory free, no overhead); every route two
    ports of 1 ns latency and 0.1 byte a ns, so a [1, 1, 4, 2] float32 piece (32 bytes)
    takes 2 + 320 = 322 ns. Every op split along the sequence in halves, device 0 the
    first. Forward: keys (Relu, 8 points, 1 FLOP each) 0-8 ns; values (Sigmoid, 4 FLOPs)
    8-40; K's half sent to the other device 8-330, V's 330-652 (after K's, on the same
    ports). Each attention task: 64 points (4 queries x 8 keys x width 2) at 6 FLOPs,
    384 ns, half of it on each device's keys: its own 40-232, the other's 652-844 (not
    652-1036, waiting for all). Loss 24 ns (868), its backward 48 (916), the attention's
    768 (1684); the dK, dV halves sent back 1684-2006 and 2006-2328; values' backward
    64 ns (2392), keys' 16: 2408 ns, 192 ns (the own block) shorter than waiting."""
    graph = _self_attention(tmp_path / "att.onnx")
    space = analyze(graph)
    device = ComputeDevice("dev", 1e9, 1e30, 1 << 30, 0.0)
    machine = replace(cpu(2, device, 1e8, 1e-9), transfers_use_compute=False)

    def halves(op: str, dim: str) -> ParallelConfig:
        return ParallelConfig(tuple(2 if d.name == dim else 1 for d in space[op]), (0, 1))

    by_op = {"keys": "h", "values": "h", "att": "m", "loss": "h"}
    strategy = Strategy(2, {op: halves(op, dim) for op, dim in by_op.items()})
    sim = Simulator(machine, RooflineCost())
    pg = Partitioner(graph).partition(strategy)
    tg = sim.task_graph(pg, names=True)
    timeline = simulate(tg)
    times = zip(tg.names, timeline.start, timeline.end, strict=True)
    at = {n: (s / NS, e / NS) for n, s, e in times}
    assert at["send v 1->0"] == pytest.approx((330, 652))
    assert at["fwd att[0] keys of 0"] == pytest.approx((40, 232))
    assert at["fwd att[0] keys of 1"] == pytest.approx((652, 844))
    assert at["fwd att[1] keys of 1"] == pytest.approx((40, 232))
    assert at["fwd att[1] keys of 0"] == pytest.approx((652, 844))
    assert sim.evaluate(pg).step_time_s == pytest.approx(2408 * NS, rel=1e-9)


def test_head_tail_blocks_in_ring_order_with_causal_shares(tmp_path: Path) -> None:
    """512 tokens over 4 devices in 8 chunks of 64 (device i: chunks i and 7 - i), rows
    in blocks of 128 wider than a chunk, so each row of chunk c sees keys 0 .. 64c + 63
    (the diagonal tile whole). Chunk 5's task on device 2 takes device 2's keys (chunks
    2, 5: 64 + 64 of its rows' keys), then device 1's (chunks 1, 6: only 1 is seen),
    then device 0's (chunks 0, 7: 0), then device 3's (chunks 3, 4): shares 2:1:1:2."""
    graph = _block(tmp_path / "block.onnx", 512, 4, 1, 16)
    space = analyze(graph)
    (att,) = [op for op in graph.ops if op.type == "Attention"]
    strategy = context_parallel(graph, space, 4, 4)
    tasks = Partitioner(graph).partition(strategy).tasks[att.name]
    task = tasks[5]
    assert task.device == 2 and task.box[2] == (320, 384)
    blocks = key_blocks(att, tasks, task)
    assert [b.device for b in blocks] == [2, 1, 0, 3]
    assert [b.spans for b in blocks] == [
        ((128, 192), (320, 384)),
        ((64, 128), (384, 448)),
        ((0, 64), (448, 512)),
        ((192, 256), (256, 320)),
    ]
    assert [b.share for b in blocks] == pytest.approx([2 / 6, 1 / 6, 1 / 6, 2 / 6])
    # chunk 0 on device 0 sees its own keys only: the other blocks last, none of its work
    first = key_blocks(att, tasks, tasks[0])
    assert [b.device for b in first] == [0, 3, 2, 1] and [b.share for b in first] == [1, 0, 0, 0]


CASES: dict = {}


def _case(tmp_path_factory):
    if not CASES:
        path = tmp_path_factory.mktemp("ring") / "block.onnx"
        graph = _block(path, 256, 4, 2, 16)
        space = analyze(graph)
        machine = preset("dgx-h100:1")
        moves = {op.name: candidates(space[op.name], machine.size) for op in graph.ops}
        CASES["block"] = (graph, space, moves, machine, Partitioner(graph))
    return CASES["block"]


@pytest.mark.parametrize("head_tail", (True, False))
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_delta_matches_full_on_context_plans(tmp_path_factory, head_tail: bool, data) -> None:
    """From context parallelism over 8 H100s (the attention streamed), proposals to any
    op, the attention and the projections making its keys included: delta simulation
    gives the full one's evaluation and timeline exactly."""
    graph, space, moves, machine, partitioner = _case(tmp_path_factory)
    full = Simulator(machine, RooflineCost())
    delta = DeltaSimulator(Simulator(machine, RooflineCost()), partitioner)
    strategy = context_parallel(graph, space, 8, 8, head_tail)
    ev, state = delta.evaluate(strategy)
    assert ev == full.evaluate(partitioner.partition(strategy))
    names = [op.name for op in graph.ops]
    for _ in range(data.draw(st.integers(1, 6), label="proposals")):
        op = data.draw(st.sampled_from(names), label="op")
        strategy = strategy.replace(op, data.draw(st.sampled_from(moves[op]), label="config"))
        ev, state = delta.evaluate(strategy, state)
        pg = partitioner.partition(strategy)
        assert ev == full.evaluate(pg)
        timeline = simulate(full.task_graph(pg))
        _, timeline2 = delta.task_graph(state)
        assert np.array_equal(timeline.end, timeline2.end)
