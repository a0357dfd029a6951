"""The task graph of one training step (FlexFlow §5.1), in the executor's program order.

Tasks: forward and backward compute per op task, a transfer per overlap that crosses
devices (forward tile and backward gradient piece: the same rects the executor sends),
a ring all-reduce per gradient bucket and set of replica devices (soap/buckets.py: the
bucket's gradients replicated over those devices as one run; soap's ring schedule: its
2(k-1) lock-step steps run back to back on every ring link, so the ring is one task of
their summed duration, each step at ``Machine.ring_step_latency`` where the machine has
it) and an SGD update per weight shard. On machines whose cores copy messages (CPU ranks), the
runtime's assembly copies too: a tile the consumer cannot read in place
(``executor/layout.py``: anything but one whole local tile) is copied into its input
buffer, and a gradient piece summed into the producer's output gradient: a copy task on
the device that assembles, after the piece is made (a local one) or after the part of
its transfer that holds both ends (a received one: the sender does not wait for the
receiver's copy); a strided tile or piece is staged (copied) by its sender before its
transfer. Resources: compute devices ``0..D-1``, then links ``D..D+L-1``, then the
cores ranks share where they outnumber the host's (``Machine.cores``); a transfer
holds every link of its route (and both end devices on machines whose cores copy
messages themselves; where ranks nap, ``message_busy`` of its latency, the rest an "in
flight" delay that holds nothing), and a task that holds a device also holds the core
that device shares, if any.

Tasks are numbered in the executor's global order (``executor/program.py``): forward
ops in graph order, each op's tasks in task order (an op with statistics: every partial
half, the statistics rings, every finishing half, a run of independent ones together,
``soap/stats_batches.py``; an op with partial sums: the tasks, then the sums); an op's
outgoing transfers right after it, edge by edge; backward in reverse graph order (ops
whose output takes no gradient run none), each op's gradient transfers and then the
rings of the buckets whose last gradient it makes (their reduce-scatters of ZeRO's
sharded groups first); the updates last. Every resource runs its tasks in that order
(``simulate.py``).

The graph is built as *slots*, one per (phase, op) or (phase, edge), fixed by the graph
alone, each holding a ``Segment`` that depends only on the configs of the op or of the
edge's two ops; an op's weight and update slots, on those of its bucket's ops; the
slots of a run of ops with statistics (``Layout.runs``) and of their edges and buckets,
on every member's. A proposal that changes one op's config changes only the slots of
that op (its run's), its edges and its bucket: ``delta.py`` rebuilds those and splices
them in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property

import numpy as np

from onnx2soap.errors import PlanError
from onnx2soap.ir import Graph, Op
from onnx2soap.ops import definition
from onnx2soap.sim.collectives import Collective, collective_time, group_shape
from onnx2soap.sim.costs import CostModel
from onnx2soap.sim.machine import Cooling, Machine, Resume
from onnx2soap.sim.slot_arrays import Feeds, Refs, Sources, merged, refs_of
from onnx2soap.soap import Edge, ParallelConfig, PartitionedGraph
from onnx2soap.soap.buckets import (
    DEFAULT_BUCKET_MB,
    BucketRing,
    Buckets,
    BucketScatter,
    bucket_rings,
    bucket_scatters,
    gradient_buckets,
)
from onnx2soap.soap.collectives import (
    HostRings,
    RingStep,
    all_gather_steps,
    host_rings,
    reduce_scatter_steps,
    ring_chunks,
    ring_steps,
    takes_two_levels,
)
from onnx2soap.soap.partition import (
    Interval,
    ReplicaGroup,
    StatGroup,
    SumGroup,
    Task,
    rect_contiguous,
    rect_volume,
)
from onnx2soap.soap.partitioned import edge_configs, op_kinds_held
from onnx2soap.soap.recompute import recomputes
from onnx2soap.soap.saved import backward_reads
from onnx2soap.soap.stats_batches import stats_rings, stats_runs
from onnx2soap.soap.streamed import KeyBlock, key_blocks, span_of
from onnx2soap.soap.zero import NO_ZERO, Zero, ZeroStage, group_stage, zero_group

Ref = tuple[int, int]  # (slot, task index in the slot's segment)


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
    nbytes: np.ndarray  # bytes moved (transfers and all-reduces), else 0
    res_ptr: np.ndarray  # CSR: resources of task i are res_idx[res_ptr[i]:res_ptr[i+1]]
    res_idx: np.ndarray
    pred_ptr: np.ndarray  # CSR: predecessors of task i, all numbered below i
    pred_idx: np.ndarray
    num_resources: int
    names: tuple[str, ...] = field(default=())  # only when built with names=True
    # The machine's resume cost and cooling (``simulate.Wakes``) and its devices
    # (resources 0..D-1)
    resume: Resume | None = None
    cooling: Cooling | None = None
    devices: int = 0
    turns: tuple[int, ...] | None = None  # per device, its shared core's resource
    cores_copy: bool = False  # ``Machine.transfers_use_compute``

    @property
    def size(self) -> int:
        return len(self.duration)


@dataclass(frozen=True)
class Chains:
    """A streamed op's forward (``soap/streamed.py``, ring attention): each task a chain
    of per-block tasks, each waiting only for its own block's pieces. ``tasks``: per op
    task, (its block's task in the segment, the block's key spans) in the order taken
    (empty for a task that takes its operands whole); ``operands`` the streamed ones,
    their keys along ``axis``."""

    operands: tuple[int, ...]
    axis: int
    tasks: tuple[tuple[tuple[int, tuple[Interval, ...]], ...], ...]

    def step(self, task: int, operand: int, rect) -> int:
        """Which block of the task's chain a piece ``rect`` of ``operand`` feeds (the
        first holding any of its keys); 0 where the task takes it whole."""
        chain = self.tasks[task] if operand in self.operands else ()
        return span_of([spans for _, spans in chain], rect[self.axis]) if chain else 0

    def target(self, task: int, operand: int, rect) -> int | None:
        """The block task that a piece ``rect`` of ``operand`` feeds; None where the
        task's first task reads it (it takes the operand whole)."""
        chain = self.tasks[task] if operand in self.operands else ()
        return chain[self.step(task, operand, rect)][0] if chain else None


@dataclass(frozen=True)
class Segment:
    """The tasks of one slot, in program order. ``preds`` name earlier tasks (of this or
    earlier slots). A compute slot says which of its tasks first reads an op task's inputs
    (``starts``) and which produces its output (``ends``), and for a streamed op which
    reads each block of its streamed operands (``chains``); an edge slot adds ``feeds``:
    (task in the target slot, predecessor) pairs, the edge's data arriving."""

    duration: tuple[float, ...] = ()
    kind: tuple[int, ...] = ()
    nbytes: tuple[int, ...] = ()
    resources: tuple[tuple[int, ...], ...] = ()
    preds: tuple[tuple[Ref, ...], ...] = ()
    names: tuple[str, ...] = ()
    starts: tuple[int, ...] = ()
    ends: tuple[int, ...] = ()
    feeds: tuple[tuple[int, Ref], ...] = ()
    chains: Chains | None = None


EMPTY = Segment()


class _SegmentBuilder:
    def __init__(self, slot: int, names: bool, turns: tuple[int, ...] | None = None) -> None:
        """``turns``: per device, the resource of the core it shares (``Costs.turns``)."""
        self.slot, self.turns = slot, turns
        self.duration: list[float] = []
        self.kind: list[int] = []
        self.nbytes: list[int] = []
        self.resources: list[tuple[int, ...]] = []
        self.preds: list[tuple[Ref, ...]] = []
        # one tuple per distinct list of predecessors: the transfers of an edge between
        # splits read the same few producer tasks (an all-to-all on 128 devices: 16,384
        # tasks, 128 distinct lists), and millions of copies were most of a plan's memory
        self._interned: dict[tuple[Ref, ...], tuple[Ref, ...]] = {}
        self.names: list[str] | None = [] if names else None

    def add(self, kind: TaskKind, seconds: float, resources, preds, nbytes=0, name=None) -> Ref:
        self.duration.append(seconds)
        self.kind.append(int(kind))
        self.nbytes.append(nbytes)
        if self.turns is not None:  # a device's work also holds the core it shares
            turns = self.turns
            cores = dict.fromkeys(turns[r] for r in resources if r < len(turns))
            resources = (*resources, *cores)
        self.resources.append(tuple(resources))
        preds = tuple(preds)
        self.preds.append(self._interned.setdefault(preds, preds))
        if self.names is not None:
            self.names.append(name() if callable(name) else str(name))
        return (self.slot, len(self.duration) - 1)

    def segment(self, starts=(), ends=(), feeds=(), chains=None) -> Segment:
        return Segment(
            tuple(self.duration),
            tuple(self.kind),
            tuple(self.nbytes),
            tuple(self.resources),
            tuple(self.preds),
            tuple(self.names or ()),
            tuple(starts),
            tuple(ends),
            tuple(feeds),
            chains,
        )


