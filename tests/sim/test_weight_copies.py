"""The simulator prices copies of weight-only ops: data parallelism's copies of a weight
chain move nothing between devices each step but the weights' all-reduce (hand-counted
bytes), and the delta simulation of proposals that change copies is the full one, bit
for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.search.replicas import replica_split_kind, split_first
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.delta import DeltaSimulator
from onnx2soap.sim.presets import cpu, resolve_machine
from onnx2soap.sim.simulate import simulate
from onnx2soap.sim.taskgraph import TaskKind
from onnx2soap.soap import Partitioner, analyze, candidates
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.strategy import Strategy
from tests.sim.test_delta import per_resource
from tests.weight_only_models import CHAIN, weight_chain_model

BATCH, RANKS = 6, 3


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    path = weight_chain_model(tmp_path_factory.mktemp("chain") / "chain.onnx")
    graph = load_model(path, BATCH).graph
    return graph, analyze(graph)


def test_data_parallel_moves_only_the_weights_all_reduce(chain) -> None:
    graph, space = chain
    strategy = data_parallel(graph, space, RANKS)
    assert all(strategy[name].copies == RANKS for name in CHAIN)
    pg = Partitioner(graph).partition(strategy)
    chain_edges = [m for m in pg.moves() if m[0].producer in CHAIN]
    assert len(chain_edges) == 5 * RANKS  # reshape -> top, bottom; -> concat (2); -> matmul
    assert all(p.device == c.device for _, _, p, c in chain_edges)  # every piece local
    assert all(p.device == c.device for _, _, p, c in pg.moves())  # nothing else moves
    # W [3, 8] and W2 [6, 5] summed in one bucket by a ring over 3 ranks: each member
    # sends 2 (k - 1) chunks of 54 / 3 elements, 4 bytes each
    simulator = Simulator(cpu(RANKS), RooflineCost())
    assert simulator.evaluate(pg).bytes_moved == RANKS * 2 * (RANKS - 1) * (54 // RANKS) * 4
    # split along a weight dim instead (before copies), the readers gather the chain's
    # output from every device and send the gradients back: more bytes each step
    split = {name: split_first(space[name], replica_split_kind(space[name]), (0, 1, 2))
             for name in CHAIN}  # fmt: skip
    before = Strategy(RANKS, {**strategy.configs, **split})
    moved = simulator.evaluate(Partitioner(graph).partition(before)).bytes_moved
    assert moved > 864


def test_each_copy_is_a_task_on_its_device_and_only_the_ring_moves_bytes(chain) -> None:
    """The trace of one step: every copy of the chain computes on its own device, its
    pieces are local copies (no bytes), and the one ring carries the weights' 864."""
    graph, space = chain
    strategy = data_parallel(graph, space, RANKS)
    simulator = Simulator(cpu(RANKS), RooflineCost())
    tg = simulator.task_graph(Partitioner(graph).partition(strategy), names=True)
    device = {n: int(tg.res_idx[tg.res_ptr[i]]) for i, n in enumerate(tg.names)}
    for name in CHAIN:
        for k in range(RANKS):
            assert device[f"fwd {name}[{k}]"] == k and device[f"bwd {name}[{k}]"] == k
    moving = {n: int(b) for n, b in zip(tg.names, tg.nbytes, strict=True) if b}
    assert moving == {"allreduce bucket 0 on 0,1,2": 864}
    transfers = [n for n, k in zip(tg.names, tg.kind, strict=True) if k == TaskKind.TRANSFER]
    assert transfers and all(n.split()[-1] in ("0->0", "1->1", "2->2") for n in transfers)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
@pytest.mark.parametrize("spec", ["cpu:4", "flexflow-p100:1"])
def test_delta_matches_full_with_copies(chain, spec: str, data) -> None:
    graph, space = chain
    machine = resolve_machine(spec)
    copied = weight_only_ops(graph)
    moves = {
        op.name: candidates(space[op.name], machine.size, op.name in copied) for op in graph.ops
    }
    assert any(c.copies > 1 for c in moves["concat"])
    partitioner = Partitioner(graph)
    full = Simulator(machine, RooflineCost())
    delta = DeltaSimulator(Simulator(machine, RooflineCost()), partitioner)
    strategy = data_parallel(graph, space, machine.size)
    _, state = delta.evaluate(strategy)
    names = [op.name for op in graph.ops]
    for _ in range(data.draw(st.integers(1, 10), label="proposals")):
        name = data.draw(st.sampled_from(names), label="op")
        strategy = strategy.replace(name, data.draw(st.sampled_from(moves[name]), label="config"))
        ev, state = delta.evaluate(strategy, state)
        pg = partitioner.partition(strategy)
        assert ev == full.evaluate(pg)
        tg = full.task_graph(pg)
        timeline = simulate(tg)
        tg2, timeline2 = delta.task_graph(state)
        assert np.array_equal(timeline.start, timeline2.start)
        assert np.array_equal(timeline.end, timeline2.end)
        assert per_resource(tg, timeline) == per_resource(tg2, timeline2)
