"""Chrome/Perfetto trace (JSON array of complete events) of a simulated timeline."""

from __future__ import annotations

import json
from pathlib import Path

from onnx2soap.files import write_atomic
from onnx2soap.sim.machine import Machine
from onnx2soap.sim.simulate import Timeline
from onnx2soap.sim.taskgraph import TaskGraph, TaskKind


def trace_events(tg: TaskGraph, timeline: Timeline, machine: Machine) -> list[dict]:
    if not tg.names:
        raise ValueError("build the task graph with names=True to trace it")
    rows = [machine.resource_name(r) for r in range(machine.resources)]
    events = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": name}}
        for r, name in enumerate(rows)
    ]
    for i in range(tg.size):
        for r in tg.res_idx[tg.res_ptr[i] : tg.res_ptr[i + 1]]:
            events.append(
                {
                    "name": tg.names[i],
                    "cat": TaskKind(int(tg.kind[i])).name.lower(),
                    "ph": "X",
                    "pid": 0,
                    "tid": int(r),
                    "ts": float(timeline.start[i]) * 1e6,
                    "dur": float(tg.duration[i]) * 1e6,
                    "args": {"bytes": int(tg.nbytes[i])} if tg.nbytes[i] else {},
                }
            )
    return events


def write_trace(path: Path, tg: TaskGraph, timeline: Timeline, machine: Machine) -> None:
    write_atomic(Path(path), json.dumps(trace_events(tg, timeline, machine)))
