"""Full simulation: every resource runs its tasks in the executor's program order.

Tasks are numbered in that order (``taskgraph.py``) and every predecessor of a task is
numbered below it, so one pass in task order is the schedule: a task starts when its
predecessors have ended and every resource it holds has ended the task before it in the
order, and holds them until it ends. The makespan is one step. ``run_task`` is the one
formula, shared with delta simulation so that both give bit-identical times; on machines
with a resume cost (``Machine.resume``) or a cooling (``Machine.cooling``), ``Wakes``
adds it to a task's end, the same way in both.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from onnx2soap.sim.machine import Cooling, Resume
from onnx2soap.sim.taskgraph import TaskGraph, TaskKind

COMPUTE = frozenset({int(TaskKind.FORWARD), int(TaskKind.BACKWARD), int(TaskKind.UPDATE)})
COMMUNICATION = frozenset({int(TaskKind.TRANSFER), int(TaskKind.ALLREDUCE)})


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
    """What each device owes for having slept through its last wait, and how long each
    has been silent, over one pass in program order (``Machine.resume``,
    ``Machine.cooling``).

    A device waited when a task that holds it could not start, for its predecessors
    (its inputs, a message, a ring's other members), until more than ``resume.after``
    after the device's last task ended: the rank slept, and owes ``resume.cost`` (what
    it owed before is forgotten). Its next compute tasks pay it, each at most
    ``resume.slowdown`` times its own duration: a rank that runs a stage after a
    hand-off pays it all, one that runs a small op between messages a little each
    time. A wait for a shared core is not a sleep: the rank is runnable, and the
    simulator's turns on a core stand for the operating system's longer time slices.

    A communication task (a message, a ring) that starts ``gap`` seconds after the last
    one that held any of its devices ended costs ``cooling.cost · (1 - exp(-gap /
    cooling.after))`` more: the longest silence among its ends, since the one that
    comes last to it is the one that keeps the others waiting."""

    __slots__ = ("cooling", "devices", "heard", "owed", "resume")

    def __init__(
        self,
        resume: Resume | None,
        devices: int,
        saved: tuple[float, ...] = (),
        cooling: Cooling | None = None,
    ) -> None:
        """``saved``: a pass's state where it stopped (``saved``), to go on from."""
        self.resume, self.cooling, self.devices = resume, cooling, devices
        state = list(saved) if saved else [0.0] * (2 * devices)
        self.owed, self.heard = state[:devices], state[devices:]

    def extra(self, ready: float, kind: int, seconds: float, resources, free) -> float:
        """The seconds a task of ``seconds`` that may start at ``ready`` for its
        predecessors adds for a resume or a cooling (call before ``free`` takes its
        end)."""
        x = 0.0 if self.resume is None else self._resume(ready, kind, seconds, resources, free)
        if self.cooling is not None and kind in COMMUNICATION:
            x += self._cool(ready, seconds, resources, free)
        return x

    def _resume(self, ready: float, kind: int, seconds: float, resources, free) -> float:
        resume, owed = self.resume, self.owed
        for r in resources:
            if r < self.devices and ready - free[r] > resume.after:
                owed[r] = resume.cost
        if kind in COMPUTE and (due := owed[resources[0]]) > 0:
            paid = min(due, resume.slowdown * seconds)
            owed[resources[0]] = due - paid
            return paid
        return 0.0

    def _cool(self, ready: float, seconds: float, resources, free) -> float:
        ends = [r for r in resources if r < self.devices]
        if not ends:  # a message that holds only links (copy engines): nothing cools
            return 0.0
        start = max(ready, max(free[r] for r in resources))
        gap = start - min(self.heard[r] for r in ends)
        x = self.cooling.cost * -math.expm1(-gap / self.cooling.after)
        for r in ends:
            self.heard[r] = start + seconds + x
        return x

    def saved(self) -> tuple[float, ...]:
        return (*self.owed, *self.heard)


def wakes_of(tg: TaskGraph) -> Wakes | None:
    if tg.resume is None and tg.cooling is None:
        return None
    return Wakes(tg.resume, tg.devices, cooling=tg.cooling)


@dataclass(frozen=True)
class Chunk:
    """Tasks ``first`` on of a task graph, as lists: its task ``j`` (the graph's ``first
    + j``) holds ``res_idx[res_ptr[j] : res_ptr[j + 1]]`` and waits for the graph's tasks
    ``pred_idx[pred_ptr[j] : pred_ptr[j + 1]]``."""

    first: int
    duration: list[float]
    kind: list[int]
    res_ptr: list[int]
    res_idx: list[int]
    pred_ptr: list[int]
    pred_idx: list[int]


# Tasks made into lists at a time: a pass reads its numbers from lists (an element read
# from a numpy array is an object made per read), but LLaMA-3-8B's 4.5 M tasks on 128
# GPUs were 1.4 GB as lists of the whole graph
CHUNK = 1 << 16


def chunks(tg: TaskGraph, size: int = CHUNK) -> Iterator[Chunk]:
    """The graph's tasks in program order, ``size`` at a time."""
    for a in range(0, tg.size, size):
        b = min(a + size, tg.size)
        r0, r1 = int(tg.res_ptr[a]), int(tg.res_ptr[b])
        p0, p1 = int(tg.pred_ptr[a]), int(tg.pred_ptr[b])
        yield Chunk(
            a,
            tg.duration[a:b].tolist(),
            tg.kind[a:b].tolist(),
            (tg.res_ptr[a : b + 1] - r0).tolist(),
            tg.res_idx[r0:r1].tolist(),
            (tg.pred_ptr[a : b + 1] - p0).tolist(),
            tg.pred_idx[p0:p1].tolist(),
        )


def simulate(tg: TaskGraph) -> Timeline:
    # start and end times as 8-byte doubles, not a float object each
    start, end = array("d", bytes(8 * tg.size)), array("d", bytes(8 * tg.size))
    free = [0.0] * tg.num_resources
    wakes = wakes_of(tg)
    for c in chunks(tg, CHUNK):
        duration, kind, res_ptr, res_idx = c.duration, c.kind, c.res_ptr, c.res_idx
        pred_ptr, pred_idx = c.pred_ptr, c.pred_idx
        i = c.first
        for j in range(len(duration)):
            # run_task's formula inlined (a call and a list per task were a third of it)
            s = 0.0
            for p in pred_idx[pred_ptr[j] : pred_ptr[j + 1]]:
                if p >= i:
                    raise RuntimeError(f"task {i} waits for a task after it in program order")
                t = end[p]
                if t > s:
                    s = t
            ready = s
            resources = res_idx[res_ptr[j] : res_ptr[j + 1]]
            for r in resources:
                t = free[r]
                if t > s:
                    s = t
            e = s + duration[j]
            if wakes is not None and (
                x := wakes.extra(ready, kind[j], duration[j], resources, free)
            ):
                e += x
            start[i], end[i] = s, e
            for r in resources:
                free[r] = e
            i += 1
    return Timeline(np.frombuffer(start), np.frombuffer(end))
