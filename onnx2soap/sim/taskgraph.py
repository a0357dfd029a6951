"""The task graph of one training step (FlexFlow §5.1), on flat arrays.

Tasks: forward and backward compute per op task, a transfer per overlap that crosses
devices (forward tile and backward gradient piece: the same rects the executor sends),
a ring all-reduce per weight replica group (link tasks following soap's ring schedule),
and an SGD update per weight shard. Resources: compute devices ``0..D-1``, then links
``D..D+L-1``; a transfer holds every link of its route.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from onnx2soap.errors import PlanError
from onnx2soap.sim.costs import CostModel
from onnx2soap.sim.machine import Machine
from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.collectives import ring_chunks, ring_steps
from onnx2soap.soap.partition import ReplicaGroup, Task, rect_volume


class TaskKind(IntEnum):
    FORWARD = 0
    BACKWARD = 1
    TRANSFER = 2
    ALLREDUCE = 3
    UPDATE = 4


@dataclass(frozen=True)
class TaskGraph:
    duration: np.ndarray  # float64 seconds
    kind: np.ndarray  # TaskKind codes
    nbytes: np.ndarray  # bytes moved (transfers and all-reduce steps), else 0
    res_ptr: np.ndarray  # CSR: resources of task i are res_idx[res_ptr[i]:res_ptr[i+1]]
    res_idx: np.ndarray
    succ_ptr: np.ndarray  # CSR: successors of task i
    succ_idx: np.ndarray
    num_preds: np.ndarray
    num_resources: int
    names: tuple[str, ...] = field(default=())  # only when built with names=True

    @property
    def size(self) -> int:
        return len(self.duration)


class _Builder:
    def __init__(self, names: bool) -> None:
        self.duration: list[float] = []
        self.kind: list[int] = []
        self.nbytes: list[int] = []
        self.resources: list[tuple[int, ...]] = []
        self.edges: list[tuple[int, int]] = []
        self.names: list[str] | None = [] if names else None

    def add(self, kind: TaskKind, duration: float, resources, nbytes: int = 0, name=None) -> int:
        self.duration.append(duration)
        self.kind.append(int(kind))
        self.nbytes.append(nbytes)
        self.resources.append(tuple(resources))
        if self.names is not None:
            self.names.append(name() if callable(name) else str(name))
        return len(self.duration) - 1

    def dep(self, a: int, b: int) -> None:
        self.edges.append((a, b))

    def build(self, num_resources: int) -> TaskGraph:
        n = len(self.duration)
        res_ptr = np.zeros(n + 1, dtype=np.int64)
        res_ptr[1:] = np.cumsum([len(r) for r in self.resources])
        res_idx = np.fromiter((x for r in self.resources for x in r), dtype=np.int64)
        edges = np.array(sorted(set(self.edges)), dtype=np.int64).reshape(-1, 2)
        succ_ptr = np.zeros(n + 1, dtype=np.int64)
        np.add.at(succ_ptr, edges[:, 0] + 1, 1)
        succ_ptr = np.cumsum(succ_ptr)
        num_preds = np.bincount(edges[:, 1], minlength=n)
        return TaskGraph(
            duration=np.array(self.duration, dtype=np.float64),
            kind=np.array(self.kind, dtype=np.int8),
            nbytes=np.array(self.nbytes, dtype=np.int64),
            res_ptr=res_ptr,
            res_idx=res_idx,
            succ_ptr=succ_ptr,
            succ_idx=edges[:, 1].copy(),
            num_preds=num_preds,
            num_resources=num_resources,
            names=tuple(self.names or ()),
        )


@dataclass
class _Context:
    pg: PartitionedGraph
    machine: Machine
    cost: CostModel
    itemsize: int
    b: _Builder
    fwd: dict[tuple[str, int], int] = field(default_factory=dict)
    bwd: dict[tuple[str, int], int] = field(default_factory=dict)

    def link_resources(self, src: int, dst: int) -> tuple[int, ...]:
        return tuple(self.machine.size + link for link in self.machine.route(src, dst))

    def transfer(self, kind: TaskKind, src: int, dst: int, nbytes: int, name) -> int:
        seconds = self.machine.transfer_time(src, dst, nbytes)
        return self.b.add(kind, seconds, self.link_resources(src, dst), nbytes, name)


def _compute_tasks(ctx: _Context) -> None:
    graph, devices = ctx.pg.graph, ctx.machine.devices
    for op in graph.ops:
        for t in ctx.pg.tasks[op.name]:
            seconds = ctx.cost.forward(op, t, devices[t.device])
            ctx.fwd[(op.name, t.index)] = ctx.b.add(
                TaskKind.FORWARD,
                seconds,
                (t.device,),
                name=lambda o=op, t=t: f"fwd {o.name}[{t.index}]",
            )
    for op in reversed(graph.ops):
        for t in ctx.pg.tasks[op.name]:
            seconds = ctx.cost.backward(op, t, devices[t.device])
            task = ctx.b.add(
                TaskKind.BACKWARD,
                seconds,
                (t.device,),
                name=lambda o=op, t=t: f"bwd {o.name}[{t.index}]",
            )
            ctx.bwd[(op.name, t.index)] = task
            ctx.b.dep(ctx.fwd[(op.name, t.index)], task)


def _edge_tasks(ctx: _Context) -> None:
    for edge in ctx.pg.edges:
        producers, consumers = ctx.pg.tasks[edge.producer], ctx.pg.tasks[edge.consumer]
        for o in edge.overlaps:
            p, c = producers[o.src_task], consumers[o.dst_task]
            pf, pb = ctx.fwd[(edge.producer, p.index)], ctx.bwd[(edge.producer, p.index)]
            cf, cb = ctx.fwd[(edge.consumer, c.index)], ctx.bwd[(edge.consumer, c.index)]
            if p.device == c.device:
                ctx.b.dep(pf, cf)
                ctx.b.dep(cb, pb)
                continue
            nbytes = rect_volume(o.rect) * ctx.itemsize
            what = f"{edge.tensor} {p.device}->{c.device}"
            x = ctx.transfer(
                TaskKind.TRANSFER, p.device, c.device, nbytes, lambda w=what: f"send {w}"
            )
            y = ctx.transfer(
                TaskKind.TRANSFER, c.device, p.device, nbytes, lambda w=what: f"grad {w}"
            )
            ctx.b.dep(pf, x)
            ctx.b.dep(x, cf)
            ctx.b.dep(cb, y)
            ctx.b.dep(y, pb)


def _ring(ctx: _Context, group: ReplicaGroup, ready: dict[int, list[int]]) -> dict[int, list[int]]:
    """Link tasks of one ring all-reduce; returns, per device, the tasks that finish it."""
    devices, k = group.devices, len(group.devices)
    chunks = ring_chunks(rect_volume(group.rect), k)
    steps = [ring_steps(i, k) for i in range(k)]
    incoming = {i: ready[devices[i]] for i in range(k)}
    for s in range(2 * (k - 1)):
        arrived = {}
        for i in range(k):
            lo, hi = chunks[steps[i][s].send_chunk]
            src, dst = devices[i], devices[(i + 1) % k]
            x = ctx.transfer(
                TaskKind.ALLREDUCE,
                src,
                dst,
                (hi - lo) * ctx.itemsize,
                lambda g=group, s=s: f"allreduce {g.weight} step {s}",
            )
            for before in incoming[i]:
                ctx.b.dep(before, x)
            arrived[(i + 1) % k] = [x]
        incoming = arrived
    return {devices[i]: incoming[i] for i in range(k)}


def _weight_tasks(ctx: _Context) -> None:
    devices = ctx.machine.devices
    for op in ctx.pg.graph.ops:
        tasks: tuple[Task, ...] = ctx.pg.tasks[op.name]
        for group in ctx.pg.groups[op.name]:
            ready: dict[int, list[int]] = {d: [] for d in group.devices}
            for i in group.tasks:
                ready[tasks[i].device].append(ctx.bwd[(op.name, i)])
            done = _ring(ctx, group, ready) if len(group.devices) > 1 else ready
            numel = rect_volume(group.rect)
            for d in group.devices:
                u = ctx.b.add(
                    TaskKind.UPDATE,
                    ctx.cost.update(numel, devices[d]),
                    (d,),
                    name=lambda g=group: f"update {g.weight}",
                )
                for before in done[d]:
                    ctx.b.dep(before, u)


def build_task_graph(
    pg: PartitionedGraph, machine: Machine, cost: CostModel, itemsize: int = 4, names: bool = False
) -> TaskGraph:
    if pg.strategy.devices > machine.size:
        raise PlanError(
            f"the plan uses {pg.strategy.devices} devices but machine '{machine.name}' has "
            f"{machine.size}"
        )
    ctx = _Context(pg, machine, cost, itemsize, _Builder(names))
    _compute_tasks(ctx)
    _edge_tasks(ctx)
    _weight_tasks(ctx)
    return ctx.b.build(machine.size + len(machine.links))
