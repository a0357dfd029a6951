"""Full simulation (FlexFlow Algorithm 1): list scheduling in order of ready time.

Tasks are taken from a priority queue by (ready time, id); a task starts when it is ready
and every resource it holds is free, and holds them until it ends. Each resource thus
runs its tasks first-come first-served (assumption A3). The makespan is one step.
"""

from __future__ import annotations

import heapq
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


def simulate(tg: TaskGraph) -> Timeline:
    n = tg.size
    duration = tg.duration.tolist()
    res_ptr, res_idx = tg.res_ptr.tolist(), tg.res_idx.tolist()
    succ_ptr, succ_idx = tg.succ_ptr.tolist(), tg.succ_idx.tolist()
    waiting = tg.num_preds.tolist()
    ready = [0.0] * n
    start, end = [0.0] * n, [0.0] * n
    free = [0.0] * tg.num_resources
    queue = [(0.0, i) for i in range(n) if waiting[i] == 0]
    heapq.heapify(queue)
    done = 0
    while queue:
        t_ready, i = heapq.heappop(queue)
        resources = res_idx[res_ptr[i] : res_ptr[i + 1]]
        s = max(t_ready, *(free[r] for r in resources)) if resources else t_ready
        e = s + duration[i]
        start[i], end[i] = s, e
        for r in resources:
            free[r] = e
        done += 1
        for j in succ_idx[succ_ptr[i] : succ_ptr[i + 1]]:
            if e > ready[j]:
                ready[j] = e
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(queue, (ready[j], j))
    if done != n:
        raise RuntimeError(f"task graph has a cycle: {n - done} tasks never became ready")
    return Timeline(np.array(start), np.array(end))
