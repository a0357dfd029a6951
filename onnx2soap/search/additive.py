"""An additive cost of a strategy, op by op and edge by edge: what Alpa's intra-operator
ILP minimizes (search/ilp.py), priced with the simulator's own costs.

- an op under a config costs the busiest of its devices: its tasks' forward and
  backward (the simulator's cost model), the rings of its partial sums, statistics and
  weight gradients (the simulator's ring times, ``taskgraph.Costs.ring``), the updates
  of its weight shards; its partial sums priced all-reduced;
- an edge under its two configs costs the resharding: every overlap that crosses
  devices (the partition math's, as the executor sends them) at its route's time, summed
  per sending and per receiving device, the busiest of them; twice where a gradient
  flows back the same way;
- a partial sum reduce-scatters where its readers need disjoint chunks of it
  (``soap/sum_scatter.py`` decides, from the op's config and its readers'): then its
  collective is the simulator's reduce-scatter forward and all-gather backward, and each
  crossing piece comes from its chunk's holder. The op's term keeps the all-reduce (it
  cannot see its readers); the difference (the collective's *correction*: a saving
  where the chunks are even, a loss where one dwarfs the others, since every ring step
  lasts as long as its largest chunk's send; and the pieces' sources) is priced where
  the readers' configs are known: on the edge where one op reads the sum (Megatron's
  row-parallel linear and its bias add or residual), else on a *joint* term over the op
  and all its readers (``Joint``), since the decision then depends on all of their
  configs at once;
- an op under a config holds, per device, what the memory model says it holds to the
  end of the step (``memory.op_held``).

The simulator schedules: it overlaps transfers with compute and ops on different
devices with each other, so its step is not this sum. The sum is what makes one binary
choice per op and a cost per pair of choices an integer program; the ILP's plan is then
simulated like any other.

Alpa shrinks its graph by merging lightweight ops (elementwise, transposes, reductions)
into their deepest operand; here an op without weights, statistics or partial sums
*follows* its latest producer: given the producer's config it takes the config of its
own that costs least with the edge between them, so its choice is a function of the op
it follows, and only the others are decisions (``Decisions``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from onnx2soap.ir import Graph, Op, TensorRole
from onnx2soap.sim import Simulator
from onnx2soap.sim.memory import op_held
from onnx2soap.sim.taskgraph import Costs, OpParts, graph_edges
from onnx2soap.soap import ParallelConfig, Partitioner, SoapDim, Strategy, candidates
from onnx2soap.soap.collectives import all_gather_steps, reduce_scatter_steps
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.partition import (
    Rect,
    SumGroup,
    Task,
    copy_groups,
    owners,
    stat_groups,
    sum_groups,
)
from onnx2soap.soap.sum_scatter import scattered

Space = Mapping[str, tuple[SoapDim, ...]]


def mesh_configs(
    dims: Sequence[SoapDim], devices: int, mesh_only: bool, copies: bool = False
) -> tuple[ParallelConfig, ...]:
    """The configs an op chooses among: on a block of devices starting at device 0 (the
    device mesh; a block elsewhere is the same split, moved). ``mesh_only``: as Alpa's
    intra-op pass, which maps a tensor's dims onto the two axes of a logical 2-D mesh,
    those that split at most two dims into the most tasks the op can have (every device,
    where its dims allow), and the op whole on device 0. ``copies``: a weight-only op,
    whose candidates include copies (``candidates``)."""
    found = [c for c in candidates(dims, devices, copies) if c.devices[0] == 0]
    if not mesh_only:
        return tuple(found)
    most = max(c.tasks for c in found)
    return tuple(
        c for c in found if c.tasks == 1 or (c.tasks == most and sum(d > 1 for d in c.degrees) <= 2)
    )


def _signature(graph: Graph, op: Op) -> tuple:
    """What an op's costs depend on besides its config: identical layers share them. The
    loop nest names its operands' tensors, which differ from layer to layer: each name
    becomes its first position among the op's inputs (so ``x * x`` stays apart from
    ``x * y``)."""
    tensors = [graph.tensors[t] for t in op.inputs]
    try:
        hash(op.attrs)
        attrs = op.attrs
    except TypeError:
        attrs = op.name
    first = {name: f"#{i}" for i, name in reversed(list(enumerate(op.inputs)))}
    operands = tuple(replace(o, tensor=first.get(o.tensor, o.tensor)) for o in op.nest.inputs)
    return (
        op.type,
        attrs,
        replace(op.nest, inputs=operands),
        op.is_loss,
        tuple((t.shape, t.dtype, t.role) for t in tensors),
        graph.tensors[op.output].dtype,
        graph.differentiable(op.output),
    )


@dataclass(frozen=True)
class Joint:
    """A summing op read by several ops: whether its sums reduce-scatter depends on all
    their configs at once (``sum_scatter``), so the collective's correction and every
    edge from the op are one term over the op's config and its readers'."""

    producer: str
    readers: tuple[str, ...]  # distinct, in graph order
    edges: tuple[int, ...]  # ``graph_edges`` indices of the edges from ``producer``

    @property
    def ops(self) -> tuple[str, ...]:
        return (self.producer, *self.readers)


class AdditiveCost:
    """Costs of ops, edges and joint terms under configs, memoized by what they depend
    on. A strategy's cost: every op's, every ``pairwise`` edge's, every ``joints``'."""

    def __init__(self, graph: Graph, simulator: Simulator) -> None:
        self.graph, self.simulator = graph, simulator
        self.machine = simulator.machine
        simulator.memo.bind(graph)
        self.costs = Costs(
            simulator.machine,
            simulator.cost,
            simulator.itemsize,
            simulator.memo,
            stored_itemsize=simulator.stored_itemsize,
        )
        self.partitioner = Partitioner(graph)
        self.ops = {op.name: op for op in graph.ops}
        self.index = {op.name: i for i, op in enumerate(graph.ops)}
        self.edges = tuple(
            (graph.ops[p].name, graph.ops[c].name, k) for p, c, k in graph_edges(graph)
        )
        self._layout_sums()
        # a number per distinct signature: keys hash fast (a LoopNest hashes deep)
        interned: dict[tuple, int] = {}
        self._signatures = {
            op.name: interned.setdefault(_signature(graph, op), len(interned)) for op in graph.ops
        }
        self._op: dict[tuple, float] = {}
        self._held: dict[tuple, tuple[int, ...]] = {}
        self._edge: dict[tuple, float] = {}
        self._joint: dict[tuple, float] = {}
        self._correction_memo: dict[tuple, float] = {}
        self._floor: dict[tuple, float] = {}
        self._tile_memo: dict[tuple, Tiles] = {}
        self._region_memo: dict[tuple, Regions] = {}

    def _layout_sums(self) -> None:
        """Where each summing op's decision is priced: on its edges where one op reads it
        (the first edge carries the correction), else on a ``Joint``."""
        outgoing: dict[str, list[int]] = {}
        for j, (p, _, _) in enumerate(self.edges):
            outgoing.setdefault(p, []).append(j)
        joints, carries = [], set()
        for p, js in outgoing.items():
            if not self.ops[p].nest.partial_dims:
                continue
            readers = tuple(dict.fromkeys(self.edges[j][1] for j in js))
            if len(readers) > 1:
                joints.append(Joint(p, readers, tuple(js)))
            else:
                carries.add(js[0])
        self.joints: tuple[Joint, ...] = tuple(joints)
        in_joints = {j for t in joints for j in t.edges}
        self.pairwise = tuple(j for j in range(len(self.edges)) if j not in in_joints)
        self._carries = frozenset(carries)
        # per edge, the consumer's operands that read the producer's output: a sum's
        # decision reads them all (x * x reads it twice)
        self._reads = tuple(
            tuple(k for k, t in enumerate(self.ops[c].inputs) if t == self.ops[p].output)
            for p, c, _ in self.edges
        )
        self._decides = tuple(
            bool(self.ops[p].nest.partial_dims) and j not in in_joints
            for j, (p, _, _) in enumerate(self.edges)
        )

    def op(self, name: str, config: ParallelConfig) -> float:
        """Seconds of an op under a config, its partial sums all-reduced."""
        key = (self._signatures[name], config)
        if key not in self._op:
            self._op[key] = self._op_cost(self.ops[name], config)
        return self._op[key]

    def op_held(self, name: str, config: ParallelConfig) -> tuple[int, ...]:
        """Bytes per device an op under a config holds to the end of the step."""
        key = (self._signatures[name], config)
        if key not in self._held:
            op, p, sim = self.ops[name], self.partitioner, self.simulator
            held = [0] * self.machine.size
            pieces = op_held(
                self.graph,
                op,
                p.tasks(op, config),
                p.groups(op, config),
                sim.itemsize,
                sim.shard_slots,
                sim.host_objects,
                sim.rounding_bytes,
            )
            for d, n in pieces:
                held[d] += n
            self._held[key] = tuple(held)
        return self._held[key]

    def _op_cost(
        self, op: Op, config: ParallelConfig, sums: tuple[SumGroup, ...] | None = None
    ) -> float:
        """``sums``: the op's sum groups as decided (None: all-reduced; (): priced
        without their collectives, a lower bound)."""
        graph, sim, costs = self.graph, self.simulator, self.costs
        p = self.partitioner
        tasks = p.tasks(op, config)
        groups = p.groups(op, config)
        sums = sum_groups(op, tasks) if sums is None else sums
        parts = OpParts(op, config, tasks, groups, stat_groups(op, tasks), sums)
        backward = graph.differentiable(op.output)
        forward_s, backward_s = costs.durations(parts)
        busy = [0.0] * self.machine.size
        for t, f, b in zip(tasks, forward_s, backward_s, strict=True):
            busy[t.device] += f + (b if backward else 0.0)

        def ring(devices: tuple[int, ...], numel: int) -> None:
            if len(devices) > 1:
                seconds = costs.ring(devices, numel)[0]
                for d in devices:
                    busy[d] += seconds

        for group in parts.stats:
            ring(group.devices, group.numel[0])
            if backward:
                ring(group.devices, group.numel[1])
        for group in sums:
            for seconds in self._sum_rings(group, backward):
                for d in group.devices:
                    busy[d] += seconds
        for group in groups:
            if not group.trainable:
                continue
            numel = math.prod(hi - lo for lo, hi in group.rect)
            if backward:
                ring(group.devices, numel)
            for d in group.devices:
                busy[d] += sim.cost.update(numel, self.machine.devices[d], sim.itemsize)
        return max(busy)

    def _sum_rings(self, group: SumGroup, backward: bool) -> tuple[float, ...]:
        """Seconds of a sum group's collective forward (and backward), as the simulator
        times them (``taskgraph._sum_ring``): the all-reduce of the tile each way, or
        where it reduce-scatters the ring's halves over the chunks' runs, the
        reduce-scatter forward and the all-gather of the chunks' gradients backward."""
        if len(group.devices) < 2:
            return ()
        if group.scatter is None:
            seconds = self.costs.ring(group.devices, group.numel)[0]
            return (seconds, seconds) if backward else (seconds,)
        runs = group.scatter.runs(group.tile)
        halves = (reduce_scatter_steps, all_gather_steps) if backward else (reduce_scatter_steps,)
        width = self.costs.itemsize  # partial sums are float32
        return tuple(self.costs.half_ring(group.devices, runs, h, width)[0] for h in halves)

    def _sums(
        self, name: str, config: ParallelConfig, readers: Sequence[tuple[str, ParallelConfig, int]]
    ) -> tuple[SumGroup, ...]:
        """The op's sum groups under ``config`` as ``sum_scatter`` decides them from its
        readers: (consumer, its config, the operand that reads the sum)."""
        op, p = self.ops[name], self.partitioner
        base = sum_groups(op, p.tasks(op, config))
        if not base:
            return ()
        return scattered(base, [(p.tasks(self.ops[c], cc), k) for c, cc, k in readers])

    def _correction(self, name: str, config: ParallelConfig, sums: tuple[SumGroup, ...]) -> float:
        """What the op's term costs less (or more) with ``sums`` than all-reduced."""
        scatters = tuple(g.scatter for g in sums)
        if not any(s is not None for s in scatters):
            return 0.0
        key = (self._signatures[name], config, scatters)
        if key not in self._correction_memo:
            seconds = self._op_cost(self.ops[name], config, sums) - self.op(name, config)
            self._correction_memo[key] = seconds
        return self._correction_memo[key]

    def edge(self, j: int, pconf: ParallelConfig, cconf: ParallelConfig) -> float:
        """Edge ``j`` (``graph_edges`` order) between its ops under these configs. Where
        its consumer is the only op reading a partial sum, the sum is decided here and
        the producer's first edge carries the collective's correction. An edge of a
        ``Joint`` is priced with the sums all-reduced, as a guide for the op that follows
        along it (``Decisions._follow``) only: its ``joint`` term prices it."""
        producer, consumer, operand = self.edges[j]
        key = (
            self._signatures[producer],
            pconf,
            self._signatures[consumer],
            cconf,
            operand,
            self._reads[j] if self._decides[j] else None,
            j in self._carries,
        )
        if key not in self._edge:
            self._edge[key] = self._edge_cost(j, pconf, cconf)
        return self._edge[key]

    def _edge_cost(self, j: int, pconf: ParallelConfig, cconf: ParallelConfig) -> float:
        producer, consumer, _ = self.edges[j]
        if not self._decides[j]:
            return self._crossing_s(j, pconf, cconf, None)
        sums = self._sums(producer, pconf, [(consumer, cconf, k) for k in self._reads[j]])
        seconds = self._crossing_s(j, pconf, cconf, sums)
        if j in self._carries:
            seconds += self._correction(producer, pconf, sums)
        return seconds

    def edge_floor(self, j: int, pconf: ParallelConfig) -> float:
        """A lower bound of ``edge(j, pconf, c)`` over every ``c``: 0, or where the edge
        carries a correction, the most the producer's term can lose: its sums' rings."""
        if j not in self._carries:
            return 0.0
        producer = self.edges[j][0]
        key = (self._signatures[producer], pconf)
        if key not in self._floor:
            bare = self._op_cost(self.ops[producer], pconf, ())
            self._floor[key] = min(0.0, bare - self.op(producer, pconf))
        return self._floor[key]

    def joint(self, i: int, configs: Mapping[str, ParallelConfig]) -> float:
        """Joint term ``i`` (``joints``) under its ops' configs: the collective's
        correction and every edge from its producer, its sums decided from all its
        readers."""
        t = self.joints[i]
        pconf = configs[t.producer]
        readers = tuple(
            (self.edges[j][1], configs[self.edges[j][1]], self.edges[j][2]) for j in t.edges
        )
        key = (
            self._signatures[t.producer],
            pconf,
            tuple((self._signatures[c], cc, k) for c, cc, k in readers),
        )
        if key not in self._joint:
            sums = self._sums(t.producer, pconf, readers)
            seconds = self._correction(t.producer, pconf, sums)
            for j, (_, cc, _) in zip(t.edges, readers, strict=True):
                seconds += self._crossing_s(j, pconf, cc, sums)
            self._joint[key] = seconds
        return self._joint[key]

    def _crossing_s(
        self,
        j: int,
        pconf: ParallelConfig,
        cconf: ParallelConfig,
        sums: tuple[SumGroup, ...] | None,
    ) -> float:
        """The resharding of edge ``j``: its crossing pieces at their routes' times, the
        busiest sender's or receiver's; twice where a gradient flows back."""
        producer, consumer, operand = self.edges[j]
        tensor = self.graph.tensors[self.ops[consumer].inputs[operand]]
        src, dst, volume = crossing_pieces(
            self._tiles(producer, pconf, sums), self._regions(consumer, cconf, operand)
        )
        if not len(volume):
            return 0.0
        width = self.costs.edge_width(tensor.name)
        latency, bandwidth = self._routes
        seconds = latency[src, dst] + volume * width / bandwidth[src, dst]
        n = self.machine.size
        busiest = max(
            np.bincount(src, seconds, minlength=n).max(),
            np.bincount(dst, seconds, minlength=n).max(),
        )
        return float(busiest) * (2 if self.graph.differentiable(tensor.name) else 1)

    def _tiles(self, name: str, config: ParallelConfig, sums: tuple[SumGroup, ...] | None) -> Tiles:
        scatters = None if sums is None else tuple(g.scatter for g in sums)
        key = (self._signatures[name], config, scatters)
        if key not in self._tile_memo:
            op = self.ops[name]
            ptasks = self.partitioner.tasks(op, config)
            self._tile_memo[key] = tiles(op, ptasks, self.machine.size, sums)
        return self._tile_memo[key]

    def _regions(self, name: str, config: ParallelConfig, operand: int) -> Regions:
        key = (self._signatures[name], config, operand)
        if key not in self._region_memo:
            op = self.ops[name]
            self._region_memo[key] = regions(self.partitioner.tasks(op, config), operand)
        return self._region_memo[key]

    @cached_property
    def _routes(self) -> tuple[np.ndarray, np.ndarray]:
        """Per device pair, a transfer's latency and bandwidth (``Machine.transfer_time``'s
        terms: every link's latency, the slowest link's rate)."""
        m, n = self.machine, self.machine.size
        latency, bandwidth = np.zeros((n, n)), np.ones((n, n))
        for a in range(n):
            for b in range(n):
                if a != b:
                    links = [m.links[i] for i in m.route(a, b)]
                    latency[a, b] = sum(x.latency for x in links)
                    bandwidth[a, b] = min(x.bandwidth for x in links)
        return latency, bandwidth

    def strategy(self, strategy: Strategy) -> float:
        """The additive cost of a whole strategy: every op's, every pairwise edge's and
        every joint term's."""
        total = sum(self.op(n, strategy[n]) for n in self.ops)
        for j in self.pairwise:
            p, c, _ = self.edges[j]
            total += self.edge(j, strategy[p], strategy[c])
        configs = {n: strategy[n] for n in self.ops}
        total += sum(self.joint(i, configs) for i in range(len(self.joints)))
        return total

    def held(self, strategy: Strategy) -> tuple[int, ...]:
        """Bytes per device the ops hold under ``strategy`` (the memory rows' sum)."""
        total = [0] * self.machine.size
        for n in self.ops:
            for d, b in enumerate(self.op_held(n, strategy[n])):
                total[d] += b
        return tuple(total)


