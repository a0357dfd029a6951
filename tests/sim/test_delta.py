"""Delta simulation gives the full simulation's timeline, bit for bit, and its memory."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.delta import DeltaSimulator
from onnx2soap.sim.presets import resolve_machine
from onnx2soap.sim.simulate import simulate
from onnx2soap.soap import Partitioner, analyze, candidates

CASES = {}


def case(export_model, name: str, spec: str):
    """(graph, space, moves, machine, partitioner), shared by the examples of a test."""
    key = (name, spec)
    if key not in CASES:
        graph = load_model(export_model(name), batch=8).graph
        space = analyze(graph)
        machine = resolve_machine(spec)
        moves = {op.name: candidates(space[op.name], machine.size) for op in graph.ops}
        CASES[key] = (graph, space, moves, machine, Partitioner(graph))
    return CASES[key]


def per_resource(tg, timeline) -> dict[int, list[tuple[int, float, float]]]:
    """Every resource's tasks in the order they run, with their times."""
    rows: dict[int, list] = {}
    for i in np.argsort(timeline.start, kind="stable"):
        for r in tg.res_idx[tg.res_ptr[i] : tg.res_ptr[i + 1]]:
            rows.setdefault(int(r), []).append((int(i), timeline.start[i], timeline.end[i]))
    return rows


@pytest.mark.parametrize(
    ("name", "spec"),
    [("cnn", "flexflow-p100:1"), ("bnnet", "cpu:4"), ("tokens", "flexflow-p100:1")],
)
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_delta_matches_full(export_model, name: str, spec: str, data) -> None:
    graph, space, moves, machine, partitioner = case(export_model, name, spec)
    full = Simulator(machine, RooflineCost())
    delta = DeltaSimulator(Simulator(machine, RooflineCost()), partitioner)
    strategy = data_parallel(graph, space, machine.size)
    _, state = delta.evaluate(strategy)
    names = [op.name for op in graph.ops]
    for _ in range(data.draw(st.integers(1, 12), label="proposals")):
        op = data.draw(st.sampled_from(names), label="op")
        strategy = strategy.replace(op, data.draw(st.sampled_from(moves[op]), label="config"))
        ev, state = delta.evaluate(strategy, state)
        pg = partitioner.partition(strategy)
        assert ev == full.evaluate(pg)  # step time, memory, bytes and fits, exactly
        tg = full.task_graph(pg)
        timeline = simulate(tg)
        tg2, timeline2 = delta.task_graph(state)
        assert np.array_equal(timeline.start, timeline2.start)
        assert np.array_equal(timeline.end, timeline2.end)
        assert per_resource(tg, timeline) == per_resource(tg2, timeline2)


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_delta_from_checkpoints_at_64_devices(export_model, data) -> None:
    """Re-runs begin at the checkpoint at or before the first changed slot (only forward
    slots are checkpointed); on 64 devices, with many links, the times stay exact."""
    graph, space, moves, machine, partitioner = case(export_model, "cnn", "flexflow-p100:16")
    full = Simulator(machine, RooflineCost())
    delta = DeltaSimulator(Simulator(machine, RooflineCost()), partitioner)
    assert 0 in delta.entries and max(delta.entries) < min(delta.lay.backward)
    strategy = data_parallel(graph, space, machine.size)
    _, state = delta.evaluate(strategy)
    names = [op.name for op in graph.ops]
    for _ in range(data.draw(st.integers(1, 8), label="proposals")):
        op = data.draw(st.sampled_from(names), label="op")
        strategy = strategy.replace(op, data.draw(st.sampled_from(moves[op]), label="config"))
        ev, state = delta.evaluate(strategy, state)
        pg = partitioner.partition(strategy)
        assert ev == full.evaluate(pg)
        timeline = simulate(full.task_graph(pg))
        _, timeline2 = delta.task_graph(state)
        assert np.array_equal(timeline.start, timeline2.start)
        assert np.array_equal(timeline.end, timeline2.end)