@dataclass
class Memo:
    """Durations (and per-op memory) kept across the task graphs of one graph on one
    machine, cost model and item size, by whoever builds many of them (the search): a
    proposal changes one op, so almost everything in the next graph is already known.
    Keys are op names, so the memo binds itself to one graph and starts over for another."""

    graph: Graph | None = None
    compute: dict[tuple, tuple[tuple[float, ...], tuple[float, ...]]] = field(default_factory=dict)
    rings: dict[tuple, tuple[float, tuple[int, ...], int]] = field(default_factory=dict)
    # (src, dst) -> (summed latency, slowest bandwidth, resources, latency the devices are
    # free): a transfer of any size
    routes: dict[tuple[int, int], tuple[float, float, tuple[int, ...], float]] = field(
        default_factory=dict
    )
    memory: dict[tuple, object] = field(default_factory=dict)  # sim.memory.OpMemory
    # devices -> (collectives.GroupShape, links between them): a GPU group's collectives
    # of any size (reading the routes of every member pair is O(k^2))
    groups: dict[tuple[int, ...], tuple] = field(default_factory=dict)
    # tensor -> how many operands read it: asked per edge, counted once per graph (a
    # count per edge was a fifth to a third of planning a LLaMA shape over 64 GPUs)
    readers: Counter = field(default_factory=Counter)
    # (op name, config) -> per task, its key blocks (``soap/streamed.py``)
    blocks: dict[tuple, tuple[tuple[KeyBlock, ...], ...]] = field(default_factory=dict)

    def bind(self, graph: Graph) -> None:
        if self.graph is not graph:
            self.graph = graph
            self.compute.clear()
            self.memory.clear()
            self.blocks.clear()
            self.readers = Counter(t for op in graph.ops for t in op.inputs)

    def sharing(self) -> Memo:
        """A memo of the same graph that shares this one's durations and collectives'
        times (they depend on no ZeRO stage and no recomputation) and keeps per-op
        memory of its own (which does)."""
        return Memo(
            graph=self.graph,
            compute=self.compute,
            rings=self.rings,
            routes=self.routes,
            groups=self.groups,
            readers=self.readers,
            blocks=self.blocks,
        )

    def forget(self) -> None:
        """Let go of everything memoized, for whoever is done with this memo's plans."""
        self.graph = None
        memos = (self.compute, self.rings, self.routes, self.memory, self.groups, self.blocks)
        for memo in memos:
            memo.clear()
        self.readers = Counter()


@dataclass(frozen=True)
class Layout:
    """The slots of a graph, in program order. Edge ``j`` is the ``j``-th edge of every
    ``PartitionedGraph`` of the graph (edges come in consumer, then operand order)."""

    forward: tuple[int, ...]  # per op
    backward: tuple[int, ...]
    weights: tuple[int, ...]
    updates: tuple[int, ...]
    edge_forward: tuple[int, ...]  # per edge
    edge_backward: tuple[int, ...]
    edges: tuple[tuple[int, int, int], ...]  # per edge: (producer, consumer, operand)
    outs: tuple[tuple[int, ...], ...]  # per op: its outgoing edges, in edge order
    ins: tuple[tuple[int, ...], ...]  # per op: its incoming edges, in operand order
    size: int
    # Per op with statistics in a run of two or more (``soap/stats_batches.py``), the
    # run: its members' partial halves and the rings are in the slot of the run's first
    # op in the phase (its *host*: the first member's forward slot, the last member's
    # backward slot), each member's finishing half in its own slot.
    runs: Mapping[int, tuple[int, ...]] = field(default_factory=dict, compare=False)

    def of_op(self, i: int) -> tuple[int, ...]:
        return (self.forward[i], self.backward[i], self.weights[i], self.updates[i])

    def forward_host(self, i: int) -> int:
        """The op whose forward slot holds op ``i``'s first tasks (where its incoming
        edges' tiles arrive): its run's first member, else itself."""
        run = self.runs.get(i)
        return i if run is None else run[0]

    def backward_host(self, i: int) -> int:
        """The op whose backward slot holds op ``i``'s first backward tasks: its run's
        last member (the first the backward reaches), else itself."""
        run = self.runs.get(i)
        return i if run is None else run[-1]

    def fed_forward(self, i: int) -> tuple[int, ...]:
        """The edges whose tiles arrive in op ``i``'s forward slot: a run host's are
        every member's incoming edges."""
        if i not in self.runs:
            return self.ins[i]
        run = self.runs[i]
        return tuple(j for m in run for j in self.ins[m]) if i == run[0] else ()

    def fed_backward(self, i: int) -> tuple[int, ...]:
        """The edges whose gradient pieces arrive in op ``i``'s backward slot."""
        if i not in self.runs:
            return self.outs[i]
        run = self.runs[i]
        return tuple(j for m in run[::-1] for j in self.outs[m]) if i == run[-1] else ()


def graph_edges(graph: Graph) -> tuple[tuple[int, int, int], ...]:
    """(producer, consumer, operand) per edge, in ``Partitioner.partition``'s order."""
    producer = {op.output: i for i, op in enumerate(graph.ops)}
    return tuple(
        (producer[t], c, k)
        for c, op in enumerate(graph.ops)
        for k, t in enumerate(op.inputs)
        if t in producer
    )


def layout(graph: Graph) -> Layout:
    edges = graph_edges(graph)
    n = len(graph.ops)
    outs: list[list[int]] = [[] for _ in range(n)]
    ins: list[list[int]] = [[] for _ in range(n)]
    for j, (p, c, _) in enumerate(edges):
        outs[p].append(j)
        ins[c].append(j)
    slot = iter(range(1 << 62))
    fwd, bwd, wts, upd = [0] * n, [0] * n, [0] * n, [0] * n
    ef, eb = [0] * len(edges), [0] * len(edges)
    for i in range(n):
        fwd[i] = next(slot)
        for j in outs[i]:
            ef[j] = next(slot)
    for i in reversed(range(n)):
        bwd[i] = next(slot)
        for j in ins[i]:
            eb[j] = next(slot)
        wts[i] = next(slot)
    for i in range(n):
        upd[i] = next(slot)
    return Layout(
        *(tuple(x) for x in (fwd, bwd, wts, upd, ef, eb)),
        edges=edges,
        outs=tuple(map(tuple, outs)),
        ins=tuple(map(tuple, ins)),
        size=next(slot),
        runs={i: run for run in stats_runs(graph) if len(run) > 1 for i in run},
    )


@dataclass(frozen=True)
class OpParts:
    """What the partition math says about one op under one config."""

    op: Op
    config: ParallelConfig
    tasks: tuple[Task, ...]
    groups: tuple[ReplicaGroup, ...]
    stats: tuple[StatGroup, ...]
    sums: tuple[SumGroup, ...]


def op_parts(pg: PartitionedGraph, op: Op) -> OpParts:
    name = op.name
    return OpParts(
        op, pg.strategy[name], pg.tasks[name], pg.groups[name], pg.stats[name], pg.sums[name]
    )