@dataclass(frozen=True)
class Tiles:
    """A producer's output tiles under one config, as arrays: per tile its rect, its
    owner's device, and the devices that hold it (a partial sum's group, a copied box's
    copies, else the owner's)."""

    lo: np.ndarray  # [tile, axis]
    hi: np.ndarray
    device: np.ndarray  # [tile]
    holds: np.ndarray  # bool [tile, device]


@dataclass(frozen=True)
class Regions:
    """A consumer's data regions of one operand under one config, as arrays."""

    lo: np.ndarray  # [task, axis]
    hi: np.ndarray
    device: np.ndarray  # [task]


def tiles(
    producer: Op, ptasks: Sequence[Task], devices: int, sums: Sequence[SumGroup] | None = None
) -> Tiles:
    """``sums``: the producer's sum groups as decided (None: ``sum_groups``', all
    all-reduced). A reduce-scattered group's tile is its chunks, each a tile held by its
    holder alone (``partition.summed_overlaps``: a piece comes from its chunk's holder)."""
    sums = sum_groups(producer, ptasks) if sums is None else sums
    group_of = {g.owner: g for g in sums}
    copied = copy_groups(ptasks)  # a box's copies: its readers read the local one
    rects: list[Rect] = []
    device: list[int] = []
    holders: list[tuple[int, ...]] = []
    for t in owners(producer, ptasks):
        group = group_of.get(t.index)
        if group is not None and group.scatter is not None:
            for d, chunk in zip(group.devices, group.scatter.chunks, strict=True):
                rects.append(chunk)
                device.append(d)
                holders.append((d,))
        else:
            rects.append(t.output)
            device.append(t.device)
            held = tuple(copied[t.index]) if copied else (t.device,)
            holders.append(group.devices if group is not None else held)
    holds = np.zeros((len(rects), devices), dtype=bool)
    for i, ds in enumerate(holders):
        holds[i, list(ds)] = True
    rank = len(rects[0]) if rects else 0
    lo = np.array([[lo for lo, _ in r] for r in rects], dtype=np.int64)
    hi = np.array([[hi for _, hi in r] for r in rects], dtype=np.int64)
    return Tiles(
        lo.reshape(len(rects), rank),
        hi.reshape(len(rects), rank),
        np.array(device, dtype=np.int64),
        holds,
    )


