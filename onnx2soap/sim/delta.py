"""Delta simulation (FlexFlow §5.3): after a proposal changes one op's config, rebuild
only the slots it affects and re-time only from the first of them on.

Every resource runs its tasks in program order (``simulate.py``), so a timeline is a
longest-path pass over slots in order. A ``DeltaState`` keeps, per slot, its segment and
its tasks' end times (a start follows from them), and a checkpoint (every resource's last
end, and the latest end) before each slot where a re-run can begin: the first slot a
one-op change touches is always the op's forward slot or one of its incoming edges'
forward slots, so only the forward region is checkpointed. Evaluating a strategy from a
base state rebuilds the slots of the changed ops and of their edges, and the weight and
update slots of their gradient buckets (segments are memoized by the configs they depend
on), and re-runs the pass from the checkpoint at or before the first changed slot with
the same float operations as ``simulate``: the times are bit-identical to a full
simulation. Memory is summed per op, per edge and for the batch from the same pieces
``memory.py`` counts, and updated by exact integer differences; the buckets' rings' per
bucket (``bucket_memory.py``).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from onnx2soap.ir import TensorRole
from onnx2soap.sim import Evaluation, Simulator
from onnx2soap.sim.bucket_memory import Widest, bucket_sums, ring_scratch, widest
from onnx2soap.sim.heap import collector_paused
from onnx2soap.sim.memory import (
    EdgeMemory,
    OpMemory,
    Pieces,
    _edge_bytes,
    _op_bytes,
    batch_bytes,
    edge_totals,
    memory_key,
    order_of,
    total,
)
from onnx2soap.sim.simulate import Timeline, Wakes, run_task
from onnx2soap.sim.taskgraph import (
    EMPTY,
    Costs,
    OpParts,
    Segment,
    SlotBuilder,
    TaskGraph,
    bucket_slots,
    flatten,
    layout,
    slot_kinds,
)
from onnx2soap.soap import Edge, ParallelConfig, PartitionedGraph, Partitioner, Strategy
from onnx2soap.soap.buckets import gradient_buckets
from onnx2soap.soap.partition import SumGroup, stat_groups
from onnx2soap.soap.partitioned import edge_configs, op_kinds_held
from onnx2soap.soap.recompute import recomputes
from onnx2soap.soap.saved import kept_for_backward
from onnx2soap.soap.streamed import streams_operand


@dataclass(frozen=True)
class DeltaState:
    """One strategy's simulation, slot by slot (treat as immutable: states share lists)."""

    strategy: Strategy
    segments: list[Segment]
    preds: list[tuple]
    ends: list[Sequence[float]]  # per slot: its tasks' end times
    # per checkpointed slot: every resource's last end before it, the latest end, and
    # what each device owes for a resume and when it last communicated (``simulate.Wakes``;
    # empty on machines with neither a resume nor a cooling)
    checkpoints: dict[int, tuple[Sequence[float], float, tuple[float, ...]]]
    makespan: float
    moved: list[int]  # per slot: bytes moved
    bytes_moved: int
    op_memory: list[OpMemory]  # per op: held and transient (device, bytes)
    edge_memory: list[EdgeMemory]  # per edge
    batch: tuple[int, ...]
    held: tuple[int, ...]  # per device: bytes held to the end of the step
    peak: tuple[int, ...]  # per device: peak memory (held + the largest transient)