@dataclass
class Costs:
    """Durations and resources of tasks, memoized in ``memo``."""

    machine: Machine
    cost: CostModel
    itemsize: int
    memo: Memo
    zero: Zero = NO_ZERO  # the plan's: sharded groups' rings and updates
    # the plan's recomputed ops: their backward first runs their forward again
    recompute: frozenset[str] = frozenset()
    # Bytes an element of what the executor stores and sends between kernels: mixed
    # precision's 2 (activations, their gradients, ZeRO-3's gathered weights); None:
    # ``itemsize``. Weight gradients and partial sums stay ``itemsize``.
    stored_itemsize: int | None = None
    # gradient buckets' MiB (soap/buckets.py): the weight ops whose gradients are summed
    # together, by a ring per device set
    bucket_mb: float = DEFAULT_BUCKET_MB

    @property
    def stored(self) -> int:
        return self.itemsize if self.stored_itemsize is None else self.stored_itemsize

    def edge_width(self, tensor: str) -> int:
        """Bytes an element of a tensor's pieces sent from producer to consumer (and
        of its gradient's, sent back): the stored format for what trains (the executor's
        ``Runtime.storage_of``); ids, labels and masks as they are."""
        t = self.memo.graph.tensors[tensor]
        if not t.dtype.is_float:
            return t.dtype.itemsize
        return self.stored if self.memo.graph.differentiable(tensor) else self.itemsize

    @cached_property
    def turns(self) -> tuple[int, ...] | None:
        """Where ranks share cores, per device the resource of its core, which its work
        holds besides the device (``Machine.core``); None where no core is shared."""
        m = self.machine
        return tuple(m.core(d) for d in range(m.size)) if m.shares_cores else None

    def link_resources(self, src: int, dst: int) -> tuple[int, ...]:
        links = tuple(self.machine.size + link for link in self.machine.route(src, dst))
        return (src, dst, *links) if self.machine.transfers_use_compute else links

    def _route(self, src: int, dst: int) -> tuple[float, float, tuple[int, ...], float]:
        """What a transfer's time needs of its route, once per device pair: the same
        sums as ``Machine.transfer_time``, so the times are the same to the bit; and the
        part of the latency its end devices are free (``Machine.message_busy``)."""
        key = (src, dst)
        if key not in self.memo.routes:
            links = [self.machine.links[i] for i in self.machine.route(src, dst)]
            latency = sum(link.latency for link in links)
            bandwidth = min(x.bandwidth for x in links)
            busy = self.machine.message_busy
            free = 0.0
            if self.machine.transfers_use_compute and busy is not None:
                free = latency - min(busy, latency)
            self.memo.routes[key] = (latency, bandwidth, self.link_resources(src, dst), free)
        return self.memo.routes[key]

    def ring_step_time(self, src: int, dst: int, nbytes: int) -> float:
        """One ring step's send: ``Machine.ring_step_latency`` where the machine has it
        (else the route's), and the bytes at the route's slowest link's rate; where
        transfers use the cores, twice: in a step every member sends a chunk and
        receives one, and its core copies both, as it does a message each way (which
        hold their ends' cores one after the other). The transport's ring of 2 CPU
        ranks here moves 7 GB/s a member, where one message at a time moves 16.5.
        Where the machine has a measured ``ring_step_curve``, the bytes cost what it
        says instead."""
        latency, bandwidth, _, _ = self._route(src, dst)
        ring = self.machine.ring_step_latency
        copies = 2 if self.machine.transfers_use_compute else 1
        nodes = self.machine.nodes
        if nodes is not None and nodes.of[src] != nodes.of[dst]:
            # between hosts: the network's latency where it is the longer, its bandwidth
            # (the probed figures are a host's own)
            return max(latency, ring or 0.0) + copies * nbytes / bandwidth
        latency = latency if ring is None else ring
        curve = self.machine.ring_step_curve
        if curve is not None:  # measured: the step's bytes as this host moves them
            return latency + curve.extra(nbytes)
        return latency + copies * nbytes / bandwidth

    def transfer(self, src: int, dst: int, nbytes: int) -> tuple[float, tuple[int, ...], float]:
        """(seconds holding ``resources``, resources, seconds in flight after them):
        the route's latency and bytes at its slowest link's rate, but for the part of
        the latency the end devices are free (``_in_flight``: a delay holding nothing)."""
        latency, bandwidth, resources, free = self._route(src, dst)
        return latency - free + nbytes / bandwidth, resources, free

    def copy(self, device: int, nbytes: int, passes: int) -> float:
        """The runtime copying ``nbytes`` on a CPU rank, ``passes`` streams of them (a copy
        reads and writes: 2; a gradient sum fills, reads two and writes: 4) at the
        device's probed copy bandwidth; nothing where transfers do not use the cores."""
        if not self.machine.transfers_use_compute:
            return 0.0
        return passes * nbytes / self.machine.devices[device].memory_bandwidth

    def durations(self, parts: OpParts) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Forward and backward seconds of every task of an op under its config."""
        key = (parts.op.name, parts.config)
        if key not in self.memo.compute:
            devices, op, size = self.machine.devices, parts.op, self.itemsize
            self.memo.compute[key] = (
                tuple(self.cost.forward(op, t, devices[t.device], size) for t in parts.tasks),
                tuple(self.cost.backward(op, t, devices[t.device], size) for t in parts.tasks),
            )
        return self.memo.compute[key]

    def key_blocks(self, parts: OpParts) -> tuple[tuple[KeyBlock, ...], ...]:
        """Per task of a streamed op, the blocks it takes its keys in (none: whole)."""
        key = (parts.op.name, parts.config)
        if key not in self.memo.blocks:
            op, tasks = parts.op, parts.tasks
            self.memo.blocks[key] = tuple(key_blocks(op, tasks, t) for t in tasks)
        return self.memo.blocks[key]

    def ring(self, devices: tuple[int, ...], numel: int) -> tuple[float, tuple[int, ...], int]:
        """(seconds, links, bytes) of a ring all-reduce: its 2(k-1) lock-step steps (as
        NCCL runs them: every member sends one chunk to the next, so a step lasts as long
        as its slowest send), summed in step order."""
        key = (devices, numel)
        if key not in self.memo.rings:
            self.memo.rings[key] = self._ring(devices, numel)
        return self.memo.rings[key]

    def half_ring(
        self,
        devices: tuple[int, ...],
        chunks: tuple[Interval, ...],
        steps: Callable[[int, int], tuple[RingStep, ...]],
        width: int,
    ) -> tuple[float, tuple[int, ...], int]:
        """(seconds, links, bytes) of ZeRO's reduce-scatter or all-gather over the
        shards' runs ``chunks`` of ``width``-byte elements: k-1 lock-step steps each,
        timed like the all-reduce's."""
        key = (steps.__name__, devices, chunks, width)
        if key not in self.memo.rings:
            self.memo.rings[key] = self._schedule(devices, chunks, steps, width)
        return self.memo.rings[key]

    def _ring(self, devices: tuple[int, ...], numel: int) -> tuple[float, tuple[int, ...], int]:
        m = self.machine
        if (
            m.nodes is not None
            and m.transfers_use_compute
            and takes_two_levels(numel * self.itemsize)
        ):
            rings = host_rings(devices, m.nodes.of)
            if rings is not None:  # ranks on several hosts: the transport's two levels
                return self.two_level(rings, numel)
        chunks = ring_chunks(numel, len(devices))
        return self._schedule(devices, chunks, ring_steps, self.itemsize)

    def two_level(self, rings: HostRings, numel: int) -> tuple[float, tuple[int, ...], int]:
        """The MPI transport's all-reduce over several hosts (``HostRings``): a
        reduce-scatter inside every host, the hosts' rings side by side, an all-gather
        inside every host; each phase's rings in lock step together."""
        width = self.itemsize
        inside = rings.host_chunks(numel)
        phases = (
            self._lockstep(rings.hosts, (inside,) * len(rings.hosts), reduce_scatter_steps, width),
            self._lockstep(
                rings.across(),
                tuple(rings.cross_chunks(numel, j) for j in range(rings.local)),
                ring_steps,
                width,
            ),
            self._lockstep(rings.hosts, (inside,) * len(rings.hosts), all_gather_steps, width),
        )
        links = tuple(sorted({r for _, held, _ in phases for r in held}))
        return sum(p[0] for p in phases), links, sum(p[2] for p in phases)

    def _lockstep(
        self,
        groups: tuple[tuple[int, ...], ...],
        chunks: tuple[tuple[Interval, ...], ...],
        steps: Callable[[int, int], tuple[RingStep, ...]],
        width: int,
    ) -> tuple[float, tuple[int, ...], int]:
        """Rings side by side (``groups[g]`` over ``chunks[g]``), a step of each at a
        time: a step lasts as long as its slowest send, whose bytes are those of every
        send that shares a link with it (the cross-host rings' sends share their hosts'
        network links)."""
        hops = [
            (g, i, ring[i], ring[(i + 1) % len(ring)])
            for g, ring in enumerate(groups)
            for i in range(len(ring))
        ]
        routes = {(a, b): self.machine.route(a, b) for _, _, a, b in hops}
        sharing: dict[int, int] = {}
        for links in routes.values():
            for r in links:
                sharing[r] = sharing.get(r, 0) + 1
        share = {key: max((sharing[r] for r in links), default=1) for key, links in routes.items()}
        schedule = {(g, i): steps(i, len(groups[g])) for g, i, _, _ in hops}
        seconds, nbytes = 0.0, 0
        for s in range(len(schedule[0, 0])):
            slowest = 0.0
            for g, i, a, b in hops:
                lo, hi = chunks[g][schedule[g, i][s].send_chunk]
                sent = (hi - lo) * width
                nbytes += sent
                slowest = max(slowest, self.ring_step_time(a, b, sent * share[(a, b)]))
            seconds += slowest
        held = {r for _, _, a, b in hops for r in self.link_resources(a, b)}
        return seconds, tuple(sorted(held)), nbytes

    def _schedule(
        self,
        devices: tuple[int, ...],
        chunks: tuple[Interval, ...],
        steps: Callable[[int, int], tuple[RingStep, ...]],
        width: int,
    ) -> tuple[float, tuple[int, ...], int]:
        k = len(devices)
        sizes = [(hi - lo) * width for lo, hi in chunks]
        if self.machine.nodes is not None and not self.machine.transfers_use_compute:
            return self._nccl(devices, sizes, steps)
        hops = [(devices[i], devices[(i + 1) % k]) for i in range(k)]
        links = tuple(sorted({r for a, b in hops for r in self.link_resources(a, b)}))
        # Per hop, a send's seconds per chunk size (two sizes: the chunks are balanced),
        # so a step costs k look-ups, not k transfer times: O(k) per ring, not O(k^2).
        times = [{n: self.ring_step_time(a, b, n) for n in set(sizes)} for a, b in hops]
        seconds, nbytes = 0.0, 0
        # The schedule turns with the ring (collectives.py): in every step member i sends
        # the chunk member 0 sends, plus i (in the all-reduce and in ZeRO's halves).
        for step in steps(0, k):
            c = step.send_chunk
            sent = sizes[c:] + sizes[:c]  # member i's chunk size: sizes[(c + i) % k]
            seconds += max(map(dict.__getitem__, times, sent))
            nbytes += sum(sent)
        return seconds, links, nbytes

    def _nccl(
        self,
        devices: tuple[int, ...],
        sizes: list[int],
        steps: Callable[[int, int], tuple[RingStep, ...]],
    ) -> tuple[float, tuple[int, ...], int]:
        """A collective on GPU nodes, as NCCL runs it (``sim/collectives.py``): its
        algorithm and protocol as NCCL's model picks them, striped over every link
        between the members, which it holds (ZeRO's uneven runs, which the executor
        gives NCCL as one broadcast or reduce per shard, as balanced ones of the widest
        run). The bytes are the ring's: what the members send."""
        k = len(devices)
        kind = _COLLECTIVE_OF[steps.__name__]
        if devices not in self.memo.groups:
            pairs = ((a, b) for a in devices for b in devices if a != b)
            links = tuple(sorted({r for a, b in pairs for r in self.link_resources(a, b)}))
            self.memo.groups[devices] = (group_shape(self.machine, devices), links)
        shape, links = self.memo.groups[devices]
        seconds = collective_time(shape, kind, k * max(sizes)).seconds
        nbytes = sum(sizes) * (k - 1) * (2 if kind is Collective.ALL_REDUCE else 1)
        return seconds, links, nbytes