def regions(ctasks: Sequence[Task], operand: int) -> Regions:
    data = [t.inputs[operand].data for t in ctasks]
    rank = len(data[0]) if data else 0
    lo = np.array([[lo for lo, _ in r] for r in data], dtype=np.int64)
    hi = np.array([[hi for _, hi in r] for r in data], dtype=np.int64)
    device = np.array([t.device for t in ctasks], dtype=np.int64)
    return Regions(lo.reshape(len(data), rank), hi.reshape(len(data), rank), device)


def crossing_pieces(t: Tiles, r: Regions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source devices, destination devices, element counts) of the pieces of an edge
    that cross devices: ``PartitionedGraph.moves``' overlaps, computed at once over every
    pair of a producer's tile and a consumer's region (the same interval arithmetic as
    ``partition.overlaps``, vectorized; ``tests/search/test_ilp.py`` checks them equal).
    A partial sum's tile comes from its holder on the consumer's device where its group
    has one (no piece crosses), else from its owner; a reduce-scattered one's pieces from
    their chunks' holders (``partition.summed_overlaps``; ``tiles`` lays them out)."""
    volume = np.ones((len(t.device), len(r.device)), dtype=np.int64)  # [tile, consumer task]
    for a in range(t.lo.shape[1]):  # axis by axis: no [tile, task, axis] temporaries
        extent = np.minimum(t.hi[:, a, None], r.hi[None, :, a])
        extent -= np.maximum(t.lo[:, a, None], r.lo[None, :, a])
        np.maximum(extent, 0, out=extent)
        volume *= extent
    i, j = np.nonzero((volume > 0) & ~t.holds[:, r.device])
    return t.device[i], r.device[j], volume[i, j]


