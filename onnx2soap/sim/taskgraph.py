"""The task graph of one training step (FlexFlow §5.1), on flat arrays.

Tasks: forward and backward compute per op task, a transfer per overlap that crosses
devices (forward tile and backward gradient piece: the same rects the executor sends),
a ring all-reduce per weight replica group (lock-step ring steps following soap's ring
schedule),
and an SGD update per weight shard. Resources: compute devices ``0..D-1``, then links
``D..D+L-1``; a transfer holds every link of its route (and both end devices on machines
whose cores copy messages themselves).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from onnx2soap.errors import PlanError
from onnx2soap.ir import Graph
from onnx2soap.sim.costs import CostModel
from onnx2soap.sim.machine import Machine
from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.collectives import ring_chunks, ring_steps
from onnx2soap.soap.partition import Task, rect_volume


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
class Memo:
    """Durations (and per-op memory) kept across the task graphs of one graph on one
    machine, cost model and item size, by whoever builds many of them (the search): a
    proposal changes one op, so almost everything in the next graph is already known.
    Keys are op names, so the memo binds itself to one graph and starts over for another."""

    graph: Graph | None = None
    compute: dict[tuple, tuple[tuple[float, ...], tuple[float, ...]]] = field(default_factory=dict)
    transfers: dict[tuple[int, int, int], tuple[float, tuple[int, ...]]] = field(
        default_factory=dict
    )
    rings: dict[tuple, tuple] = field(default_factory=dict)
    memory: dict[tuple, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    def bind(self, graph: Graph) -> None:
        if self.graph is not graph:
            self.graph = graph
            self.compute.clear()
            self.memory.clear()


@dataclass
class _Context:
    pg: PartitionedGraph
    machine: Machine
    cost: CostModel
    itemsize: int
    b: _Builder
    memo: Memo
    # The task that produces an op task's output (fwd) or input gradients (bwd), and the
    # one that first reads its inputs / output gradient: the same task, except for ops
    # with statistics, whose phases are a partial half, a ring, and a finishing half.
    fwd: dict[tuple[str, int], int] = field(default_factory=dict)
    bwd: dict[tuple[str, int], int] = field(default_factory=dict)
    fwd_start: dict[tuple[str, int], int] = field(default_factory=dict)
    bwd_start: dict[tuple[str, int], int] = field(default_factory=dict)

    def link_resources(self, src: int, dst: int) -> tuple[int, ...]:
        links = tuple(self.machine.size + link for link in self.machine.route(src, dst))
        return (src, dst, *links) if self.machine.transfers_use_compute else links

    def transfer(self, kind: TaskKind, src: int, dst: int, nbytes: int, name) -> int:
        key = (src, dst, nbytes)
        if key not in self.memo.transfers:
            seconds = self.machine.transfer_time(src, dst, nbytes)
            self.memo.transfers[key] = (seconds, self.link_resources(src, dst))
        seconds, resources = self.memo.transfers[key]
        return self.b.add(kind, seconds, resources, nbytes, name)

    def durations(self, op) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Forward and backward seconds of every task of ``op`` under the strategy."""
        config = self.pg.strategy[op.name]
        key = (op.name, config)
        if key not in self.memo.compute:
            devices, tasks = self.machine.devices, self.pg.tasks[op.name]
            size = self.itemsize
            self.memo.compute[key] = (
                tuple(self.cost.forward(op, t, devices[t.device], size) for t in tasks),
                tuple(self.cost.backward(op, t, devices[t.device], size) for t in tasks),
            )
        return self.memo.compute[key]