_COLLECTIVE_OF = {
    ring_steps.__name__: Collective.ALL_REDUCE,
    reduce_scatter_steps.__name__: Collective.REDUCE_SCATTER,
    all_gather_steps.__name__: Collective.ALL_GATHER,
}


def _group_ring(costs, b, devices, numel, ready: Sequence[Ref], what) -> tuple[Ref, ...]:
    """A ring over ``devices`` after ``ready``; returns what its members then wait for:
    the ring, or with one device the ready tasks themselves."""
    if len(devices) < 2:
        return tuple(ready)
    seconds, links, nbytes = costs.ring(devices, numel)
    return (b.add(TaskKind.ALLREDUCE, seconds, links, ready, nbytes, what),)


def _partials(b, parts, kind, seconds, after) -> list[Ref]:
    """Every task's partial half (half its time): assembly and partial statistics."""
    tag = "fwd" if kind is TaskKind.FORWARD else "bwd"
    op = parts.op
    return [
        b.add(
            kind,
            s / 2,
            (t.device,),
            after[t.index],
            0,
            lambda t=t: f"{tag} {op.name}[{t.index}] partial",
        )
        for t, s in zip(parts.tasks, seconds, strict=True)
    ]


def _stats_rings(costs, b, run: Sequence[OpParts], starts, kind) -> dict:
    """The statistics rings of ``run``'s ops (``soap/stats_batches.py``: one per device
    set, the members' statistics side by side), after their members' partial halves
    (``starts``: per member, per task); per (member, task), what its finishing half
    then waits for."""
    phase = 0 if kind is TaskKind.FORWARD else 1
    tag = "fwd" if kind is TaskKind.FORWARD else "bwd"
    finished: dict[tuple[int, int], tuple[Ref, ...]] = {}
    for ring in stats_rings(range(len(run)), lambda k: run[k].stats):
        groups = [(k, run[k].stats[g]) for k, g in ring.members]
        numel = sum(group.numel[phase] for _, group in groups)
        ready = [starts[k][t] for k, group in groups for t in group.tasks]
        what = ring.name(lambda k: run[k].op.name, tag)
        done = _group_ring(costs, b, ring.devices, numel, ready, what)
        for k, group in groups:
            finished |= dict.fromkeys(((k, t) for t in group.tasks), done)
    return finished


def _finishing(b, parts, kind, seconds, starts, finished, k: int = 0) -> list[Ref]:
    """Every task's finishing half, after its partial half and its group's ring."""
    tag = "fwd" if kind is TaskKind.FORWARD else "bwd"
    op = parts.op
    return [
        b.add(
            kind,
            s / 2,
            (t.device,),
            (starts[t.index], *finished[(k, t.index)]),
            0,
            lambda t=t: f"{tag} {op.name}[{t.index}]",
        )
        for t, s in zip(parts.tasks, seconds, strict=True)
    ]


def _synced_phase(costs, b, parts, kind, seconds, after) -> tuple[list, list]:
    """An op with statistics, as the executor runs it: every task's partial half, a ring
    per statistics group, then every task's finishing half."""
    starts = _partials(b, parts, kind, seconds, after)
    finished = _stats_rings(costs, b, [parts], [starts], kind)
    return starts, _finishing(b, parts, kind, seconds, starts, finished)


def _sum_ring(costs, b, group: SumGroup, ready, what: str, backward: bool) -> tuple[Ref, ...]:
    """The group's collective after ``ready``: an all-reduce of the tile, or where the
    group reduce-scatters (``SumGroup.scatter``) the ring's half over the chunks' runs,
    the reduce-scatter forward and the all-gather of the chunks' gradients backward."""
    if group.scatter is None or len(group.devices) < 2:
        return _group_ring(costs, b, group.devices, group.numel, ready, what)
    steps = all_gather_steps if backward else reduce_scatter_steps
    runs = group.scatter.runs(group.tile)
    seconds, links, nbytes = costs.half_ring(group.devices, runs, steps, costs.itemsize)
    return (b.add(TaskKind.ALLREDUCE, seconds, links, ready, nbytes, what),)


def _summed_forward(costs, b, parts, seconds, after) -> tuple[list, list]:
    """Forward of an op with partial sums: every task, then per group a ring of the
    partial tiles and a gate (no duration) on each holder: its tile is ready after it."""
    op, tasks = parts.op, parts.tasks
    starts = [
        b.add(
            TaskKind.FORWARD,
            s,
            (t.device,),
            after[t.index],
            0,
            lambda t=t: f"fwd {op.name}[{t.index}]",
        )
        for t, s in zip(tasks, seconds, strict=True)
    ]
    ends = list(starts)
    for group in parts.sums:
        ready = [starts[i] for i in group.tasks]
        done = _sum_ring(costs, b, group, ready, f"partial sums {op.name} fwd", False)
        for d, holder in zip(group.devices, group.holders, strict=True):
            ends[holder] = b.add(TaskKind.FORWARD, 0.0, (d,), done, 0, f"sum {op.name}")
    return starts, ends


def _summed_backward(costs, b, parts, seconds, after) -> tuple[list, list]:
    """Backward of an op with partial sums: per group each holder receives the gradient
    pieces of its readers (a gate), a ring sums (or gathers) them, then every task
    computes."""
    op, tasks = parts.op, parts.tasks
    ready_at: dict[int, tuple[Ref, ...]] = {}
    starts: list = [None] * len(tasks)
    for group in parts.sums:
        gates = []
        for d, holder in zip(group.devices, group.holders, strict=True):
            gate = b.add(TaskKind.BACKWARD, 0.0, (d,), after[holder], 0, f"sum {op.name}")
            starts[holder] = gate
            gates.append(gate)
        done = _sum_ring(costs, b, group, gates, f"partial sums {op.name} bwd", True)
        ready_at |= dict.fromkeys(group.tasks, done)
    ends = []
    for t, s in zip(tasks, seconds, strict=True):
        preds = (*after[t.index], *ready_at[t.index])
        x = b.add(
            TaskKind.BACKWARD, s, (t.device,), preds, 0, lambda t=t: f"bwd {op.name}[{t.index}]"
        )
        ends.append(x)
        if starts[t.index] is None:
            starts[t.index] = x
    return starts, ends


def _plain_phase(b, parts, kind, seconds, after) -> tuple[list, list]:
    tag = "fwd" if kind is TaskKind.FORWARD else "bwd"
    op = parts.op
    tasks = [
        b.add(kind, s, (t.device,), after[t.index], 0, lambda t=t: f"{tag} {op.name}[{t.index}]")
        for t, s in zip(parts.tasks, seconds, strict=True)
    ]
    return tasks, list(tasks)


def _streamed_phase(b, parts, seconds, after, blocks) -> tuple[list, list, Chains]:
    """A streamed op's forward (ring attention): each task a chain of one task a block
    of keys, its share of the task's time (``KeyBlock.share``: the chain costs what the
    task costs), each after the one before and, through the edges' feeds
    (``Chains.target``), its own block's pieces alone; a task without blocks is one."""
    op = parts.op
    starts, ends, chains = [], [], []
    for t, s in zip(parts.tasks, seconds, strict=True):
        name = f"fwd {op.name}[{t.index}]"
        if not blocks[t.index]:
            x = b.add(TaskKind.FORWARD, s, (t.device,), after[t.index], 0, name)
            starts.append(x)
            ends.append(x)
            chains.append(())
            continue
        chain, preds = [], tuple(after[t.index])
        for block in blocks[t.index]:
            what = f"{name} keys of {block.device}"
            x = b.add(TaskKind.FORWARD, s * block.share, (t.device,), preds, 0, what)
            chain.append((x[1], block.spans))
            preds = (x,)
        starts.append((b.slot, chain[0][0]))
        ends.append(x)
        chains.append(tuple(chain))
    streams = definition(op.type).streams
    return starts, ends, Chains(streams.operands, streams.axis, tuple(chains))


def _weight_gathers(costs: Costs, b, parts: OpParts, after: list, backward: bool = False) -> list:
    """ZeRO-3: an all-gather of each of the op's sharded groups' Rect (for the
    ``backward``, of those it reads), one after another, which the phase's tasks on its
    members wait for: ``after`` (per task, its predecessors) with its device's last
    gather. The executor starts them as the op before begins (executor/program.py's
    ``_with_gathers``, FSDP's prefetch): they wait for nothing of this op, only for
    their links in program order (on CPU ranks, their cores: after the op before's
    tasks there)."""
    if not costs.zero.shards_weights:
        return after
    last: dict[int, Ref] = {}
    graph = costs.memo.graph
    for group in parts.groups:
        sharded = zero_group(group, costs.zero)
        if sharded is None or not group_stage(group, costs.zero).shards_weights:
            continue
        if backward and graph is not None and not backward_reads(graph, parts.op, group.weight):
            continue
        # in the format the kernels read (the executor gathers the half copy's rows)
        seconds, links, nbytes = costs.half_ring(
            group.devices, sharded.chunks, all_gather_steps, costs.stored
        )
        before = tuple(dict.fromkeys(last[d] for d in group.devices if d in last))
        what = f"all-gather {group.weight}"
        ring = b.add(TaskKind.ALLREDUCE, seconds, links, before, nbytes, what)
        for d in group.devices:
            last[d] = ring
    return [
        (*a, last[t.device]) if t.device in last else a
        for a, t in zip(after, parts.tasks, strict=True)
    ]