def crossing(
    producer: Op,
    ptasks: Sequence[Task],
    ctasks: Sequence[Task],
    operand: int,
    sums: Sequence[SumGroup] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``crossing_pieces`` of one edge's tasks; ``sums``: the producer's sum groups as
    decided (None: all-reduced)."""
    devices = 1 + max(t.device for t in (*ptasks, *ctasks))
    return crossing_pieces(tiles(producer, ptasks, devices, sums), regions(ctasks, operand))


def lightweight(graph: Graph, op: Op) -> bool:
    """An op that follows its producer (Alpa merges such ops into their operand): no
    weights or state, no statistics, no partial sums, not the loss."""
    roles = (TensorRole.WEIGHT, TensorRole.STATE)
    return (
        not op.is_loss
        and not op.nest.sync_dims
        and not op.nest.partial_dims
        and not any(graph.tensors[t].role in roles for t in op.inputs)
    )


def followed(graph: Graph) -> dict[str, str]:
    """Per lightweight op that reads another op's output, the op it follows: the latest
    such producer in graph order (Alpa: its deepest operand)."""
    index = {op.name: i for i, op in enumerate(graph.ops)}
    producer = {op.output: op.name for op in graph.ops}
    follows = {}
    for op in graph.ops:
        sources = [producer[t] for t in op.inputs if t in producer]
        if sources and lightweight(graph, op):
            follows[op.name] = max(sources, key=index.__getitem__)
    return follows


class Decisions:
    """The ops that decide (the others follow), their configs, and the strategy a choice
    of them induces."""

    def __init__(
        self,
        graph: Graph,
        space: Space,
        model: AdditiveCost,
        mesh_only: bool = True,
        merge: bool = True,
    ) -> None:
        self.graph, self.model = graph, model
        devices, copied = model.machine.size, weight_only_ops(graph)
        self.configs = {
            op.name: mesh_configs(space[op.name], devices, mesh_only, op.name in copied)
            for op in graph.ops
        }
        # follows[f] = the latest op whose output f reads (Alpa: its deepest operand)
        self.follows: dict[str, str] = followed(graph) if merge else {}
        self.leader = {}
        for op in graph.ops:
            name = op.name
            self.leader[name] = self.leader[self.follows[name]] if name in self.follows else name
        self.deciders = tuple(op.name for op in graph.ops if op.name not in self.follows)
        self.members: dict[str, list[str]] = {n: [] for n in self.deciders}
        for op in graph.ops:
            if op.name in self.follows:
                self.members[self.leader[op.name]].append(op.name)
        # the edge from the op a follower follows (its choice is made along it)
        self._along: dict[str, int] = {}
        for j, (p, c, _) in enumerate(model.edges):
            if self.follows.get(c) == p and c not in self._along:
                self._along[c] = j
        self._induced: dict[tuple[str, ParallelConfig], dict[str, ParallelConfig]] = {}
        self._ranked: dict[str, list[tuple[float, int, ParallelConfig]]] = {}

    def induced(self, leader: str, config: ParallelConfig) -> Mapping[str, ParallelConfig]:
        """The configs of ``leader``'s group when it takes ``config``: each follower, in
        graph order, the config of its own that costs least with the edge from the op it
        follows (ties: the cheaper op, then candidate order)."""
        key = (leader, config)
        if key not in self._induced:
            chosen = {leader: config}
            for name in self.members[leader]:
                chosen[name] = self._follow(name, chosen[self.follows[name]])
            self._induced[key] = chosen
        return self._induced[key]

    def _follow(self, name: str, given: ParallelConfig) -> ParallelConfig:
        """The follower's config costing least with the edge from ``given``: tried in
        order of its own cost, which with the edge's floor (below 0 where the edge
        carries a sum's correction) bounds the sum from below, until none can win."""
        j, model = self._along[name], self.model
        floor = model.edge_floor(j, given)
        best, best_cost = None, math.inf
        for own, _, c in self._by_cost(name):
            if own + floor >= best_cost:
                break
            total = own + model.edge(j, given, c)
            if total < best_cost:
                best, best_cost = c, total
        assert best is not None
        return best

    def _by_cost(self, name: str) -> list[tuple[float, int, ParallelConfig]]:
        if name not in self._ranked:
            configs = self.configs[name]
            self._ranked[name] = sorted(
                (self.model.op(name, c), k, c) for k, c in enumerate(configs)
            )
        return self._ranked[name]

    def strategy(self, choice: Mapping[str, ParallelConfig]) -> Strategy:
        configs: dict[str, ParallelConfig] = {}
        for leader, config in choice.items():
            configs.update(self.induced(leader, config))
        return Strategy(self.model.machine.size, configs)

    def leaders(self, ops: Sequence[str]) -> tuple[str, ...]:
        """The distinct leaders deciding ``ops``, in the order of ``deciders``."""
        mine = {self.leader[n] for n in ops}
        return tuple(n for n in self.deciders if n in mine)

    @cached_property
    def _internal(self) -> dict[str, tuple[list[int], list[int]]]:
        """Per leader, the pairwise edges and the joint terms within its group (every
        op of them decided by it)."""
        model = self.model
        found: dict[str, tuple[list[int], list[int]]] = {n: ([], []) for n in self.deciders}
        for j in model.pairwise:
            p, c, _ = model.edges[j]
            if self.leader[p] == self.leader[c]:
                found[self.leader[p]][0].append(j)
        for i, t in enumerate(model.joints):
            inside = self.leaders(t.ops)
            if len(inside) == 1:
                found[inside[0]][1].append(i)
        return found

    def group(self, leader: str, config: ParallelConfig) -> float:
        """The group's seconds under ``config``: its ops', its internal edges' and its
        internal joint terms'."""
        induced = self.induced(leader, config)
        model = self.model
        seconds = sum(model.op(name, c) for name, c in induced.items())
        edges, joints = self._internal[leader]
        for j in edges:
            p, c, _ = model.edges[j]
            seconds += model.edge(j, induced[p], induced[c])
        for i in joints:
            seconds += model.joint(i, induced)
        return seconds

    def configs_of(
        self, ops: Sequence[str], choice: Mapping[str, ParallelConfig]
    ) -> dict[str, ParallelConfig]:
        """The configs of ``ops`` when their leaders take ``choice``."""
        return {n: self.induced(self.leader[n], choice[self.leader[n]])[n] for n in ops}

    def group_held(self, leader: str, config: ParallelConfig) -> tuple[int, ...]:
        """Bytes per device the group's ops hold under ``config``."""
        held = [0] * self.model.machine.size
        for name, c in self.induced(leader, config).items():
            for d, b in enumerate(self.model.op_held(name, c)):
                held[d] += b
        return tuple(held)
