"""`compare`'s ranks: time in a blocking ring waiting for its peers is waiting, not messages.

Hand-made events for the arithmetic (a member's time in a ring run less the least
member's), the ring members a plan gives, and a traced 2-rank data-parallel run of
BatchNormalizations, checked against sums computed here from the trace file and from
the predicted timeline `compare -o` writes (which devices hold each ring)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from onnx2soap.cli import main as cli
from onnx2soap.measure.probe_messages import (
    CHAIN_OPS,
    RING_ROWS,
    norm_chain_model,
    whole_ops_plan,
)
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim.compare import Event, rings_of, waits_for_peers
from onnx2soap.soap import Partitioner, analyze
from tests.executor.mpi import make_plan, mpirun


def event(name: str, rank: int, dur_us: float, step: int = 3) -> Event:
    return Event(name, "allreduce", rank, 1, 0.0, dur_us, step)


def test_a_member_waits_its_time_less_the_last_to_arrive_s() -> None:
    ring = {("stats bn fwd", 0): (0, 1), ("stats bn fwd", 1): (0, 1)}
    events = [
        event("stats bn fwd", 0, 100.0),  # rank 0 came 70 us before rank 1
        event("stats bn fwd", 1, 30.0),
        event("stats bn fwd", 0, 20.0),  # a second run (a pipeline's microbatch):
        event("stats bn fwd", 1, 45.0),  # rank 1 waits 25 us
        event("stats bn fwd", 0, 50.0, step=4),
        event("stats bn fwd", 1, 50.0, step=4),
        event("fwd bn[0]", 0, 500.0),  # not a ring
    ]
    got = waits_for_peers(events, ring)
    assert got[(0, 3)] == pytest.approx(70e-6)
    assert got[(1, 3)] == pytest.approx(25e-6)
    assert got.get((0, 4), 0.0) == 0.0 and got.get((1, 4), 0.0) == 0.0


def test_rings_apart_and_runs_a_member_lacks_are_left_alone() -> None:
    rings = {
        ("stats bn fwd", 0): (0, 1),
        ("stats bn fwd", 1): (0, 1),
        ("stats bn fwd", 2): (2, 3),
        ("stats bn fwd", 3): (2, 3),
        ("partial sums mm fwd", 0): (0, 1),
        ("partial sums mm fwd", 1): (0, 1),
    }
    events = [
        event("stats bn fwd", 0, 40.0),
        event("stats bn fwd", 1, 10.0),
        event("stats bn fwd", 2, 900.0),  # another ring of the same name: not a peer of 0
        event("stats bn fwd", 3, 1000.0),
        event("partial sums mm fwd", 0, 80.0),  # rank 1's event of this run is missing
    ]
    got = waits_for_peers(events, rings)
    assert got[(0, 3)] == pytest.approx(30e-6)
    assert got[(1, 3)] == 0.0
    assert got[(2, 3)] == 0.0
    assert got[(3, 3)] == pytest.approx(100e-6)


def test_the_plan_s_rings_and_their_members(tmp_path: Path) -> None:
    model = norm_chain_model(tmp_path, 4)
    graph = model.graph
    spread = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 4))
    rings = rings_of(spread)
    for op in (op for op in graph.ops if op.type == "BatchNormalization"):
        for tag in ("fwd", "bwd"):
            for d in range(4):
                assert rings[(f"stats {op.name} {tag}", d)] == (0, 1, 2, 3)
    assert len(rings) == CHAIN_OPS * 2 * 4
    # Every op whole on one device: no ring.
    assert rings_of(whole_ops_plan(graph, 4, lambda i: i % 4)) == {}


@pytest.mark.mpi
def test_traced_rings_split_into_their_cost_and_the_wait_for_peers(tmp_path: Path, capsys) -> None:
    model = norm_chain_model(tmp_path, 2)
    plan = tmp_path / "plan.json"
    make_plan(model.path, plan, 2, RING_ROWS * 2, "data-parallel")
    trace = tmp_path / "measured.json"
    run = mpirun(plan, 2, tmp_path, "--steps", "5", "--trace", str(trace))
    assert run.returncode == 0, run.stderr[-2000:]
    capsys.readouterr()  # what planning printed
    both = tmp_path / "both.json"
    command = ["compare", str(plan), str(trace), "--costs", "roofline"]
    assert cli([*command, "-o", str(both), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # The members of each ring: the predicted devices whose timeline holds it.
    timeline = [e for e in json.loads(both.read_text())["traceEvents"] if e["ph"] == "X"]
    members: dict[str, set[int]] = defaultdict(set)
    for e in timeline:
        if e["pid"] < 2 and e["name"].startswith("stats "):
            members[e["name"]].add(e["pid"])
    assert len(members) == CHAIN_OPS * 2 and all(m == {0, 1} for m in members.values())
    written = json.loads(trace.read_text())
    memory_step = written["otherData"]["memory_step"]
    events = [e for e in written["traceEvents"] if e["ph"] == "X"]
    steps = sorted({e["args"]["step"] for e in events} - {memory_step})
    # Per rank and step: the ring events in the order each rank ran them.
    runs: dict[tuple[int, int], list[tuple[str, float]]] = defaultdict(list)
    for e in events:
        if e["name"] in members and e["args"]["step"] in steps:
            runs[(e["pid"], e["args"]["step"])].append((e["name"], e["dur"] / 1e6))
    for s in steps:
        assert [n for n, _ in runs[(0, s)]] == [n for n, _ in runs[(1, s)]]
    waited = {
        (r, s): sum(
            mine - min(mine, theirs)
            for (_, mine), (_, theirs) in zip(runs[(r, s)], runs[(1 - r, s)], strict=True)
        )
        for r in (0, 1)
        for s in steps
    }
    assert any(w > 0 for w in waited.values())
    # Without the split (every instruction but compute and waits is messages), computed
    # from the trace as before; the split moves the wait from messages to waiting.
    ends = {
        s: max(e["ts"] + e["dur"] for e in events if e["args"]["step"] == s) / 1e6 for s in steps
    }
    for row in doc["ranks"]:
        r, got = row["rank"], row["measured"]
        messages, waiting = [], []
        for s in steps:
            mine = [e for e in events if e["pid"] == r and e["args"]["step"] == s]
            other = [e for e in mine if e["cat"] not in ("forward", "backward", "update")]
            sent = sum(e["dur"] for e in other if not e["name"].startswith("wait ")) / 1e6
            waits = sum(e["dur"] for e in other if e["name"].startswith("wait ")) / 1e6
            last = max(e["ts"] + e["dur"] for e in mine) / 1e6
            messages.append(sent - waited[(r, s)])
            waiting.append(waits + waited[(r, s)] + ends[s] - last)
        assert got["messages_s"] == pytest.approx(statistics.median(messages), abs=1e-9)
        assert got["waiting_s"] == pytest.approx(statistics.median(waiting), abs=1e-9)
        assert got["messages_s"] > 0