def forward_segment(costs: Costs, slot: int, parts: OpParts, names: bool) -> Segment:
    b = _SegmentBuilder(slot, names, costs.turns)
    seconds, _ = costs.durations(parts)
    none = _weight_gathers(costs, b, parts, [()] * len(parts.tasks))
    if parts.op.nest.sync_dims:
        starts, ends = _synced_phase(costs, b, parts, TaskKind.FORWARD, seconds, none)
    elif parts.sums:  # a split partial dim
        starts, ends = _summed_forward(costs, b, parts, seconds, none)
    elif any(blocks := costs.key_blocks(parts)):
        starts, ends, chains = _streamed_phase(b, parts, seconds, none, blocks)
        return b.segment([x[1] for x in starts], [x[1] for x in ends], chains=chains)
    else:
        starts, ends = _plain_phase(b, parts, TaskKind.FORWARD, seconds, none)
    return b.segment([x[1] for x in starts], [x[1] for x in ends])


def backward_segment(
    costs: Costs, slot: int, parts: OpParts, fwd_slot: int, fwd: Segment, names: bool
) -> Segment:
    """The op's backward tasks, each after its own forward; none where the op's output
    takes no gradient (the executor runs no backward for ids and masks)."""
    graph = costs.memo.graph
    if graph is not None and not graph.differentiable(parts.op.output):
        return EMPTY
    b = _SegmentBuilder(slot, names, costs.turns)
    forward, seconds = costs.durations(parts)
    after = [((fwd_slot, e),) for e in fwd.ends]
    recomputed = recomputes(parts.op, parts.sums, costs.recompute)
    redo = _recomputed(b, parts, forward, after) if recomputed else None
    if redo is not None:
        after = [(r,) for r in redo]
    after = _weight_gathers(costs, b, parts, after, backward=True)
    if parts.op.nest.sync_dims:
        starts, ends = _synced_phase(costs, b, parts, TaskKind.BACKWARD, seconds, after)
    elif parts.sums:  # a split partial dim
        starts, ends = _summed_backward(costs, b, parts, seconds, after)
    else:
        starts, ends = _plain_phase(b, parts, TaskKind.BACKWARD, seconds, after)
    if redo is not None:  # the output gradient arrives before the forward is rerun
        starts = redo
    return b.segment([x[1] for x in starts], [x[1] for x in ends])


def run_segments(
    costs: Costs, lay: Layout, run: Sequence[int], parts: Sequence[OpParts], names: bool
) -> dict[int, Segment]:
    """The forward and backward slots of a run of ops with statistics (``Layout.runs``,
    ``parts``: theirs, in run order), as the executor runs it: in each phase, in the
    run's first op's slot (its host), every member's partial halves (its recomputed
    forward and ZeRO-3 gathers first, as in ``forward_segment``/``backward_segment``)
    and the rings (``soap/stats_batches.py``); in each member's own slot, its finishing
    halves. A member's segment's ``starts`` are its first tasks' places in the host's
    slot, where its incoming edges' data arrives (``Layout.fed_forward``)."""
    out: dict[int, Segment] = {}
    fwd_slots = [lay.forward[i] for i in run]
    host = _SegmentBuilder(fwd_slots[0], names, costs.turns)
    seconds = [costs.durations(p) for p in parts]
    after = [_weight_gathers(costs, host, p, [()] * len(p.tasks)) for p in parts]
    starts = [
        _partials(host, p, TaskKind.FORWARD, s[0], a)
        for p, s, a in zip(parts, seconds, after, strict=True)
    ]
    out |= _finished_run(costs, host, fwd_slots, parts, starts, TaskKind.FORWARD, seconds, names)
    # The backward reaches the run's last op first: its slot hosts the run's halves.
    order = range(len(run) - 1, -1, -1)
    bwd_slots = [lay.backward[run[k]] for k in order]
    host = _SegmentBuilder(bwd_slots[0], names, costs.turns)
    bparts, bseconds, bstarts, firsts = [parts[k] for k in order], [], [], []
    for k in order:
        p, fwd = parts[k], out[fwd_slots[k]]
        ready = [((fwd_slots[k], e),) for e in fwd.ends]
        redo = None
        if recomputes(p.op, p.sums, costs.recompute):
            redo = _recomputed(host, p, seconds[k][0], ready)
            ready = [(r,) for r in redo]
        ready = _weight_gathers(costs, host, p, ready, backward=True)
        bstarts.append(_partials(host, p, TaskKind.BACKWARD, seconds[k][1], ready))
        bseconds.append(seconds[k][::-1])  # the backward's own seconds first
        firsts.append(redo)  # the output gradient arrives before the forward is rerun
    out |= _finished_run(
        costs, host, bwd_slots, bparts, bstarts, TaskKind.BACKWARD, bseconds, names, firsts
    )
    return out


def _finished_run(
    costs, host, slots, parts, starts, kind, seconds, names, firsts=None
) -> dict[int, Segment]:
    """The rings after ``starts`` (per member of a run, in the phase's order, its partial
    halves, all in ``host``, the first slot's builder), each member's finishing halves
    in its own slot of ``slots``, and the members' segments by slot; ``firsts``: per
    member, its first tasks where they are not its partial halves (a recomputed
    forward's)."""
    finished = _stats_rings(costs, host, parts, starts, kind)
    out: dict[int, Segment] = {}
    for k, (slot, p) in enumerate(zip(slots, parts, strict=True)):
        b = host if k == 0 else _SegmentBuilder(slot, names, costs.turns)
        ends = _finishing(b, p, kind, seconds[k][0], starts[k], finished, k)
        first = starts[k] if firsts is None or firsts[k] is None else firsts[k]
        out[slot] = b.segment([x[1] for x in first], [x[1] for x in ends])
    return out


def _recomputed(b: _SegmentBuilder, parts: OpParts, seconds, after) -> list[Ref]:
    """A recomputed op's forward, run again on each task's device just before its
    backward (once its output gradient is there: the backward reaches it), for the
    forward's time. Its inputs are at hand (the op's input buffers); a statistics op's
    rings and a partial sum's ring are not run again (the tile is recomputed from the
    same statistics and summed parts)."""
    op = parts.op
    return [
        b.add(
            TaskKind.FORWARD,
            s,
            (t.device,),
            after[t.index],
            0,
            lambda t=t: f"recompute {op.name}[{t.index}]",
        )
        for t, s in zip(parts.tasks, seconds, strict=True)
    ]


def _in_flight(b: _SegmentBuilder, sent: Ref, free: float, what: str) -> Ref:
    """The rest of a message's latency after ``sent``: a delay that holds nothing (its
    end devices and their cores are free, and the next message on its links need not
    wait for it: latency is not occupancy); ``sent`` itself where no part of the latency
    frees them."""
    if free <= 0:
        return sent
    return b.add(TaskKind.TRANSFER, free, (), (sent,), 0, lambda: f"in flight {what}")


def _copy_after(
    b: _SegmentBuilder,
    costs: Costs,
    device: int,
    nbytes: int,
    passes: int,
    after: Ref,
    name: Callable[[], str],
) -> Ref:
    """A piece copied on ``device`` after ``after``: a strided tile staged by its sender
    before its transfer, a received one copied into place after the part of its transfer
    that holds the receiver (nothing where transfers do not use the cores). The runtime
    copies a received piece inside its consumer's instruction, later in the receiver's
    order; here the copy stands at the edge's place in that order, so it must not wait
    for the rest of the message's latency (``_in_flight``), which would stall the
    receiver's other tasks behind it: on 4 ranks sharing 2 cores, where most of a
    message's latency is in flight, that had predicted GPT-2's random plans at 2.3x
    what they measure."""
    seconds = costs.copy(device, nbytes, passes)
    if seconds <= 0:
        return after
    return b.add(TaskKind.TRANSFER, seconds, (device,), (after,), 0, name)


