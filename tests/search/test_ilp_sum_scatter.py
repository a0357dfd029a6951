"""The ILP's additive cost of reduce-scattered partial sums (issue 31) against the
simulator and figures worked by hand.

A partial sum whose readers each need a disjoint chunk of it reduce-scatters forward and
all-gathers its gradient backward (``soap/sum_scatter.py``), and a reader elsewhere takes
each piece from its chunk's holder. The additive cost prices the op all-reduced and puts
the difference on the edge to its one reader, or on a joint term where several ops read
the sum (the decision then depends on all of them). Round machine (``tests/sim/tiny.py``):
a transfer or ring step is 2 us of latency plus 1 us a byte.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.ir import Graph
from onnx2soap.search.additive import AdditiveCost, Decisions
from onnx2soap.search.ilp import IlpOptions, ilp
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.machine import ComputeDevice
from onnx2soap.sim.presets import cpu
from onnx2soap.soap import ParallelConfig, Partitioner, Strategy, analyze
from tests.search.test_ilp import assert_crossing_is_the_partition_maths, exhaustive_additive
from tests.sim.test_sum_scatter import STEP, K, configs, rings
from tests.sim.tiny import round_machine, tiny_graph

US = 1e-6


def mlp(path: Path, fork: bool = False) -> Graph:
    """x [8, 16] -> MatMul W1 [16, 64] -> Relu -> MatMul W2 [64, 64] -> cross-entropy:
    Megatron's MLP where the second MatMul splits its contraction and the loss its
    samples. ``fork``: the second MatMul's sum read by a Relu and a Sigmoid, added."""
    w1 = numpy_helper.from_array(np.ones((16, 64), np.float32), "W1")
    w2 = numpy_helper.from_array(np.ones((64, 64), np.float32), "W2")
    summed = "s" if fork else "logits"
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("MatMul", ["a", "W2"], [summed], name="mm2"),
    ]
    if fork:
        nodes += [
            helper.make_node("Relu", ["s"], ["p"], name="relu2"),
            helper.make_node("Sigmoid", ["s"], ["q"], name="sigmoid"),
            helper.make_node("Add", ["p", "q"], ["logits"], name="add"),
        ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", 64])],
        [w1, w2],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return load_model(path, batch=8).graph


def simulator(devices: int) -> Simulator:
    """Links at 100 MB/s: slow enough that Megatron's MLP beats data parallelism, and
    that reduce-scattering its sum beats splitting the second MatMul by columns."""
    device = ComputeDevice("dev", 1e9, 1e10, 1 << 30, 1e-6)
    machine = replace(cpu(devices, device, 1e8, 1e-6), transfers_use_compute=False)
    return Simulator(machine, RooflineCost())


def scattered(graph: Graph, strategy: Strategy) -> list[str]:
    """The ops whose sums reduce-scatter under ``strategy``."""
    sums = Partitioner(graph).partition(strategy).sums
    return [n for n, groups in sums.items() if any(g.scatter is not None for g in groups)]


@pytest.fixture
def tiny(tmp_path: Path) -> Graph:
    """tests/sim/test_sum_scatter's: x [8, 8] @ W [8, 4] -> Relu -> cross-entropy."""
    return tiny_graph(tmp_path, batch=8, relu=True)


def test_the_edge_to_a_sole_reader_prices_the_simulators_reduce_scatter(tiny) -> None:
    """The Gemm split 4 ways over its contraction, read by a Relu split by samples over
    the same devices: each reads its own rows, so no piece crosses, and the edge carries
    the reduce-scatter and all-gather in place of the all-reduce both ways."""
    split, whole = configs(tiny, relu_split=True), configs(tiny, relu_split=False)
    gemm, relu, _ = (op.name for op in tiny.ops)
    assert scattered(tiny, split) == [gemm] and scattered(tiny, whole) == []
    model = AdditiveCost(tiny, Simulator(round_machine(K), RooflineCost()))
    scatter, reduce = rings(tiny, split), rings(tiny, whole)  # the simulator's rings
    by_sim = sum(s for s, _ in scatter.values()) - sum(s for s, _ in reduce.values())
    assert model.edge(0, split[gemm], split[relu]) == pytest.approx(by_sim, rel=1e-12)
    # by hand: k - 1 steps each way instead of 2(k - 1)
    assert by_sim == pytest.approx(-2 * (K - 1) * STEP, rel=1e-12)
    # the whole Relu on device 0 leaves the all-reduce: the edge costs its pieces only
    assert model.edge(0, whole[gemm], whole[relu]) == 0.0


def test_readers_off_the_group_take_their_pieces_from_the_chunks_holder(tiny) -> None:
    """The Gemm's sum over devices 0 and 1, read by a Relu split by samples over 4:
    device 0 holds rows 0-2, device 1 rows 2-8, so device 1 (not the owner, 0) sends
    devices 2 and 3 their 2 rows x 4 columns."""
    space = analyze(tiny)
    gemm, relu, loss = (op.name for op in tiny.ops)

    def split(op: str, kind: str, devices: tuple[int, ...]) -> ParallelConfig:
        degrees = tuple(len(devices) if d.kind.value == kind else 1 for d in space[op])
        return ParallelConfig(degrees, devices)

    every = (0, 1, 2, 3)
    strategy = Strategy(
        K,
        {
            gemm: split(gemm, "reduction", (0, 1)),
            relu: split(relu, "sample", every),
            loss: split(loss, "sample", every),
        },
    )
    (group,) = Partitioner(tiny).partition(strategy).sums[gemm]
    assert [c[0] for c in group.scatter.chunks] == [(0, 2), (2, 8)]
    assert assert_crossing_is_the_partition_maths(tiny, strategy) == 1
    # device 1 sends two pieces of 32 bytes, each way (the gradient comes back)
    pieces = 2 * 2 * (2 * US + 32 * US)
    # one ring step each way over the chunks' runs (8 and 24 floats: the slower's 96
    # bytes), where the all-reduce takes two steps of 16 floats each way
    rings_s = 2 * (2 * US + 96 * US) - 2 * 2 * (2 * US + 64 * US)
    model = AdditiveCost(tiny, Simulator(round_machine(K), RooflineCost()))
    assert model.edge(0, strategy[gemm], strategy[relu]) == pytest.approx(
        pieces + rings_s, rel=1e-12
    )


def test_a_follower_reading_a_sum_picks_by_the_reduce_scatter(tiny) -> None:
    """The Relu follows the Gemm along an edge that can cost less than nothing (the
    correction): for every Gemm config it still takes the config of least own cost plus
    edge, as by trying all."""
    model = AdditiveCost(tiny, Simulator(round_machine(K), RooflineCost()))
    decisions = Decisions(tiny, analyze(tiny), model, mesh_only=False)
    gemm, relu, _ = (op.name for op in tiny.ops)
    assert decisions.follows == {relu: gemm}
    saving = 0
    for config in decisions.configs[gemm]:
        chosen = decisions.induced(gemm, config)[relu]
        totals = {c: model.op(relu, c) + model.edge(0, config, c) for c in decisions.configs[relu]}
        assert totals[chosen] == pytest.approx(min(totals.values()), rel=1e-12)
        saving += model.edge_floor(0, config) < 0
    assert saving > 0


def test_megatrons_mlp_costs_what_it_simulates_and_the_ilp_finds_it(tmp_path: Path) -> None:
    """On 4 devices the optimum of the additive cost, the ILP's and the enumeration's,
    is Megatron's MLP with its sum reduce-scattered; every device runs the same work in
    lock-step, so the simulated step is its additive cost exactly. (Priced all-reduced
    it cost 42.7 us more, and the optimum then split the second MatMul by columns, which
    gathers its output for the loss and simulates 1.43x slower.)"""
    graph = mlp(tmp_path / "mlp.onnx")
    space, sim = analyze(graph), simulator(4)
    options = IlpOptions(mesh_only=False, merge=False)
    result = ilp(graph, space, sim, options)
    best, size, model = exhaustive_additive(graph, space, sim, options)
    assert size == 1800 and result.status == "optimal"
    assert result.objective_s == pytest.approx(best, rel=1e-9)
    assert scattered(graph, result.strategy) == ["mm2"]
    megatron = result.strategy["mm2"]
    assert megatron.degrees == (1, 1, 4)  # (samples, columns, contraction)

    def simulated(strategy: Strategy) -> float:
        return sim.evaluate(Partitioner(graph).partition(strategy)).step_time_s

    assert model.strategy(result.strategy) == pytest.approx(simulated(result.strategy), rel=1e-9)
    columns = replace(megatron, degrees=(1, 4, 1))
    by_columns = Strategy(4, {**result.strategy.configs, "mm2": columns})
    assert simulated(by_columns) > 1.4 * simulated(result.strategy)
    merged = ilp(graph, space, sim, IlpOptions(mesh_only=True, merge=True))
    assert merged.decisions == 3 and merged.strategy == result.strategy


def test_a_sum_read_by_two_ops_is_one_term_over_the_three(tmp_path: Path) -> None:
    """The second MatMul's sum read by a Relu and a Sigmoid, each its own decider: the
    decision needs both readers' configs, so the ILP prices a table over three ops'
    configs. Its optimum is the enumeration's, scatters the sum, and simulates at its
    additive cost."""
    graph = mlp(tmp_path / "fork.onnx", fork=True)
    space, sim = analyze(graph), simulator(2)
    options = IlpOptions(mesh_only=False, merge=False)
    result = ilp(graph, space, sim, options)
    best, size, model = exhaustive_additive(graph, space, sim, options)
    (joint,) = model.joints
    assert joint.ops == ("mm2", "relu2", "sigmoid")
    assert size == 2592 and result.status == "optimal" and result.gap <= 1e-9
    assert result.objective_s == pytest.approx(best, rel=1e-9)
    assert scattered(graph, result.strategy) == ["mm2"]
    assert assert_crossing_is_the_partition_maths(graph, result.strategy) == 2
    simulated = sim.evaluate(Partitioner(graph).partition(result.strategy)).step_time_s
    assert model.strategy(result.strategy) == pytest.approx(simulated, rel=1e-9)