class DeltaSimulator:
    """Evaluates strategies of one graph incrementally from a base state."""

    def __init__(self, simulator: Simulator, partitioner: Partitioner) -> None:
        self.simulator, self.partitioner = simulator, partitioner
        self.graph = graph = partitioner.graph
        simulator.memo.bind(graph)
        m = simulator.machine
        self.costs = Costs(
            m,
            simulator.cost,
            simulator.itemsize,
            simulator.memo,
            simulator.zero,
            simulator.recompute,
            simulator.stored_itemsize,
            simulator.bucket_mb,
        )
        self.lay = layout(graph)
        self.kinds = slot_kinds(graph, self.lay, simulator.recompute, simulator.zero)
        self.held_kinds = op_kinds_held(graph, simulator.recompute, simulator.zero)
        self.buckets = gradient_buckets(graph, simulator.bucket_mb)
        self.bucket_of = self.buckets.bucket_of()
        self.builder = SlotBuilder(self.costs, self.lay, kinds=self.kinds, buckets=self.buckets)
        # Per op, the producers of its inputs with partial sums: whether such a sum
        # reduce-scatters depends on its readers' configs (``Partitioner.sums``), so a
        # reader's change rebuilds its producer's slots and edges too.
        self.summing = [
            sorted({p for p, c, _ in self.lay.edges if c == i and graph.ops[p].nest.partial_dims})
            for i in range(len(graph.ops))
        ]
        self.num_resources = m.resources
        self.machine = m
        # The slots where a re-run can begin: the first slot each op's change touches.
        self.entries = sorted(
            {0} | {min(self._touched(self._with_sums([i]))[1]) for i in range(len(graph.ops))}
        )
        self.entry_set = frozenset(self.entries)
        self.op_segments: dict[tuple[int, ParallelConfig], tuple[Segment, ...]] = {}
        self.bucket_segments: dict[tuple, tuple[Segment, ...]] = {}
        self.ring_memory_memo: dict[tuple, Widest] = {}
        self.edge_segments: dict[tuple, tuple[Segment, Segment]] = {}
        self.parts_memo: dict[tuple[int, ParallelConfig], OpParts] = {}
        self.batch_memo: dict[tuple, tuple[int, ...]] = {}
        self.edge_memory_memo: dict[tuple, Pieces] = {}
        tensors = [graph.ops[p].output for p, _, _ in self.lay.edges]
        self.sole = [tensors.count(t) == 1 for t in tensors]  # a tensor's only reader
        roles = (TensorRole.INPUT, TensorRole.LABELS)
        # how long recomputed tiles and gradients live
        self.order = order_of(graph, simulator.bucket_mb)
        self.readers = tuple(
            i
            for i, op in enumerate(graph.ops)
            if any(graph.tensors[t].role in roles for t in op.inputs)
        )

    # -- pieces, memoized by the configs they depend on ---------------------------------

    def _with_sums(self, changed: list[int]) -> list[int]:
        """``changed``, the producers whose sums its ops read (see ``summing``) and the
        other members of their runs of ops with statistics (``Layout.runs``: their slots
        depend on every member's config)."""
        ops = {*changed, *(p for i in changed for p in self.summing[i])}
        runs = self.lay.runs
        return sorted({*ops, *(m for i in ops if i in runs for m in runs[i])})

    def _run_configs(self, i: int, strategy: Strategy) -> tuple:
        """The configs of op ``i``'s run, where it is in one: what its slots and those
        of its edges depend on besides its own."""
        run = self.lay.runs.get(i)
        if run is None:
            return ()
        return tuple(strategy[self.graph.ops[m].name] for m in run)

    def sums(self, i: int, strategy: Strategy) -> tuple[SumGroup, ...]:
        op = self.graph.ops[i]
        return self.partitioner.sums(op, strategy[op.name], strategy)

    def parts(self, i: int, config: ParallelConfig, sums: tuple[SumGroup, ...] = ()) -> OpParts:
        """The op's parts under ``config``; ``sums``: its sum groups as decided under the
        strategy (``sums``), where it has any."""
        key = (i, config, sums)
        if key not in self.parts_memo:
            op, p = self.graph.ops[i], self.partitioner
            tasks = p.tasks(op, config)
            self.parts_memo[key] = OpParts(
                op, config, tasks, p.groups(op, config), stat_groups(op, tasks), sums
            )
        return self.parts_memo[key]

    def edge(self, j: int, strategy: Strategy) -> Edge:
        p, c, k = self.lay.edges[j]
        ops = self.graph.ops
        return self.partitioner.edge(
            ops[p], strategy[ops[p].name], ops[c], strategy[ops[c].name], k, self.sums(p, strategy)
        )

    def _op_slots(self, segments: list, i: int, strategy: Strategy) -> None:
        if i in self.lay.runs:
            self._run_slots(segments, self.lay.runs[i], strategy)
            return
        config, sums = strategy[self.graph.ops[i].name], self.sums(i, strategy)
        key = (i, config, sums)
        slots = (self.lay.forward[i], self.lay.backward[i])
        if key not in self.op_segments:
            self.builder.op_slots(segments, i, self.parts(i, config, sums))
            self.op_segments[key] = tuple(segments[s] for s in slots)
        for s, seg in zip(slots, self.op_segments[key], strict=True):
            segments[s] = seg

    def _run_slots(self, segments: list, run: tuple[int, ...], strategy: Strategy) -> None:
        """A run's forward and backward slots (its members' both), built together."""
        ops = self.graph.ops
        parts = [self.parts(m, strategy[ops[m].name], self.sums(m, strategy)) for m in run]
        key = (run, *((p.config, p.sums) for p in parts))
        slots = [s for m in run for s in (self.lay.forward[m], self.lay.backward[m])]
        if key not in self.op_segments:
            self.builder.run_slots(segments, run, parts)
            self.op_segments[key] = tuple(segments[s] for s in slots)
        for s, seg in zip(slots, self.op_segments[key], strict=True):
            segments[s] = seg

    def _bucket_slots(self, segments: list, b: int, strategy: Strategy) -> None:
        """Bucket ``b``'s weight and update slots, once its ops' backward slots are in
        ``segments``: they depend on every one of its ops' configs (and sums)."""
        ops = self.buckets.ops[b]
        parts = [
            self.parts(i, strategy[self.graph.ops[i].name], self.sums(i, strategy)) for i in ops
        ]
        # a run's member's last tasks stand where the other members' configs put them
        runs = tuple(self._run_configs(i, strategy) for i in ops)
        key = (b, *((p.config, p.sums) for p in parts), runs)
        slots = bucket_slots(self.lay, ops)
        if key not in self.bucket_segments:
            self.builder.bucket_slots(segments, b, parts)
            self.bucket_segments[key] = tuple(segments[s] for s in slots)
        for s, seg in zip(slots, self.bucket_segments[key], strict=True):
            segments[s] = seg

    def _edge_slots(self, segments: list, j: int, strategy: Strategy) -> None:
        p, c, _ = self.lay.edges[j]
        ops = self.graph.ops
        pconf, cconf = strategy[ops[p].name], strategy[ops[c].name]
        configs = edge_configs(pconf, cconf, self.sums(p, strategy))
        key = (j, *configs, self._run_configs(p, strategy), self._run_configs(c, strategy))
        slots = (self.lay.edge_forward[j], self.lay.edge_backward[j])
        if key not in self.edge_segments:

            def make() -> tuple:
                tasks = self.parts(p, pconf).tasks, self.parts(c, cconf).tasks
                return self.edge(j, strategy), *tasks

            self.builder.shared_edge_slots(segments, j, configs, make)
            self.edge_segments[key] = (segments[slots[0]], segments[slots[1]])
        segments[slots[0]], segments[slots[1]] = self.edge_segments[key]

    # -- memory --------------------------------------------------------------------------

    def _op_memory(self, i: int, strategy: Strategy) -> OpMemory:
        op = self.graph.ops[i]
        sums = self.sums(i, strategy)
        key = memory_key(op.name, strategy[op.name], sums)
        memo = self.simulator.memo.memory
        like = (self.held_kinds[op.name], *key[1:])  # as peak_memory shares it
        if key not in memo and like in memo:
            memo[key] = memo[like]
        if key not in memo:
            parts, sim = self.parts(i, key[1], sums), self.simulator
            memo[key] = memo[like] = _op_bytes(
                self.graph,
                op,
                parts.tasks,
                parts.groups,
                sim.itemsize,
                sim.shard_slots,
                sim.host_objects,
                sim.rounding_bytes,
                sim.zero,
                sim.optimizer_slots,
                recomputes(op, parts.sums, sim.recompute),
                sums,
                sim.stored_itemsize,
            )
        return memo[key]

    def _edge_memory(self, j: int, strategy: Strategy) -> EdgeMemory:
        p, c, _ = self.lay.edges[j]
        ops = self.graph.ops
        pconf, cconf = strategy[ops[p].name], strategy[ops[c].name]
        # by the edge's kind: the same edge of every layer holds the same bytes
        sim = self.simulator
        consumer = ops[c]
        redone = recomputes(consumer, self.sums(c, strategy), sim.recompute)
        keeps = self.lay.edges[j][2] in kept_for_backward(self.graph, consumer, redone)[0]
        configs = edge_configs(pconf, cconf, self.sums(p, strategy))
        key = (self.kinds.edges[j], keeps, *configs)
        if key not in self.edge_memory_memo:
            edge = self.edge(j, strategy)
            ptasks, ctasks = self.parts(p, pconf).tasks, self.parts(c, cconf).tasks
            self.edge_memory_memo[key] = _edge_bytes(
                self.graph,
                edge,
                ptasks,
                ctasks,
                sim.itemsize,
                self.sole[j],
                sim.host_objects,
                keeps,
                sim.stored_itemsize,
                streams_operand(consumer, ctasks, self.lay.edges[j][2]),
            )
        return self.edge_memory_memo[key]

    def _batch(self, strategy: Strategy) -> tuple[int, ...]:
        ops = self.graph.ops
        key = tuple(strategy[ops[i].name] for i in self.readers)
        if key not in self.batch_memo:
            tasks = {op.name: () for op in ops}
            for i in self.readers:
                tasks[ops[i].name] = self.parts(i, strategy[ops[i].name]).tasks
            pg = PartitionedGraph(self.graph, strategy, tasks, (), {}, {}, {})
            size = self.simulator.itemsize
            self.batch_memo[key] = tuple(batch_bytes(pg, self.simulator.machine.size, size))
        return self.batch_memo[key]

    # -- evaluation ----------------------------------------------------------------------

    def evaluate(
        self, strategy: Strategy, base: DeltaState | None = None
    ) -> tuple[Evaluation, DeltaState]:
        with collector_paused():  # sim/heap.py: millions of long-lived tuples, no cycles
            return self._evaluate(strategy, base)

    def _evaluate(
        self, strategy: Strategy, base: DeltaState | None
    ) -> tuple[Evaluation, DeltaState]:
        if strategy.devices > self.simulator.machine.size:
            raise ValueError("the strategy uses more devices than the machine has")
        ops = self.graph.ops
        if base is None:
            changed = list(range(len(ops)))
        else:
            old = base.strategy
            # Unchanged configs are shared objects: compare by identity first.
            changed = [
                i
                for i, op in enumerate(ops)
                if (c := strategy[op.name]) is not (b := old[op.name]) and c != b
            ]
        if base is not None and not changed:
            return self._evaluation(base), base
        lay = self.lay
        segments = [EMPTY] * lay.size if base is None else list(base.segments)
        preds = [()] * lay.size if base is None else list(base.preds)
        changed = self._with_sums(changed)
        edges, dirty, targets = self._touched(changed)
        for i in changed:
            self._op_slots(segments, i, strategy)
        for b in self._buckets_of(changed):
            self._bucket_slots(segments, b, strategy)
        for j in edges:
            self._edge_slots(segments, j, strategy)
        for s in dirty:
            preds[s] = segments[s].preds
        for target in targets:
            slot = lay.forward[target[1]] if target[0] == "fwd" else lay.backward[target[1]]
            preds[slot] = self.builder.preds(segments, target)
        state = self._run(strategy, segments, preds, dirty, base)
        state = self._with_memory(state, strategy, changed, edges, base)
        return self._evaluation(state), state

    def _touched(self, changed: list[int]) -> tuple[list[int], set[int], set[tuple[str, int]]]:
        """The edges of the changed ops, every slot whose segment or merged predecessors
        change, and the compute slots whose predecessors are merged anew."""
        lay = self.lay
        edges = sorted({j for i in changed for j in (*lay.outs[i], *lay.ins[i])})
        dirty = {s for i in changed for s in lay.of_op(i)}
        for b in self._buckets_of(changed):  # their gradients' rings and updates
            dirty |= set(bucket_slots(lay, self.buckets.ops[b]))
        dirty |= {s for j in edges for s in (lay.edge_forward[j], lay.edge_backward[j])}
        # a run's members' edges feed its host's slots (``Layout.fed_forward``)
        targets = {("fwd", lay.forward_host(i)) for i in changed}
        targets |= {("bwd", lay.backward_host(i)) for i in changed}
        targets |= {("fwd", lay.forward_host(lay.edges[j][1])) for j in edges}
        targets |= {("bwd", lay.backward_host(lay.edges[j][0])) for j in edges}
        dirty |= {lay.forward[i] if p == "fwd" else lay.backward[i] for p, i in targets}
        return edges, dirty, targets

    def _buckets_of(self, changed: list[int]) -> list[int]:
        """The gradient buckets of the changed ops that own weights."""
        return sorted({self.bucket_of[i] for i in changed if i in self.bucket_of})

    def _run(self, strategy, segments, preds, dirty: set[int], base) -> DeltaState:
        """Re-times from the checkpoint at or before the first dirty slot to the end."""
        size = self.lay.size
        resume, cooling, devices = self.machine.resume, self.machine.cooling, self.machine.size
        if base is None:
            ends, moved = [()] * size, [0] * size
            checkpoints: dict[int, tuple[Sequence[float], float, tuple[float, ...]]] = {}
            first, free, last, owed = 0, [0.0] * self.num_resources, 0.0, ()
        else:
            ends, moved = list(base.ends), list(base.moved)
            checkpoints = dict(base.checkpoints)
            # Re-running slots between the checkpoint and the first dirty one repeats
            # their times exactly (same inputs, same operations).
            first = self.entries[bisect_right(self.entries, min(dirty)) - 1]
            saved, last, owed = checkpoints[first]
            free = list(saved)
        wakes = None
        if resume is not None or cooling is not None:
            wakes = Wakes(resume, devices, owed, cooling)
        for s in dirty:
            moved[s] = sum(segments[s].nbytes)
        entries = self.entry_set
        for slot in range(first, size):
            if slot in entries:
                # end times as 8-byte doubles, not float objects: a state holds millions
                # (tasks' ends, every checkpoint's resources), and a search many states
                checkpoints[slot] = (
                    array("d", free),
                    last,
                    () if wakes is None else wakes.saved(),
                )
            seg = segments[slot]
            if not seg.duration:
                ends[slot] = ()
                continue
            # The formula of simulate.simulate, inlined; only ends are kept (a start is
            # recomputed from them where a timeline is asked for: ``task_graph``).
            ends[slot] = cur = array("d")  # before its tasks: they may wait on earlier ones
            for d, kind, resources, ps in zip(
                seg.duration, seg.kind, seg.resources, preds[slot], strict=True
            ):
                s = 0.0
                for ps_slot, k in ps:
                    t = ends[ps_slot][k]
                    if t > s:
                        s = t
                ready = s
                for r in resources:
                    t = free[r]
                    if t > s:
                        s = t
                e = s + d
                if wakes is not None and (x := wakes.extra(ready, kind, d, resources, free)):
                    e += x
                cur.append(e)
                for r in resources:
                    free[r] = e
            if (e := max(cur)) > last:
                last = e
        return DeltaState(
            strategy,
            segments,
            preds,
            ends,
            checkpoints,
            last,
            moved,
            sum(moved),
            [] if base is None else base.op_memory,
            [] if base is None else base.edge_memory,
            (),
            (),
            (),
        )

    def _with_memory(self, state, strategy, changed, edges, base) -> DeltaState:
        devices = self.simulator.machine.size
        if base is None:
            ops = [self._op_memory(i, strategy) for i in range(len(self.graph.ops))]
            em = [self._edge_memory(j, strategy) for j in range(len(self.lay.edges))]
            batch = self._batch(strategy)
            held = list(batch)
            for part in (*(m.held for m in ops), *(e.held for e in em)):
                for d, n in part:
                    held[d] += n
            return self._with_peak(state, ops, em, batch, held, self._rings(strategy))
        ops, em, held = list(base.op_memory), list(base.edge_memory), list(base.held)
        for i in changed:
            new = self._op_memory(i, strategy)
            _shift(held, ops[i].held, new.held)
            ops[i] = new
        for j in edges:
            new = self._edge_memory(j, strategy)
            _shift(held, em[j].held, new.held)
            em[j] = new
        batch = self._batch(strategy)
        for d in range(devices):
            held[d] += batch[d] - base.batch[d]
        return self._with_peak(state, ops, em, batch, held, self._rings(strategy))

    def _rings(self, strategy: Strategy) -> list[int] | None:
        """What the gradient buckets' rings hold on CPU ranks (``bucket_memory.py``),
        memoized per bucket by its ops' configs; None on GPUs, where they hold none."""
        sim = self.simulator
        if not sim.host_objects:
            return None
        held: Widest = {}
        ops = self.graph.ops
        for b, bucket in enumerate(self.buckets.ops):
            key = (b, *(strategy[ops[i].name] for i in bucket))
            if key not in self.ring_memory_memo:
                summed, groups = self.buckets.summed(b), self._groups_of(strategy)
                sums = bucket_sums(b, summed, groups, sim.zero)
                self.ring_memory_memo[key] = widest(sums, sim.itemsize)
            for devices, n in self.ring_memory_memo[key].items():
                held[devices] = max(held.get(devices, 0), n)
        return ring_scratch(held, sim.machine.size)

    def _groups_of(self, strategy: Strategy):
        """Op index -> its replica groups under ``strategy``."""
        ops = self.graph.ops
        return lambda i: self.partitioner.groups(ops[i], strategy[ops[i].name])

    def _with_peak(self, state, ops, em, batch, held, rings: list[int] | None) -> DeltaState:
        # The largest transient is a max over all ops: O(ops), exact, no bookkeeping.
        lay = self.lay.edges
        edges = edge_totals((lay[j][0], lay[j][1], lay[j][2], m) for j, m in enumerate(em))
        peak = total(held, ops, self.order, edges, rings)
        return replace(
            state, op_memory=ops, edge_memory=em, batch=batch, held=tuple(held), peak=peak
        )

    def _evaluation(self, state: DeltaState) -> Evaluation:
        devices = self.simulator.machine.devices
        fits = all(m <= d.memory for m, d in zip(state.peak, devices, strict=False))
        return Evaluation(state.makespan, state.peak, state.bytes_moved, fits)

    def task_graph(self, state: DeltaState) -> tuple[TaskGraph, Timeline]:
        """The state as a flat task graph and timeline, numbered as a full build numbers
        them (for tests and traces)."""
        tg = flatten(state.segments, state.preds, self.machine, False)
        end = [x for s in state.ends for x in s]
        start = _starts(tg, end)
        return tg, Timeline(np.array(start, dtype=np.float64), np.array(end, dtype=np.float64))


def _starts(tg: TaskGraph, end: list[float]) -> list[float]:
    """Every task's start from the ends: when its predecessors and its resources' tasks
    before it have ended (``simulate.run_task``)."""
    free = [0.0] * tg.num_resources
    res_ptr, res_idx = tg.res_ptr.tolist(), tg.res_idx.tolist()
    pred_ptr, pred_idx = tg.pred_ptr.tolist(), tg.pred_idx.tolist()
    start = []
    for i, e in enumerate(end):
        resources = res_idx[res_ptr[i] : res_ptr[i + 1]]
        preds = pred_idx[pred_ptr[i] : pred_ptr[i + 1]]
        start.append(run_task([end[p] for p in preds], resources, free))
        for r in resources:
            free[r] = e
    return start


def _shift(held: list[int], old, new) -> None:
    for d, n in old:
        held[d] -= n
    for d, n in new:
        held[d] += n