def edge_forward_segment(
    costs: Costs,
    slot: int,
    edge: Edge,
    ptasks,
    ctasks,
    src: tuple[int, Segment],
    dst: Segment,
    names: bool,
) -> Segment:
    """The edge's tiles: a transfer per crossing overlap, after the producer task; the
    consumer task reads after the transfer, or straight after the producer on one device."""
    b = _SegmentBuilder(slot, names, costs.turns)
    width = costs.edge_width(edge.tensor)
    pieces = Counter(o.dst_task for o in edge.overlaps)
    feeds = []
    for o in _ring_order(edge, dst):
        p, c = ptasks[o.src_task], ctasks[o.dst_task]
        produced = (src[0], src[1].ends[p.index])
        nbytes = o.volume * width
        what = f"{edge.tensor} {p.device}->{c.device}"
        if p.device == c.device:
            whole = o.rect == edge.source(p) and o.rect == c.inputs[edge.operand].buffer
            copy = 0.0 if pieces[o.dst_task] == 1 and whole else costs.copy(c.device, nbytes, 2)
            if copy > 0:  # assembled, not read in place
                produced = b.add(
                    TaskKind.TRANSFER, copy, (c.device,), (produced,), 0, lambda w=what: f"copy {w}"
                )
            feeds.append((_reader(dst, c.index, edge.operand, o.rect), produced))
            continue
        if not rect_contiguous(o.rect, edge.source(p)):  # staged: the sender copies it first
            produced = _copy_after(
                b, costs, p.device, nbytes, 2, produced, lambda w=what: f"stage {w}"
            )
        seconds, resources, free = costs.transfer(p.device, c.device, nbytes)
        x = b.add(
            TaskKind.TRANSFER, seconds, resources, (produced,), nbytes, lambda w=what: f"send {w}"
        )
        # A received piece that is the whole buffer is read in place (layout.Received);
        # any other is copied from its receive buffer into place (see _copy_after).
        if not (pieces[o.dst_task] == 1 and o.rect == c.inputs[edge.operand].buffer):
            x = _copy_after(b, costs, c.device, nbytes, 2, x, lambda w=what: f"copy {w}")
        x = _in_flight(b, x, free, f"send {what}")
        feeds.append((_reader(dst, c.index, edge.operand, o.rect), x))
    return b.segment(feeds=feeds)


def _ring_order(edge: Edge, dst: AnySegment):
    """The edge's overlaps, to a streamed consumer (ring attention) in the order its
    tasks take their blocks: every task's first block's pieces, then every second's,
    ...; on a switch each step's transfers then use each device's ports once, as a
    ring's steps do (``executor/program.py`` sends in the same order)."""
    chains = dst.chains
    if chains is None or edge.operand not in chains.operands:
        return edge.overlaps
    steps = [chains.step(o.dst_task, edge.operand, o.rect) for o in edge.overlaps]
    order = sorted(range(len(steps)), key=steps.__getitem__)
    return [edge.overlaps[i] for i in order]


def _reader(dst: AnySegment, task: int, operand: int, rect) -> int:
    """The consumer's task that first reads a piece: its block's, where the consumer
    streams the operand (ring attention), else the task's first."""
    at = None if dst.chains is None else dst.chains.target(task, operand, rect)
    return dst.starts[task] if at is None else at


def edge_backward_segment(
    costs: Costs,
    slot: int,
    edge: Edge,
    ptasks,
    ctasks,
    src: tuple[int, Segment],
    dst: Segment,
    names: bool,
) -> Segment:
    """The edge's gradient pieces, from the consumer's backward to the producer's."""
    graph = costs.memo.graph
    if not src[1].ends or not graph.differentiable(edge.tensor):
        return EMPTY  # ids take no gradient; an op without backward sends none
    b = _SegmentBuilder(slot, names, costs.turns)
    width = costs.edge_width(edge.tensor)
    # A producer task's output gradient is read in place only from its one consumer's
    # one piece; anything else is a zeroed buffer the pieces are summed into.
    readers = costs.memo.readers[edge.tensor]
    pieces = Counter(o.src_task for o in edge.overlaps)
    feeds = []
    for o in edge.overlaps:
        p, c = ptasks[o.src_task], ctasks[o.dst_task]
        produced = (src[0], src[1].ends[c.index])
        nbytes = o.volume * width
        what = f"{edge.tensor} {p.device}->{c.device}"
        if p.device == c.device:
            whole = o.rect == edge.source(p) and o.rect == c.inputs[edge.operand].buffer
            single = readers == 1 and pieces[o.src_task] == 1 and whole
            copy = 0.0 if single else costs.copy(p.device, nbytes, 4)
            if copy > 0:
                produced = b.add(
                    TaskKind.TRANSFER,
                    copy,
                    (p.device,),
                    (produced,),
                    0,
                    lambda w=what: f"copy grad {w}",
                )
            feeds.append((dst.starts[p.index], produced))
            continue
        if not rect_contiguous(o.rect, c.inputs[edge.operand].buffer):  # staged first
            produced = _copy_after(
                b, costs, c.device, nbytes, 2, produced, lambda w=what: f"stage grad {w}"
            )
        seconds, resources, free = costs.transfer(c.device, p.device, nbytes)
        x = b.add(
            TaskKind.TRANSFER, seconds, resources, (produced,), nbytes, lambda w=what: f"grad {w}"
        )
        # The producer's whole output gradient, received as one piece from its only
        # reader, is read in place; any other piece is summed into a zeroed gradient.
        if not (readers == 1 and pieces[o.src_task] == 1 and o.rect == edge.source(p)):
            x = _copy_after(b, costs, p.device, nbytes, 4, x, lambda w=what: f"copy grad {w}")
        x = _in_flight(b, x, free, f"grad {what}")
        feeds.append((dst.starts[p.index], x))
    return b.segment(feeds=feeds)


def _weight_ready(parts: OpParts, phase: tuple[int, Segment], group: ReplicaGroup):
    slot, seg = phase
    return {
        d: [(slot, seg.ends[i]) for i in group.tasks if parts.tasks[i].device == d]
        for d in group.devices
    }


def _group_ready(parts: OpParts, last: tuple[int, Segment], group: ReplicaGroup) -> list[Ref]:
    """The tasks that make the group's gradient, on all its devices."""
    return [r for refs in _weight_ready(parts, last, group).values() for r in refs]


@dataclass(frozen=True)
class BucketOps:
    """A gradient bucket's ops (``soap/buckets.py``), in backward order: per op its
    parts and the phase its weight gradients are made in (``last``: its backward, or
    its forward where it has none)."""

    bucket: int
    ops: tuple[int, ...]
    parts: tuple[OpParts, ...]
    last: tuple[tuple[int, Segment], ...]
    summed: tuple[int, ...]  # the ops whose gradients its rings sum (``Buckets.summed``)

    def groups(self, i: int) -> tuple[ReplicaGroup, ...]:
        return self.parts[self.ops.index(i)].groups

    def ready(self, ring: BucketRing | BucketScatter) -> tuple[Ref, ...]:
        """The tasks that make the ring's gradients: its members' backward tasks."""
        refs: dict[Ref, None] = {}
        for i, g in ring.members:
            k = self.ops.index(i)
            group = self.parts[k].groups[g]
            refs |= dict.fromkeys(_group_ready(self.parts[k], self.last[k], group))
        return tuple(refs)


def weight_segments(
    costs: Costs, lay: Layout, bucket: BucketOps, names: bool
) -> tuple[list[Segment], dict[tuple[int, int], Ref]]:
    """The weight slot of every op of the bucket: after the backward of the op that
    makes its last gradient of a device set (``closing``), the bucket's reduce-scatter
    of the groups ZeRO shards over those devices, and its ring of the others, while the
    rest of the backward goes on. Returns the segments and, per (op, group) summed, the
    task that sums it. (The executor completes a rank's previous reduce-scatter before
    it starts the next, which may hold its backward a little; not modelled.)"""
    scatters = bucket_scatters(bucket.bucket, bucket.summed, bucket.groups, costs.zero)
    rings = bucket_rings(bucket.bucket, bucket.summed, bucket.groups, costs.zero)
    summed: dict[tuple[int, int], Ref] = {}
    segments = []
    for i in bucket.ops:
        b = _SegmentBuilder(lay.weights[i], names, costs.turns)
        for scatter in (x for x in scatters if x.closing == i):
            seconds, links, nbytes = costs.half_ring(
                scatter.devices, scatter.chunks(), reduce_scatter_steps, costs.itemsize
            )
            ready = bucket.ready(scatter)
            done = b.add(TaskKind.ALLREDUCE, seconds, links, ready, nbytes, scatter.name)
            summed |= dict.fromkeys(scatter.members, done)
        for ring in (r for r in rings if r.closing == i):
            seconds, links, nbytes = costs.ring(ring.devices, ring.numel)
            done = b.add(TaskKind.ALLREDUCE, seconds, links, bucket.ready(ring), nbytes, ring.name)
            summed |= dict.fromkeys(ring.members, done)
        segments.append(b.segment())
    return segments, summed


def update_segment(
    costs: Costs,
    slot: int,
    parts: OpParts,
    last: tuple[int, Segment],
    summed: Mapping[int, Ref],
    names: bool,
) -> Segment:
    """An SGD update per trainable weight shard and device, after the task that sums its
    group (``summed``, by group index: a bucket's ring or ZeRO's reduce-scatter), or its
    own device's backward tasks when the shard has one copy; under ZeRO each member
    updates its rows, and an all-gather after every member's update gives them to all
    (at ZeRO-3 none: each phase of the op gathers the Rect before its tasks,
    ``_weight_gathers``)."""
    b = _SegmentBuilder(slot, names, costs.turns)
    for g, group in enumerate(parts.groups):
        if not group.trainable:
            continue  # state: updated by the forward, no gradient to sum or apply
        ready = _weight_ready(parts, last, group)
        if g in summed:
            ready = dict.fromkeys(group.devices, (summed[g],))
        sharded = zero_group(group, costs.zero)
        updates = []
        for d in group.devices:
            numel = rect_volume(group.rect) if sharded is None else sharded.numel(d)
            seconds = costs.cost.update(numel, costs.machine.devices[d], costs.itemsize)
            updates.append(
                b.add(TaskKind.UPDATE, seconds, (d,), ready[d], 0, f"update {group.weight}")
            )
        # ZeRO-3: before its uses
        if sharded is not None and not group_stage(group, costs.zero).shards_weights:
            seconds, links, nbytes = costs.half_ring(
                group.devices, sharded.chunks, all_gather_steps, costs.itemsize
            )
            what = f"all-gather {group.weight}"
            b.add(TaskKind.ALLREDUCE, seconds, links, updates, nbytes, what)
    return b.segment()


