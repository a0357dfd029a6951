"""Full simulation: every resource runs its tasks in the executor's program order.

Tasks are numbered in that order (``taskgraph.py``) and every predecessor of a task is
numbered below it, so one pass in task order is the schedule: a task starts when its
predecessors have ended and every resource it holds has ended the task before it in the
order, and holds them until it ends. The makespan is one step. ``run_task`` is the one
formula, shared with delta simulation so that both give bit-identical times.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from onnx2soap.sim.taskgraph import TaskGraph


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


def simulate(tg: TaskGraph) -> Timeline:
    n = tg.size
    duration = tg.duration.tolist()
    res_ptr, res_idx = tg.res_ptr.tolist(), tg.res_idx.tolist()
    pred_ptr, pred_idx = tg.pred_ptr.tolist(), tg.pred_idx.tolist()
    start, end = [0.0] * n, [0.0] * n
    free = [0.0] * tg.num_resources
    for i in range(n):
        # run_task's formula inlined (a call and a list per task were a third of it)
        s = 0.0
        for p in pred_idx[pred_ptr[i] : pred_ptr[i + 1]]:
            if p >= i:
                raise RuntimeError(f"task {i} waits for a task after it in program order")
            t = end[p]
            if t > s:
                s = t
        resources = res_idx[res_ptr[i] : res_ptr[i + 1]]
        for r in resources:
            t = free[r]
            if t > s:
                s = t
        e = s + duration[i]
        start[i], end[i] = s, e
        for r in resources:
            free[r] = e
    return Timeline(np.array(start), np.array(end))
