"""The full simulation's flat task graph from arrays (sim/slot_arrays.py): the same graph,
number for number, as one flattened from every slot's predecessors as tuples, on a
model whose layers share segments (``taskgraph.Moved``); and the chunked pass the same
times whatever the chunk."""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.gpt_onnx import GptShape, write_gpt
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel, random_strategy
from onnx2soap.search.megatron import megatron, node_size
from onnx2soap.search.pipeline_rule import kept_products
from onnx2soap.search.zero_layers import layer_groups
from onnx2soap.sim import RooflineCost, make_simulator
from onnx2soap.sim.presets import resolve_machine
from onnx2soap.sim.slot_arrays import Feeds, Refs, merged, moved_slots, refs_of
from onnx2soap.sim.taskgraph import (
    EMPTY,
    Moved,
    Segment,
    SlotBuilder,
    all_segments,
    build_with_slots,
    flatten,
    layout,
    relocated,
    slot_kinds,
)
from onnx2soap.soap import Partitioner, analyze
from onnx2soap.soap.buckets import gradient_buckets
from onnx2soap.soap.zero import ZeroStage

simulate_module = sys.modules["onnx2soap.sim.simulate"]

TINY = GptShape(layers=3, width=16, heads=2, vocabulary=40, tokens=6)
ARRAYS = ("duration", "kind", "nbytes", "res_ptr", "res_idx", "pred_ptr", "pred_idx")


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    graph = load_model(write_gpt(tmp_path_factory.mktemp("gpt"), TINY), batch=8).graph
    return graph, analyze(graph)


def _plans(graph, space, machine):
    n = machine.size
    rng = np.random.default_rng(3)
    return {
        "data-parallel": data_parallel(graph, space, n),
        "megatron": megatron(graph, space, n, node_size(machine)),
        "random": random_strategy(graph, space, n, rng),
    }


def _from_tuples(pg, simulator):
    """The task graph flattened from every slot's predecessors as tuples (a compute
    slot's merged with its edges' feeds, as delta simulation keeps them), and how many
    slots hold a moved segment."""
    costs = simulator.costs()
    costs.memo.bind(pg.graph)
    lay = layout(pg.graph)
    kinds = slot_kinds(pg.graph, lay, costs.recompute, costs.zero)
    builder = SlotBuilder(costs, lay, False, kinds, gradient_buckets(pg.graph, costs.bucket_mb))
    segments = all_segments(builder, pg)
    preds = [s.preds for s in segments]
    for i in range(len(pg.graph.ops)):
        preds[lay.forward[i]] = builder.preds(segments, ("fwd", i))
        preds[lay.backward[i]] = builder.preds(segments, ("bwd", i))
    moved = sum(isinstance(s, Moved) for s in segments)
    return flatten(segments, preds, costs.machine, False), moved


@pytest.mark.parametrize("spec", ["cpu:4", "dgx-h100:2"])
def test_the_flat_graph_from_arrays_is_the_one_from_tuples(gpt, spec: str) -> None:
    graph, space = gpt
    machine = resolve_machine(spec)
    groups = layer_groups(graph, space)
    variants = {
        "plain": {},
        "zero-3": {"zero": ZeroStage.PARAMETERS},
        "layered": {"zero": groups.zero(2, ZeroStage.PARAMETERS, ZeroStage.GRADIENTS)},
        "selective": {"recompute": kept_products(graph), "zero": ZeroStage.GRADIENTS},
    }
    partitioner = Partitioner(graph)
    for plan, strategy in _plans(graph, space, machine).items():
        pg = partitioner.partition(strategy)
        for kw in variants.values():
            simulator = make_simulator(machine, RooflineCost(), 2, **kw)
            tg, _, slots = build_with_slots(pg, simulator.costs())
            reference, moved = _from_tuples(pg, simulator)
            for name in ARRAYS:
                got, want = getattr(tg, name), getattr(reference, name)
                assert got.dtype == want.dtype and np.array_equal(got, want), name
            assert len(slots) == tg.size
            assert moved or plan == "random"  # a rule's layers share their segments


def test_a_moved_segment_reads_as_its_source_moved() -> None:
    source = Segment(
        duration=(1.0, 2.0, 3.0),
        kind=(0, 2, 2),
        nbytes=(0, 8, 8),
        resources=((0,), (4,), (4,)),
        preds=((), ((5, 0),), ((5, 0), (6, 1))),
        starts=(0,),
        ends=(2,),
        feeds=((1, (5, 1)), (0, (6, 2))),
    )
    moved = relocated(source, {5: 15, 6: 16})
    assert isinstance(moved, Moved) and moved.duration is source.duration
    assert moved.preds == ((), ((15, 0),), ((15, 0), (16, 1)))
    assert moved.feeds == ((1, (15, 1)), (0, (16, 2)))
    again = relocated(moved, {15: 25, 16: 26})  # moved again: once, from the source
    assert again.source is source and again.preds == ((), ((25, 0),), ((25, 0), (26, 1)))
    assert relocated(EMPTY, {1: 2}) is EMPTY
    refs = refs_of(source.preds).moved({5: 15, 6: 16})
    assert refs.counts.tolist() == [0, 1, 2]
    assert list(zip(refs.slots.tolist(), refs.index.tolist(), strict=True)) == [
        (15, 0),
        (15, 0),
        (16, 1),
    ]


def test_moved_slots_must_all_move() -> None:
    assert moved_slots(np.array([3, 1, 3]), {1: 10, 3: 30}).tolist() == [30, 10, 30]
    with pytest.raises(KeyError):
        moved_slots(np.array([1, 2]), {1: 10})
    with pytest.raises(KeyError):
        moved_slots(np.array([1]), {})
    assert moved_slots(np.zeros(0, np.int64), {}).tolist() == []


def test_merged_keeps_each_task_s_own_then_the_feeds_in_order() -> None:
    own = Refs(np.array([1, 0, 1]), np.array([9, 9]), np.array([0, 1]))
    a = Feeds(np.array([2, 0]), np.array([7, 7]), np.array([0, 1]))
    b = Feeds(np.array([0]), np.array([8]), np.array([3]))
    m = merged(own, [a, Feeds(*(np.zeros(0, np.int64),) * 3), b])
    assert m.counts.tolist() == [3, 0, 2]
    pairs = list(zip(m.slots.tolist(), m.index.tolist(), strict=True))
    assert pairs == [(9, 0), (7, 1), (8, 3), (9, 1), (7, 0)]
    assert merged(own, []) is own


@pytest.mark.parametrize("chunk", [1, 7, 1 << 16])
def test_the_chunked_pass_is_the_same_whatever_the_chunk(gpt, chunk: int, monkeypatch) -> None:
    graph, space = gpt
    machine = replace(resolve_machine("cpu:4"), cores=2, message_busy=3e-6)
    simulator = make_simulator(machine, RooflineCost(), 2)
    pg = Partitioner(graph).partition(_plans(graph, space, machine)["random"])
    tg = simulator.task_graph(pg)
    whole = simulate_module.simulate(tg)
    monkeypatch.setattr(simulate_module, "CHUNK", chunk)
    parts = simulate_module.simulate(tg)
    assert np.array_equal(whole.start, parts.start) and np.array_equal(whole.end, parts.end)
    assert [c.first for c in simulate_module.chunks(tg, chunk)] == list(range(0, tg.size, chunk))