def _phase_tasks(ctx: _Context, op, kind: TaskKind, durations) -> tuple[dict, dict]:
    """(start, end) task per op task of one phase. An op with statistics runs as the
    executor does: half the work (partial sums), a ring all-reduce per stat group over
    its devices, then the other half."""
    tag = "fwd" if kind is TaskKind.FORWARD else "bwd"
    tasks = ctx.pg.tasks[op.name]
    start, end = {}, {}
    halves = 2 if op.nest.sync_dims else 1
    for t, seconds in zip(tasks, durations, strict=True):
        for half in range(halves):
            task = ctx.b.add(
                kind,
                seconds / halves,
                (t.device,),
                name=lambda o=op, t=t, h=half: (
                    f"{tag} {o.name}[{t.index}]" + " partial" * (h == 0 and halves == 2)
                ),
            )
            if half == 0:
                start[t.index] = task
            else:
                ctx.b.dep(start[t.index], task)
            end[t.index] = task
    for group in ctx.pg.stats[op.name]:
        ready: dict[int, list[int]] = {d: [] for d in group.devices}
        for i in group.tasks:
            ready[tasks[i].device].append(start[i])
        what = f"stats {op.name} {tag}"
        numel = group.numel[0 if kind is TaskKind.FORWARD else 1]
        if len(group.devices) > 1:
            finished = _ring(ctx, group.devices, numel, ready, what)
        else:
            finished = [x for r in ready.values() for x in r]
        for i in group.tasks:
            for before in finished:
                ctx.b.dep(before, end[i])
    if op.nest.partial_dims:
        _partial_sums(ctx, op, kind, start, end)
    return start, end


def _partial_sums(ctx: _Context, op, kind: TaskKind, start: dict, end: dict) -> None:
    """An op with partial sums, as the executor runs it. Forward: each group's partial
    tiles are all-reduced once computed, and the owner's tile is ready after that ring.
    Backward: the owner receives the tile's gradient (a gate of no duration), a ring
    shares it, and every task computes after it."""
    tasks = ctx.pg.tasks[op.name]
    forward = kind is TaskKind.FORWARD
    for group in ctx.pg.sums[op.name]:
        owner = tasks[group.owner]
        gate = ctx.b.add(kind, 0.0, (owner.device,), name=lambda o=op: f"sum {o.name}")
        ready: dict[int, list[int]] = {d: [] for d in group.devices}
        if forward:
            for i in group.tasks:
                ready[tasks[i].device].append(end[i])
        else:
            ready[owner.device].append(gate)
        what = f"partial sums {op.name} {'fwd' if forward else 'bwd'}"
        if len(group.devices) > 1:
            finished = _ring(ctx, group.devices, group.numel, ready, what)
        else:
            finished = [x for r in ready.values() for x in r]
        if forward:  # the owner's tile: after the ring
            for before in finished:
                ctx.b.dep(before, gate)
            end[group.owner] = gate
        else:  # every task computes once the gradient is shared
            for i in group.tasks:
                for before in finished:
                    if before != start[i]:
                        ctx.b.dep(before, start[i])
            start[group.owner] = gate


def _compute_tasks(ctx: _Context) -> None:
    graph = ctx.pg.graph
    for op in graph.ops:
        forward, _ = ctx.durations(op)
        start, end = _phase_tasks(ctx, op, TaskKind.FORWARD, forward)
        for i in start:
            ctx.fwd_start[(op.name, i)], ctx.fwd[(op.name, i)] = start[i], end[i]
    for op in reversed(graph.ops):
        _, backward = ctx.durations(op)
        if not graph.differentiable(op.output):  # ids: the executor runs no backward
            backward = tuple(0.0 for _ in backward)
        start, end = _phase_tasks(ctx, op, TaskKind.BACKWARD, backward)
        for i in start:
            ctx.bwd_start[(op.name, i)], ctx.bwd[(op.name, i)] = start[i], end[i]
            ctx.b.dep(ctx.fwd[(op.name, i)], start[i])


def _edge_tasks(ctx: _Context) -> None:
    for edge, o, p, c in ctx.pg.moves():
        pf, pb = ctx.fwd[(edge.producer, p.index)], ctx.bwd_start[(edge.producer, p.index)]
        cf, cb = ctx.fwd_start[(edge.consumer, c.index)], ctx.bwd[(edge.consumer, c.index)]
        if p.device == c.device:
            ctx.b.dep(pf, cf)
            ctx.b.dep(cb, pb)
            continue
        graph = ctx.pg.graph
        tensor = graph.tensors[edge.tensor]
        width = ctx.itemsize if tensor.dtype.is_float else tensor.dtype.itemsize
        nbytes = o.volume * width
        what = f"{edge.tensor} {p.device}->{c.device}"
        x = ctx.transfer(TaskKind.TRANSFER, p.device, c.device, nbytes, lambda w=what: f"send {w}")
        ctx.b.dep(pf, x)
        ctx.b.dep(x, cf)
        if not graph.differentiable(edge.tensor):
            continue  # ids send no gradient back
        y = ctx.transfer(TaskKind.TRANSFER, c.device, p.device, nbytes, lambda w=what: f"grad {w}")
        ctx.b.dep(cb, y)
        ctx.b.dep(y, pb)


