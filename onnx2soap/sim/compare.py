"""Predicted next to measured: the simulator's timeline of a plan against the executor's
``--trace`` of the same plan (``onnx2soap compare``).

Both name tasks alike (``fwd OP[t]``, ``bwd OP[t] partial``, ``update W``...). Per op and
phase, predicted = the sum of the simulated compute tasks' durations, measured = the
median over the steady steps of the sum of the measured compute events; a step is, per
steady step, the latest end over all ranks (times are relative to each rank's step
start), and its measured value the median over the steady steps. The steady steps are
the traced ones but the step that ran under tracemalloc (the file's ``memory_step``),
unless no other was traced.

Per rank, where the step went (``RankTime``): predicted, the device's compute tasks, the
transfers and copies that hold it, and the rest of the step waiting; measured, per
steady step, its compute instructions, its other instructions but waits (sends, posted
receives, all-reduces started, statistics rings), its waits with the rest of the step
after its last instruction, and the time between instructions (the runtime's dispatch,
which the profile's calibration counts in compute); each the median over the steps.

A ring a rank runs to its end before it goes on (a statistics ring, a partial sum's) is
waiting, not messages, for as long as the rank waits there for its peers to arrive: as
the simulator counts it, a ring starts when its last member is ready, and the members
before it wait. The members of a ring leave it together, so each member's time in it
less the least of them (the last to arrive's) is what that member waited for its peers;
no clock is shared between the ranks' traces, so arrivals cannot be read from them.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnx2soap.errors import UserError
from onnx2soap.files import check_input
from onnx2soap.sim.machine import Machine
from onnx2soap.sim.simulate import Timeline
from onnx2soap.sim.taskgraph import TaskGraph, TaskKind
from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.stats_batches import stats_rings, stats_runs

COMPUTE_KINDS = ("forward", "backward", "update")
_COMPUTE = re.compile(r"(fwd|bwd) (.+)\[\d+\]( partial)?")
MEASURED_PID = 100  # measured rank r is process 100 + r in the combined trace
MAX_EVENTS = 5_000_000  # a trace larger than this is no executor's


@dataclass(frozen=True)
class Event:
    name: str
    kind: str
    rank: int
    row: int
    start_us: float
    dur_us: float
    step: int


@dataclass(frozen=True)
class Measured:
    plan: str
    events: tuple[Event, ...]
    peak_memory_bytes: tuple[int, ...]
    memory_step: int | None = None  # the step timed under tracemalloc (slow allocations)

    @property
    def steps(self) -> tuple[int, ...]:
        """The steady traced steps: all but the memory step, unless it is the only one."""
        traced = sorted({e.step for e in self.events})
        steady = [s for s in traced if s != self.memory_step]
        return tuple(steady or traced)


@dataclass(frozen=True)
class Row:
    op: str  # the op (an update: the weight)
    phase: str  # fwd, bwd or update
    predicted_s: float
    measured_s: float


@dataclass(frozen=True)
class RankTime:
    """Where one rank's step went (see the module's docstring)."""

    rank: int
    compute_s: float
    messages_s: float
    waiting_s: float
    between_s: float = 0.0  # measured only: predicted, it is in the compute


@dataclass(frozen=True)
class Comparison:
    rows: tuple[Row, ...]  # sorted by measured time, largest first
    predicted_step_s: float
    measured_steps_s: tuple[float, ...]  # per traced step
    predicted_memory: tuple[int, ...]
    measured_memory: tuple[int, ...]
    predicted_ranks: tuple[RankTime, ...] = ()
    measured_ranks: tuple[RankTime, ...] = ()

    @property
    def measured_step_s(self) -> float:
        return statistics.median(self.measured_steps_s) if self.measured_steps_s else 0.0


def op_phase(name: str, kind: str) -> tuple[str, str] | None:
    """(op, phase) of a compute task's name; None for anything else."""
    if kind == "update" and name.startswith("update "):
        return name[len("update ") :], "update"
    m = _COMPUTE.fullmatch(name)
    return (m[2], m[1]) if m else None


