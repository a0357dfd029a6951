"""Delta simulation gives the full simulation's timeline, bit for bit, and its memory."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.delta import DeltaSimulator
from onnx2soap.sim.machine import Cooling, Resume
from onnx2soap.sim.presets import resolve_machine
from onnx2soap.sim.simulate import simulate
from onnx2soap.sim.taskgraph import Costs, Memo
from onnx2soap.soap import Partitioner, analyze, candidates
from onnx2soap.soap.collectives import ring_chunks, ring_steps

CASES = {}


def case(export_model, name: str, spec: str):
    """(graph, space, moves, machine, partitioner), shared by the examples of a test."""
    key = (name, spec)
    if key not in CASES:
        graph = load_model(export_model(name), batch=8).graph
        space = analyze(graph)
        # cpu:4/cores=2: 4 ranks on 2 cores; /busy=S: a message holds its ends S seconds;
        # /ring=S: a ring's step costs S seconds of latency; /resume=A,C: a wait past A
        # seconds costs the next compute task C more; /cool=C,A: a message or ring after a
        # silence of G seconds costs C (1 - exp(-G / A)) more
        preset, *options = spec.split("/")
        option = dict(o.split("=") for o in options)
        busy = float(option["busy"]) if "busy" in option else None
        ring = float(option["ring"]) if "ring" in option else None
        resume = Resume(*map(float, option["resume"].split(","))) if "resume" in option else None
        cool = Cooling(*map(float, option["cool"].split(","))) if "cool" in option else None
        machine = replace(
            resolve_machine(preset),
            cores=int(option.get("cores", 0)),
            message_busy=busy,
            ring_step_latency=ring,
            resume=resume,
            cooling=cool,
        )
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
    [
        ("cnn", "flexflow-p100:1"),
        ("bnnet", "cpu:4"),
        ("bnnet", "cpu:4/cores=2"),
        ("bnnet", "cpu:4/cores=2/busy=3e-6"),
        ("bnnet", "cpu:4/ring=2e-5"),
        ("bnnet", "cpu:4/cores=2/busy=3e-6/resume=1e-6,4e-5"),
        ("tokens", "cpu:4/resume=0,1e-5"),
        ("bnnet", "cpu:4/ring=2e-5/cool=1.7e-4,4e-6"),
        ("branches", "cpu:4/ring=2e-5"),  # two BatchNorms' statistics in one ring
        ("branches", "flexflow-p100:1"),
        ("tokens", "cpu:4/cores=2/resume=1e-6,4e-5/cool=5e-5,1e-5"),
        ("tokens", "flexflow-p100:1"),
    ],
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


@pytest.mark.parametrize(
    ("name", "spec", "bucket_bytes"),
    [
        ("bnnet", "cpu:4", 1000),  # buckets of ops 14, 10 and of ops 7, 4, 3, 1, 0
        ("tokens", "cpu:4/cores=2/busy=3e-6", 400),  # of ops 8, 7, 1 and of op 0
        ("cnn", "flexflow-p100:1", 2048),  # fc2; fc1; both branches' convolutions; conv1
        ("bnnet", "cpu:4/ring=2e-5/cool=1.7e-4,4e-6", 1),  # an op a bucket
        ("branches", "cpu:4/ring=2e-5", 1),  # an op a bucket, the shared ring's ops too
    ],
)
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_delta_matches_full_with_several_buckets(
    export_model, name: str, spec: str, bucket_bytes: int, data
) -> None:
    """A proposal in a gradient bucket rebuilds its rings and its ops' updates: the
    timeline and every resource's tasks are the full simulation's, bit for bit."""
    graph, space, moves, machine, partitioner = case(export_model, name, spec)
    bucket_mb = bucket_bytes / (1 << 20)
    full = Simulator(machine, RooflineCost(), bucket_mb=bucket_mb)
    delta = DeltaSimulator(Simulator(machine, RooflineCost(), bucket_mb=bucket_mb), partitioner)
    assert len(delta.buckets.ops) >= 2
    strategy = data_parallel(graph, space, machine.size)
    _, state = delta.evaluate(strategy)
    weighted = [graph.ops[i].name for ops in delta.buckets.ops for i in ops]
    for _ in range(data.draw(st.integers(1, 12), label="proposals")):
        op = data.draw(st.sampled_from(weighted), label="op")
        strategy = strategy.replace(op, data.draw(st.sampled_from(moves[op]), label="config"))
        ev, state = delta.evaluate(strategy, state)
        pg = partitioner.partition(strategy)
        assert ev == full.evaluate(pg)
        tg = full.task_graph(pg)
        timeline = simulate(tg)
        tg2, timeline2 = delta.task_graph(state)
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


def reference_ring(costs, devices: tuple[int, ...], numel: int) -> tuple[float, int]:
    """A ring's seconds and bytes step by step, every member's send from its own steps."""
    k = len(devices)
    chunks = ring_chunks(numel, k)
    steps = [ring_steps(i, k) for i in range(k)]
    seconds, nbytes = 0.0, 0
    for s in range(2 * (k - 1)):
        sends = []
        for i in range(k):
            lo, hi = chunks[steps[i][s].send_chunk]
            sends.append((devices[i], devices[(i + 1) % k], (hi - lo) * costs.itemsize))
        seconds += max(costs.ring_step_time(a, b, n) for a, b, n in sends)
        nbytes += sum(n for _, _, n in sends)
    return seconds, nbytes


@pytest.mark.parametrize("spec", ["flexflow-p100:16", "cpu:4", "cpu:4/ring"])
@pytest.mark.parametrize("numel", [1, 5, 64, 1000, 12345])
def test_ring_time_from_the_turning_schedule(spec: str, numel: int) -> None:
    """Costs.ring times one step per chunk size and hop, not per member: it agrees with
    the step-by-step sum, bit for bit, over rings of any members in any order (/ring:
    each step at the machine's ring step latency). The GPU preset without its nodes, as
    a machine file may be: with them NCCL's model prices its collectives
    (tests/sim/test_collectives.py)."""
    preset, _, ring = spec.partition("/")
    machine = replace(resolve_machine(preset), nodes=None)
    if ring:
        machine = replace(machine, ring_step_latency=7e-6)
    costs = Costs(machine, RooflineCost(), 4, Memo())
    rng = np.random.default_rng(numel)
    rings = [tuple(range(machine.size)), tuple(range(0, machine.size, 3))]
    rings.append(tuple(int(d) for d in rng.permutation(machine.size)[: max(2, machine.size // 2)]))
    for devices in rings:
        if len(devices) < 2:
            continue
        seconds, links, nbytes = costs.ring(devices, numel)
        assert (seconds, nbytes) == reference_ring(costs, devices, numel)
        hops = [(devices[i], devices[(i + 1) % len(devices)]) for i in range(len(devices))]
        assert links == tuple(sorted({r for a, b in hops for r in costs.link_resources(a, b)}))