def _ring_steps(ctx: _Context, devices: tuple[int, ...], numel: int) -> tuple:
    """(seconds, links, bytes) of each lock-step step of a ring all-reduce."""
    key = (devices, numel)
    if key not in ctx.memo.rings:
        k = len(devices)
        chunks = ring_chunks(numel, k)
        steps = [ring_steps(i, k) for i in range(k)]
        hops = [(devices[i], devices[(i + 1) % k]) for i in range(k)]
        links = tuple(sorted({r for src, dst in hops for r in ctx.link_resources(src, dst)}))
        out = []
        for s in range(2 * (k - 1)):
            sizes = []
            for i in range(k):
                lo, hi = chunks[steps[i][s].send_chunk]
                sizes.append((hi - lo) * ctx.itemsize)
            seconds = max(
                ctx.machine.transfer_time(a, b, n) for (a, b), n in zip(hops, sizes, strict=True)
            )
            out.append((seconds, links, sum(sizes)))
        ctx.memo.rings[key] = tuple(out)
    return ctx.memo.rings[key]


def _ring(
    ctx: _Context, devices: tuple[int, ...], numel: int, ready: dict[int, list[int]], what: str
) -> list[int]:
    """A ring all-reduce as 2(k-1) lock-step steps (as NCCL runs it): in each step every
    member sends one chunk to the next, so the step holds every link of the ring and lasts
    as long as its slowest send. Returns the task that finishes it."""
    previous = [t for d in devices for t in ready[d]]
    for s, (seconds, links, nbytes) in enumerate(_ring_steps(ctx, devices, numel)):
        step = ctx.b.add(
            TaskKind.ALLREDUCE,
            seconds,
            links,
            nbytes,
            name=lambda s=s: f"allreduce {what} step {s}",
        )
        for before in previous:
            ctx.b.dep(before, step)
        previous = [step]
    return previous


def _weight_tasks(ctx: _Context) -> None:
    devices = ctx.machine.devices
    for op in ctx.pg.graph.ops:
        tasks: tuple[Task, ...] = ctx.pg.tasks[op.name]
        for group in ctx.pg.groups[op.name]:
            if not group.trainable:
                continue  # state: updated by the forward, no gradient to sum or apply
            ready: dict[int, list[int]] = {d: [] for d in group.devices}
            for i in group.tasks:
                ready[tasks[i].device].append(ctx.bwd[(op.name, i)])
            numel = rect_volume(group.rect)
            if len(group.devices) > 1:
                finished = _ring(ctx, group.devices, numel, ready, group.weight)
            else:
                finished = None
            for d in group.devices:
                u = ctx.b.add(
                    TaskKind.UPDATE,
                    ctx.cost.update(numel, devices[d], ctx.itemsize),
                    (d,),
                    name=lambda g=group: f"update {g.weight}",
                )
                for before in finished or ready[d]:
                    ctx.b.dep(before, u)


def build_task_graph(
    pg: PartitionedGraph,
    machine: Machine,
    cost: CostModel,
    itemsize: int = 4,
    names: bool = False,
    memo: Memo | None = None,
) -> TaskGraph:
    if pg.strategy.devices > machine.size:
        raise PlanError(
            f"the plan uses {pg.strategy.devices} devices but machine '{machine.name}' has "
            f"{machine.size}"
        )
    memo = memo or Memo()
    memo.bind(pg.graph)
    ctx = _Context(pg, machine, cost, itemsize, _Builder(names), memo)
    _compute_tasks(ctx)
    _edge_tasks(ctx)
    _weight_tasks(ctx)
    return ctx.b.build(machine.size + len(machine.links))