def sync_segments(costs: Costs, lay: Layout, bucket: BucketOps, names: bool) -> tuple[Segment, ...]:
    """The weight and update slots of a bucket's ops, in ``bucket_slots`` order: the
    sums of their gradients and their updates."""
    weights, summed = weight_segments(costs, lay, bucket, names)
    updates = [
        update_segment(
            costs,
            lay.updates[i],
            parts,
            last,
            {g: ref for (j, g), ref in summed.items() if j == i},
            names,
        )
        for i, parts, last in zip(bucket.ops, bucket.parts, bucket.last, strict=True)
    ]
    return (*weights, *updates)


def bucket_slots(lay: Layout, ops: Sequence[int]) -> tuple[int, ...]:
    """The slots a bucket's gradient sums and updates fill: its ops' weight slots, then
    their update slots."""
    return (*(lay.weights[i] for i in ops), *(lay.updates[i] for i in ops))


def merged_preds(segment: AnySegment, feeds: Sequence[AnySegment]) -> tuple[tuple[Ref, ...], ...]:
    """A compute slot's predecessors: its own, and what its edges' ``feeds`` bring."""
    fed = [f.feeds for f in feeds]  # each read once: a moved segment's are made anew
    if not any(fed):
        return segment.preds
    preds = [list(p) for p in segment.preds]
    for f in fed:
        for target, ref in f:
            preds[target].append(ref)
    return tuple(tuple(p) for p in preds)


@dataclass(frozen=True)
class SlotKinds:
    """Per op and per edge (``Layout.edges`` order), a number shared by those whose slots
    hold the same segments under the same configs but for the slots' numbers (the same
    op or edge of every layer): an op's partition kind (``op_kinds``), whether its output
    and its inputs take a gradient, how many operands read its output and whether the
    plan recomputes it (and its weights' ZeRO stages, where they differ); an edge's two
    ops' kinds and its operand. Its memory is the same too (``op_kinds_held``)."""

    ops: tuple[int, ...]
    edges: tuple[int, ...]


def slot_kinds(
    graph: Graph, lay: Layout, recompute: frozenset[str], zero: Zero = NO_ZERO
) -> SlotKinds:
    held = op_kinds_held(graph, recompute, zero)
    readers = Counter(t for op in graph.ops for t in op.inputs)
    interned: dict[tuple, int] = {}
    ops = tuple(
        interned.setdefault((held[op.name], readers[op.output]), len(interned)) for op in graph.ops
    )
    pairs: dict[tuple, int] = {}
    edges = tuple(pairs.setdefault((ops[p], ops[c], k), len(pairs)) for p, c, k in lay.edges)
    return SlotKinds(ops, edges)


class Moved:
    """A segment as built at other slots (``relocated``): the source's tasks, whose
    references to the moved slots (``moves``: old slot -> new) point to these. Its
    durations, kinds, bytes and resources are the source's objects; its predecessors and
    feeds are made as tuples each time they are read, never kept here: a full
    simulation reads them as arrays, moved by a lookup (``slot_arrays``), and delta
    simulation keeps the predecessors in its state and merges the feeds into its compute
    slots' (a 70B-shaped Llama's Megatron-LM plan on 256 GPUs: 0.4 GB of moved feeds,
    kept per slot, were most of its state)."""

    __slots__ = ("moves", "source")

    def __init__(self, source: Segment, moves: Mapping[int, int]) -> None:
        self.source, self.moves = source, moves

    @property
    def duration(self) -> tuple[float, ...]:
        return self.source.duration

    @property
    def kind(self) -> tuple[int, ...]:
        return self.source.kind

    @property
    def nbytes(self) -> tuple[int, ...]:
        return self.source.nbytes

    @property
    def resources(self) -> tuple[tuple[int, ...], ...]:
        return self.source.resources

    @property
    def names(self) -> tuple[str, ...]:
        return self.source.names

    @property
    def starts(self) -> tuple[int, ...]:
        return self.source.starts

    @property
    def ends(self) -> tuple[int, ...]:
        return self.source.ends

    @property
    def chains(self) -> Chains | None:
        return self.source.chains

    @property
    def preds(self) -> tuple[tuple[Ref, ...], ...]:
        moves = self.moves
        # a list of predecessors shared by several tasks is moved once and stays
        # shared; list comprehensions, not generators: once per task
        moved: dict[int, tuple[Ref, ...]] = {}
        preds = []
        for p in self.source.preds:
            q = moved.get(id(p))
            if q is None:
                q = moved[id(p)] = tuple([(moves[s], k) for s, k in p]) if p else p
            preds.append(q)
        return tuple(preds)

    @property
    def feeds(self) -> tuple[tuple[int, Ref], ...]:
        moves = self.moves
        return tuple([(t, (moves[s], k)) for t, (s, k) in self.source.feeds])


AnySegment = Segment | Moved


def relocated(segment: AnySegment, moves: Mapping[int, int]) -> AnySegment:
    """``segment`` as built at other slots, with its references to them moved (``moves``:
    old slot -> new): a ``Moved`` of its source (one moved already is moved again from
    its source, the two moves in one)."""
    if isinstance(segment, Moved):
        moves = {s: moves[t] for s, t in segment.moves.items() if t in moves}
        segment = segment.source
    if not segment.preds and not segment.feeds:  # an edge on one device may only feed
        return segment
    return Moved(segment, moves)


