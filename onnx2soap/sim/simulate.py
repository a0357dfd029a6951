"""Full simulation: every resource runs its tasks in the executor's program order.

Tasks are numbered in that order (``taskgraph.py``) and every predecessor of a task is
numbered below it, so one pass in task order is the schedule: a task starts when its
predecessors have ended and every resource it holds has ended the task before it in the
order, and holds them until it ends. The makespan is one step. ``run_task`` is the one
formula, shared with delta simulation so that both give bit-identical times; on machines
with a resume cost (``Machine.resume``), ``Wakes`` adds it to a task's end, the same way
in both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from onnx2soap.sim.machine import Resume
from onnx2soap.sim.taskgraph import TaskGraph, TaskKind

COMPUTE = frozenset({int(TaskKind.FORWARD), int(TaskKind.BACKWARD), int(TaskKind.UPDATE)})


@dataclass(frozen=True)
class Timeline:
    start: np.ndarray
    end: np.ndarray

    @property
    def makespan(self) -> float:
        return float(self.end.max()) if len(self.end) else 0.0


def run_task(ready: Iterable[float], resources: Iterable[int], free: list[float]) -> float:
    """Start time: the latest of the predecessors' ends and the resources' last ends."""
    s = 0.0
    for t in ready:
        if t > s:
            s = t
    for r in resources:
        if free[r] > s:
            s = free[r]
    return s


class Wakes:
    """What each device owes for having slept through its last wait, over one pass in
    program order (``Machine.resume``).

    A device waited when a task that holds it could not start, for its predecessors
    (its inputs, a message, a ring's other members), until more than ``resume.after``
    after the device's last task ended: the rank slept, and owes ``resume.cost`` (what
    it owed before is forgotten). Its next compute tasks pay it, each at most
    ``resume.slowdown`` times its own duration: a rank that runs a stage after a
    hand-off pays it all, one that runs a small op between messages a little each
    time. A wait for a shared core is not a sleep: the rank is runnable, and the
    simulator's turns on a core stand for the operating system's longer time slices."""

    __slots__ = ("after", "cost", "devices", "owed", "slowdown")

    def __init__(self, resume: Resume, devices: int, owed: tuple[float, ...] = ()) -> None:
        self.after, self.cost, self.slowdown = resume.after, resume.cost, resume.slowdown
        self.devices = devices
        self.owed = list(owed) if owed else [0.0] * devices

    def extra(self, ready: float, kind: int, seconds: float, resources, free) -> float:
        """The seconds a task of ``seconds`` that may start at ``ready`` for its
        predecessors adds for a resume (call before ``free`` takes its end)."""
        owed = self.owed
        for r in resources:
            if r < self.devices and ready - free[r] > self.after:
                owed[r] = self.cost
        if kind in COMPUTE and (due := owed[resources[0]]) > 0:
            paid = min(due, self.slowdown * seconds)
            owed[resources[0]] = due - paid
            return paid
        return 0.0

    def saved(self) -> tuple[float, ...]:
        return tuple(self.owed)


def wakes_of(tg: TaskGraph) -> Wakes | None:
    return None if tg.resume is None else Wakes(tg.resume, tg.devices)


def simulate(tg: TaskGraph) -> Timeline:
    n = tg.size
    duration = tg.duration.tolist()
    res_ptr, res_idx = tg.res_ptr.tolist(), tg.res_idx.tolist()
    pred_ptr, pred_idx = tg.pred_ptr.tolist(), tg.pred_idx.tolist()
    start, end = [0.0] * n, [0.0] * n
    free = [0.0] * tg.num_resources
    wakes, kind = wakes_of(tg), tg.kind.tolist()
    for i in range(n):
        # run_task's formula inlined (a call and a list per task were a third of it)
        s = 0.0
        for p in pred_idx[pred_ptr[i] : pred_ptr[i + 1]]:
            if p >= i:
                raise RuntimeError(f"task {i} waits for a task after it in program order")
            t = end[p]
            if t > s:
                s = t
        ready = s
        resources = res_idx[res_ptr[i] : res_ptr[i + 1]]
        for r in resources:
            t = free[r]
            if t > s:
                s = t
        e = s + duration[i]
        if wakes is not None and (x := wakes.extra(ready, kind[i], duration[i], resources, free)):
            e += x
        start[i], end[i] = s, e
        for r in resources:
            free[r] = e
    return Timeline(np.array(start), np.array(end))