def read_measured(path: Path | str) -> Measured:
    """The executor's ``--trace`` file, checked: a refusal is one line."""
    path = check_input(path, "measured trace")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: not a measured trace (not JSON: {e})") from e
    other = doc.get("otherData") if isinstance(doc, dict) else None
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if (
        not isinstance(other, dict)
        or other.get("measured") is not True
        or not isinstance(events, list)
    ):
        raise UserError(
            f"{path}: not a measured trace (write one with python -m executor run PLAN "
            "--trace FILE)"
        )
    peaks = other.get("peak_memory_bytes", [])
    if not isinstance(peaks, list) or not all(isinstance(p, int) for p in peaks):
        raise UserError(f"{path}: otherData.peak_memory_bytes must be a list of integers")
    if len(events) > MAX_EVENTS:
        raise UserError(f"{path}: more than {MAX_EVENTS} events; not an executor's trace")
    memory_step = other.get("memory_step")  # absent in traces written before it was
    if memory_step is not None and (
        isinstance(memory_step, bool) or not isinstance(memory_step, int)
    ):
        raise UserError(f"{path}: otherData.memory_step must be an integer (a step number)")
    return Measured(str(other.get("plan", "")), _events(path, events), tuple(peaks), memory_step)


def _events(path: Path, events: list) -> tuple[Event, ...]:
    found = []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue  # metadata (process and thread names)
        try:
            found.append(
                Event(
                    str(e["name"]),
                    str(e.get("cat", "")),
                    _int(e["pid"]),
                    _int(e.get("tid", 0)),
                    float(e["ts"]),
                    float(e["dur"]),
                    _int(e.get("args", {}).get("step", 0)),
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise UserError(f"{path}: event {i} is not a measured task ({err})") from err
    return tuple(found)


def _int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


@dataclass(frozen=True)
class Predicted:
    """The simulated step's tasks by resource: compute devices, then links. A pipeline
    plan's task graph is one microbatch's: ``repeats`` says per task how many times a
    step runs it (its microbatches, once for the weights' rings and updates), and
    ``step_s`` is the schedule's step (``Simulator.evaluate``)."""

    tg: TaskGraph
    timeline: Timeline
    machine: Machine
    repeats: np.ndarray | None = None
    step_s: float | None = None
    # (a blocking ring's name in the trace, a member) -> the ring's devices: ``rings_of``
    rings: Mapping[tuple[str, int], tuple[int, ...]] = field(default_factory=dict)

    @property
    def step(self) -> float:
        return self.timeline.makespan if self.step_s is None else self.step_s

    def seconds(self, i: int) -> float:
        """Task ``i``'s time in a step: its duration times its runs."""
        runs = 1 if self.repeats is None else int(self.repeats[i])
        return float(self.tg.duration[i]) * runs

    def compute(self) -> list[tuple[str, str, int, float]]:
        """(name, kind, device, seconds in a step) of every compute task."""
        kinds = {TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.UPDATE}
        found = []
        for i in range(self.tg.size):
            kind = TaskKind(int(self.tg.kind[i]))
            if kind in kinds:
                device = int(self.tg.res_idx[self.tg.res_ptr[i]])
                found.append((self.tg.names[i], kind.name.lower(), device, self.seconds(i)))
        return found


def check_same_plan(predicted: Predicted, measured: Measured, where: str) -> None:
    """Refuse a trace of another plan: every measured compute task must be one the plan
    gives to that rank, and the ranks must be the plan's devices."""
    devices = predicted.machine.size
    ranks = {e.rank for e in measured.events}
    if not measured.events:
        raise UserError(f"{where}: the trace holds no measured task")
    if max(ranks) >= devices or len(measured.peak_memory_bytes) != devices:
        raise UserError(
            f"{where}: a trace of {max(len(measured.peak_memory_bytes), max(ranks) + 1)} "
            f"ranks, but the plan has {devices} devices"
        )
    planned = {(name, device) for name, _, device, _ in predicted.compute()}
    for e in measured.events:
        if e.kind in COMPUTE_KINDS and op_phase(e.name, e.kind) and (e.name, e.rank) not in planned:
            raise UserError(
                f"{where}: not a trace of this plan (rank {e.rank} ran '{e.name}', which "
                "the plan does not give it)"
            )


def compare(predicted: Predicted, measured: Measured, memory: Sequence[int]) -> Comparison:
    pred: dict[tuple[str, str], float] = defaultdict(float)
    for name, kind, _, seconds in predicted.compute():
        key = op_phase(name, kind)
        if key is not None:
            pred[key] += seconds
    steps = measured.steps
    per_step: dict[tuple[str, str], dict[int, float]] = defaultdict(
        lambda: dict.fromkeys(steps, 0.0)
    )
    ends: dict[int, float] = dict.fromkeys(steps, 0.0)
    for e in measured.events:
        if e.step not in ends:
            continue  # the memory step: timed under tracemalloc
        ends[e.step] = max(ends[e.step], (e.start_us + e.dur_us) * 1e-6)
        key = op_phase(e.name, e.kind) if e.kind in COMPUTE_KINDS else None
        if key is not None:
            per_step[key][e.step] += e.dur_us * 1e-6
    keys = set(pred) | set(per_step)
    meas = {k: statistics.median(per_step[k].values()) if k in per_step else 0.0 for k in keys}
    rows = sorted(
        (Row(op, phase, pred.get((op, phase), 0.0), meas[(op, phase)]) for op, phase in keys),
        key=lambda r: (-r.measured_s, -r.predicted_s, r.op, r.phase),
    )
    return Comparison(
        tuple(rows),
        predicted.step,
        tuple(ends[s] for s in steps),
        tuple(memory),
        measured.peak_memory_bytes,
        predicted_ranks(predicted),
        measured_ranks(measured, predicted.machine.size, predicted.rings),
    )


def predicted_ranks(predicted: Predicted) -> tuple[RankTime, ...]:
    """Per device: its compute tasks, the other tasks that hold it, the rest waiting."""
    tg, devices = predicted.tg, predicted.machine.size
    compute, messages = [0.0] * devices, [0.0] * devices
    computing = {TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.UPDATE}
    for i in range(tg.size):
        held = compute if TaskKind(int(tg.kind[i])) in computing else messages
        for r in tg.res_idx[tg.res_ptr[i] : tg.res_ptr[i + 1]]:
            if r < devices:
                held[r] += predicted.seconds(i)
    step = predicted.step
    return tuple(
        RankTime(d, compute[d], messages[d], max(step - compute[d] - messages[d], 0.0))
        for d in range(devices)
    )


def measured_ranks(
    measured: Measured, ranks: int, rings: Mapping[tuple[str, int], tuple[int, ...]]
) -> tuple[RankTime, ...]:
    """Per rank, the medians over the steady steps of where each step went; ``rings``
    (``rings_of``) tells apart a blocking ring's cost from the wait for its peers."""
    steps = measured.steps
    parts = {(r, s): [0.0, 0.0, 0.0, 0.0] for r in range(ranks) for s in steps}
    ends = {(r, s): 0.0 for r in range(ranks) for s in steps}  # the rank's last instruction
    for e in measured.events:
        if (e.rank, e.step) not in parts:
            continue
        part = 0 if e.kind in COMPUTE_KINDS else 2 if e.name.startswith("wait ") else 1
        parts[(e.rank, e.step)][part] += e.dur_us * 1e-6
        ends[(e.rank, e.step)] = max(ends[(e.rank, e.step)], (e.start_us + e.dur_us) * 1e-6)
    step_end = {s: max(ends[(r, s)] for r in range(ranks)) for s in steps}
    peers = waits_for_peers(measured.events, rings)
    for (r, s), (compute, messages, waits, _) in parts.items():
        between = max(ends[(r, s)] - compute - messages - waits, 0.0)
        waited = peers.get((r, s), 0.0)
        parts[(r, s)] = [
            compute,
            messages - waited,
            waits + waited + step_end[s] - ends[(r, s)],
            between,
        ]
    return tuple(
        RankTime(r, *(statistics.median(parts[(r, s)][k] for s in steps) for k in range(4)))
        for r in range(ranks)
    )


def rings_of(pg: PartitionedGraph) -> dict[tuple[str, int], tuple[int, ...]]:
    """Per (the trace's name of a ring a rank runs to its end, a member rank): the
    ring's devices. The statistics rings (a run's shared ones by their joined names) and
    the partial sums' (forward: the sum or its reduce-scatter; backward: the gradient's
    all-reduce or all-gather), as ``executor/trace.py`` names them. A name under which
    one rank joins several rings is left out: its events cannot be told apart."""
    found: dict[tuple[str, int], set[tuple[int, ...]]] = defaultdict(set)
    ops = pg.graph.ops
    for op in ops:
        for group in pg.sums.get(op.name, ()):
            if len(group.devices) < 2:
                continue
            for tag in ("fwd", "bwd"):
                for d in group.devices:
                    found[(f"partial sums {op.name} {tag}", d)].add(tuple(group.devices))
    # statistics: a ring per device set of a run of independent ops (stats_batches.py)
    for run in stats_runs(pg.graph):
        for tag, order in (("fwd", run), ("bwd", run[::-1])):
            for ring in stats_rings(order, lambda i: pg.stats.get(ops[i].name, ())):
                if len(ring.devices) < 2:
                    continue
                name = ring.name(lambda i: ops[i].name, tag)
                for d in ring.devices:
                    found[(name, d)].add(ring.devices)
    return {key: next(iter(sets)) for key, sets in found.items() if len(sets) == 1}


def waits_for_peers(
    events: Sequence[Event], rings: Mapping[tuple[str, int], tuple[int, ...]]
) -> dict[tuple[int, int], float]:
    """Per (rank, step), the seconds it waited in blocking rings for its peers: in each
    run of a ring (the k-th event of its name on every member in a step: a pipeline
    runs one a microbatch), a member's time less the least member's. Runs that some
    member's trace lacks are left out."""
    runs: dict[tuple[str, tuple[int, ...], int], dict[int, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for e in events:  # each rank's events in the order it ran them
        members = rings.get((e.name, e.rank))
        if members is not None:
            runs[(e.name, members, e.step)][e.rank].append(e.dur_us * 1e-6)
    waited: dict[tuple[int, int], float] = defaultdict(float)
    for (_, members, step), times in runs.items():
        counts = {len(times[r]) for r in members}
        if len(counts) != 1:
            continue  # a member's events missing
        for k in range(counts.pop()):
            least = min(times[r][k] for r in members)
            for r in members:
                waited[(r, step)] += times[r][k] - least
    return waited


def combined_trace(
    predicted: Predicted, measured: Measured, comparison: Comparison
) -> Mapping[str, object]:
    """One Perfetto document: the simulated step as processes 0..D-1 ("predicted device
    d", links in process D) and the measured step closest to the median as processes
    100 + r ("measured rank r"), both from time 0."""
    machine, tg, timeline = predicted.machine, predicted.tg, predicted.timeline
    devices = machine.size
    events: list[dict] = []
    for d in range(devices):
        events.append(_process(d, f"predicted device {d}"))
    events.append(_process(devices, "predicted links"))
    for i in range(tg.size):
        for r in tg.res_idx[tg.res_ptr[i] : tg.res_ptr[i + 1]]:
            pid, tid = (int(r), 0) if r < devices else (devices, int(r) - devices)
            events.append(
                _complete(
                    tg.names[i],
                    TaskKind(int(tg.kind[i])).name.lower(),
                    pid,
                    tid,
                    float(timeline.start[i]) * 1e6,
                    float(tg.duration[i]) * 1e6,
                )
            )
    for j, link in enumerate(machine.links):
        events.append(_thread(devices, j, link.name))
    step = _median_step(comparison, measured.steps)
    ranks = sorted({e.rank for e in measured.events})
    for r in ranks:
        events.append(_process(MEASURED_PID + r, f"measured rank {r}"))
        events.append(_thread(MEASURED_PID + r, 0, "compute"))
        events.append(_thread(MEASURED_PID + r, 1, "communication"))
    for e in measured.events:
        if e.step == step:
            events.append(
                _complete(e.name, e.kind, MEASURED_PID + e.rank, e.row, e.start_us, e.dur_us)
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "plan": measured.plan,
            "measured_step": step,
            "predicted_step_s": comparison.predicted_step_s,
            "measured_step_s": comparison.measured_step_s,
        },
    }


def _median_step(comparison: Comparison, steps: Sequence[int]) -> int:
    if not steps:
        return 0
    target = comparison.measured_step_s
    times = comparison.measured_steps_s
    return min(zip(steps, times, strict=True), key=lambda st: (abs(st[1] - target), st[0]))[0]


def _process(pid: int, name: str) -> dict:
    return {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}


def _thread(pid: int, tid: int, name: str) -> dict:
    return {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _complete(name: str, kind: str, pid: int, tid: int, ts: float, dur: float) -> dict:
    return {"name": name, "cat": kind, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur}