@dataclass
class SlotBuilder:
    """Builds every slot of one strategy: ``segments[slot]``. Used whole by the full
    simulation and slot by slot by delta simulation. With ``kinds`` (and no names, which
    name tensors), an op's or edge's slots are built once per kind and configs and moved
    to the slots of every other of its kind: a LLaMA-3-8B shape's 32 layers had each
    built their own, most of a simulation's time on 64 devices."""

    costs: Costs
    lay: Layout
    names: bool = False
    kinds: SlotKinds | None = None
    # the graph's gradient buckets (soap/buckets.py)
    buckets: Buckets = field(default_factory=lambda: Buckets(()))
    # per (kind, configs): the op's or edge's index it was built at, and its segments
    _ops_built: dict[tuple, tuple[int, tuple[Segment, ...]]] = field(default_factory=dict)
    _edges_built: dict[tuple, tuple[int, tuple[Segment, Segment]]] = field(default_factory=dict)
    # per (its ops' kinds, configs and sums): a bucket's ops and its sums' and updates'
    _buckets_built: dict[tuple, tuple[tuple[int, ...], tuple[Segment, ...]]] = field(
        default_factory=dict
    )

    def _shared(self) -> bool:
        return self.kinds is not None and not self.names

    def op_slots(self, segments: list, i: int, parts: OpParts) -> None:
        """The op's forward and backward slots (its weights' sums and updates are its
        bucket's: ``bucket_slots``)."""
        lay = self.lay
        slots = (lay.forward[i], lay.backward[i])
        key = None
        if self._shared():
            key = (self.kinds.ops[i], parts.config, parts.sums)
            found = self._ops_built.get(key)
            if found is not None:
                i0 = found[0]
                moves = {lay.forward[i0]: slots[0], lay.backward[i0]: slots[1]}
                for s, seg in zip(slots, found[1], strict=True):
                    segments[s] = relocated(seg, moves)
                return
        c, n = self.costs, self.names
        f, bw = slots
        segments[f] = forward_segment(c, f, parts, n)
        segments[bw] = backward_segment(c, bw, parts, f, segments[f], n)
        if key is not None:
            self._ops_built[key] = (i, tuple(segments[s] for s in slots))

    def run_slots(self, segments: list, run: Sequence[int], parts: Sequence[OpParts]) -> None:
        """The forward and backward slots of a run of ops with statistics (``parts``:
        theirs, in run order): they depend on every member's config, so they are built
        together and never moved to another run's slots."""
        for slot, seg in run_segments(self.costs, self.lay, run, parts, self.names).items():
            segments[slot] = seg

    def bucket_slots(self, segments: list, b: int, parts: Sequence[OpParts]) -> None:
        """The weight and update slots of bucket ``b``'s ops (``parts``: theirs, in the
        bucket's order), after their forward and backward slots are built."""
        lay, ops = self.lay, self.buckets.ops[b]
        slots = bucket_slots(lay, ops)
        key = None
        # a run's member's last tasks stand where the other members' configs put them
        if self._shared() and not any(i in lay.runs for i in ops):
            key = tuple(
                (self.kinds.ops[i], p.config, p.sums) for i, p in zip(ops, parts, strict=True)
            )
            found = self._buckets_built.get(key)
            if found is not None:
                pairs = zip(found[0], ops, strict=True)
                moves = {s0: s for i0, i in pairs for s0, s in _op_moves(lay, i0, i)}
                for s, seg in zip(slots, found[1], strict=True):
                    segments[s] = relocated(seg, moves)
                return
        last = []
        for i in ops:
            f, bw = lay.forward[i], lay.backward[i]
            last.append((bw, segments[bw]) if segments[bw].ends else (f, segments[f]))
        bucket = BucketOps(b, ops, tuple(parts), tuple(last), self.buckets.summed(b))
        for s, seg in zip(slots, sync_segments(self.costs, lay, bucket, self.names), strict=True):
            segments[s] = seg
        if key is not None:
            self._buckets_built[key] = (ops, tuple(segments[s] for s in slots))

    def edge_slots(self, segments: list, j: int, edge: Edge, ptasks, ctasks) -> None:
        lay, c, n = self.lay, self.costs, self.names
        p, q, _ = lay.edges[j]
        pf, cf, pb, cb = lay.forward[p], lay.forward[q], lay.backward[p], lay.backward[q]
        ef, eb = lay.edge_forward[j], lay.edge_backward[j]
        segments[ef] = edge_forward_segment(
            c, ef, edge, ptasks, ctasks, (pf, segments[pf]), segments[cf], n
        )
        segments[eb] = edge_backward_segment(
            c, eb, edge, ptasks, ctasks, (cb, segments[cb]), segments[pb], n
        )

    def shared_edge_slots(
        self, segments: list, j: int, configs: tuple, make: Callable[[], tuple]
    ) -> None:
        """``edge_slots`` where ``make()`` gives its arguments (the edge, its producer's
        and consumer's tasks), called only where no edge of its kind and ``configs``
        (both ops' and the producer's sums': ``edge_configs``) was built already; that
        one's segments are moved here."""
        lay = self.lay
        p, q, _ = lay.edges[j]
        # An edge of a run's member feeds its host's slot at places that depend on the
        # other members' configs: built for its own edge alone (delta simulation keys
        # it by the run's configs too).
        if self.kinds is None or self.names or p in lay.runs or q in lay.runs:
            self.edge_slots(segments, j, *make())
            return
        ef, eb = lay.edge_forward[j], lay.edge_backward[j]
        key = (self.kinds.edges[j], *configs)
        found = self._edges_built.get(key)
        if found is None:
            self.edge_slots(segments, j, *make())
            self._edges_built[key] = (j, (segments[ef], segments[eb]))
            return
        j0, (fwd, bwd) = found
        if j0 == j:
            segments[ef], segments[eb] = fwd, bwd
            return
        (p0, q0, _), (p, q, _) = lay.edges[j0], lay.edges[j]
        ahead = {lay.edge_forward[j0]: ef, lay.forward[p0]: lay.forward[p]}
        back = {lay.edge_backward[j0]: eb, lay.backward[q0]: lay.backward[q]}
        segments[ef], segments[eb] = relocated(fwd, ahead), relocated(bwd, back)

    def preds(self, segments: Sequence[Segment], slot_op: tuple[str, int]) -> tuple:
        """Merged predecessors of a compute slot: ("fwd", i) or ("bwd", i)."""
        phase, i = slot_op
        lay = self.lay
        if phase == "fwd":
            return merged_preds(
                segments[lay.forward[i]],
                [segments[lay.edge_forward[j]] for j in lay.fed_forward(i)],
            )
        return merged_preds(
            segments[lay.backward[i]],
            [segments[lay.edge_backward[j]] for j in lay.fed_backward(i)],
        )


def _op_moves(lay: Layout, i0: int, i: int):
    """(slot of op ``i0``, the same slot of op ``i``) for each of an op's slots."""
    return zip(lay.of_op(i0), lay.of_op(i), strict=True)


def all_segments(builder: SlotBuilder, pg: PartitionedGraph) -> list[AnySegment]:
    """Every slot's segment for ``pg``."""
    lay, ops = builder.lay, pg.graph.ops
    segments: list[AnySegment] = [EMPTY] * lay.size
    parts = [op_parts(pg, op) for op in ops]
    for i in range(len(ops)):
        run = lay.runs.get(i)
        if run is None:
            builder.op_slots(segments, i, parts[i])
        elif i == run[0]:
            builder.run_slots(segments, run, [parts[m] for m in run])
    for b, bucket in enumerate(builder.buckets.ops):
        builder.bucket_slots(segments, b, [parts[i] for i in bucket])
    for j, edge in enumerate(pg.edges):
        p, c = edge.producer, edge.consumer
        configs = edge_configs(pg.strategy[p], pg.strategy[c], pg.sums[p])
        builder.shared_edge_slots(
            segments, j, configs, lambda e=edge: (e, pg.tasks[e.producer], pg.tasks[e.consumer])
        )
    return segments


def _source(segment: AnySegment) -> tuple[Segment, Mapping[int, int] | None]:
    """The segment a slot's tasks were built in, and the move from its slots (None: the
    slot's own)."""
    if isinstance(segment, Moved):
        return segment.source, segment.moves
    return segment, None


def slot_refs(lay: Layout, segments: Sequence[AnySegment], sources: Sources) -> list[Refs]:
    """Every slot's predecessors as arrays: a compute slot's merged with what its edges'
    feeds bring (``merged_preds``' order)."""
    refs = [sources.refs(*_source(s)) for s in segments]

    def feeds(slots: Sequence[int]) -> list[Feeds]:
        return [sources.feeds(*_source(segments[s])) for s in slots]

    for i in range(len(lay.forward)):
        f, b = lay.forward[i], lay.backward[i]
        refs[f] = merged(refs[f], feeds([lay.edge_forward[j] for j in lay.fed_forward(i)]))
        refs[b] = merged(refs[b], feeds([lay.edge_backward[j] for j in lay.fed_backward(i)]))
    return refs


def flatten(
    segments: Sequence[AnySegment],
    preds: Sequence[tuple | Refs],
    machine: Machine,
    names: bool,
    sources: Sources | None = None,
) -> TaskGraph:
    """One task graph of the slots' tasks in slot order; ``preds``: per slot, its tasks'
    predecessors (``Ref`` tuples, or ``Refs``); ``sources``: the segments' arrays made
    already (``slot_refs``')."""
    sources = sources or Sources()
    tasks = [sources.tasks(_source(s)[0]) for s in segments]
    offsets = np.zeros(len(segments) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(t.duration) for t in tasks])
    refs = [p if isinstance(p, Refs) else refs_of(p) for p in preds]

    def joined(field: str, dtype) -> np.ndarray:
        return np.concatenate([np.zeros(0, dtype), *(getattr(t, field) for t in tasks)])

    return TaskGraph(
        duration=joined("duration", np.float64),
        kind=joined("kind", np.int8),
        nbytes=joined("nbytes", np.int64),
        res_ptr=_ptr(joined("res_counts", np.int64)),
        res_idx=joined("res_idx", np.int64),
        pred_ptr=_ptr(np.concatenate([np.zeros(0, np.int64), *(r.counts for r in refs)])),
        pred_idx=np.concatenate([np.zeros(0, np.int64), *(r.numbered(offsets) for r in refs)]),
        num_resources=machine.resources,
        names=tuple(x for s in segments for x in s.names) if names else (),
        resume=machine.resume,
        cooling=machine.cooling,
        devices=machine.size,
        turns=tuple(machine.core(d) for d in range(machine.size)) if machine.shares_cores else None,
        cores_copy=machine.transfers_use_compute,
    )


def _ptr(counts: np.ndarray) -> np.ndarray:
    ptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr


def check_devices(pg: PartitionedGraph, machine: Machine) -> None:
    if pg.strategy.devices > machine.size:
        raise PlanError(
            f"the plan uses {pg.strategy.devices} devices but machine '{machine.name}' has "
            f"{machine.size}"
        )


def build_task_graph(
    pg: PartitionedGraph,
    machine: Machine,
    cost: CostModel,
    itemsize: int = 4,
    names: bool = False,
    memo: Memo | None = None,
    zero: Zero | ZeroStage = ZeroStage.NONE,
    recompute: frozenset[str] = frozenset(),
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> TaskGraph:
    zero = Zero.of(zero)
    costs = Costs(machine, cost, itemsize, memo or Memo(), zero, recompute, bucket_mb=bucket_mb)
    return build_with_slots(pg, costs, names)[0]


def build_with_slots(
    pg: PartitionedGraph, costs: Costs, names: bool = False
) -> tuple[TaskGraph, Layout, np.ndarray]:
    """The task graph, the graph's slots and each task's slot (a pipeline's pricing
    times the slots of each stage and phase apart: ``pipeline_price.py``)."""
    check_devices(pg, costs.machine)
    costs.memo.bind(pg.graph)
    lay = layout(pg.graph)
    kinds = slot_kinds(pg.graph, lay, costs.recompute, costs.zero)
    buckets = gradient_buckets(pg.graph, costs.bucket_mb)
    builder = SlotBuilder(costs, lay, names, kinds, buckets)
    segments = all_segments(builder, pg)
    sources = Sources()
    tg = flatten(segments, slot_refs(lay, segments, sources), costs.machine, names, sources)
    sizes = [len(seg.duration) for seg in segments]
    return tg, builder.lay, np.repeat(np.arange(len(segments)), sizes)
