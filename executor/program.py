"""Compile a partitioned graph into each rank's static instruction list.

All ranks derive their lists from one global order, so message matching is
deterministic and nothing can deadlock. A step is a sequence of passes (``pass_order``):
each (stage, microbatch, forward or backward) of a pipeline (soap/pipeline.py), and for
a plan without one the single pass pair of one stage holding every op and one
microbatch. Within a pass:

    forward,  the stage's ops in graph order:   per task: wait for its input tiles,
                                    compute, send its output tiles to the tasks that
                                    read them;
    backward, the stage's ops in reverse order: per task: wait for its output-gradient
                                    pieces, compute, send input-gradient pieces to
                                    producers; in the stage's last backward, once every
                                    microbatch's gradient is accumulated, start the
                                    gradient buckets' reduce-scatters (ZeRO's sharded
                                    groups) and all-reduces whose last gradient the op
                                    made (soap/buckets.py);
    under ZeRO-3 each op's sharded weights are all-gathered on their groups' members,
    started as the op before it in the phase begins (``GatherWeight``, FSDP's
    prefetch) and complete as its phase begins (``WaitWeight``);
    then the update (under ZeRO, each sharded group's all-gather after its update:
    executor/runtime.py).

The passes follow every stage's ``stage_order`` (GPipe, 1F1B) and the data: a forward of
microbatch m after the previous stage's forward of m, a backward after the next stage's
backward of m. Every instruction carries its microbatch.

An op with statistics (BatchNorm in training mode) computes in two halves in each phase:
every task assembles its inputs and its partial statistics (``Partial``), each group of
tasks that split the statistics' dims sums them (``ReduceStats``, an all-reduce over the
group's devices), then every task finishes (``Compute``) and sends. Ops with statistics
next to each other that do not read one another run as one unit
(``soap/stats_batches.py``): every member's partials, one ``ReduceStats`` per device
set holding all their groups there, then every member's finishing halves.

Every transfer is a ``Send`` on its source and a ``Recv`` on its destination at the same
place in the global order (in the producer's pass: a stage posts the receive of the
next microbatch's activations while it computes), and a ``Wait`` on the destination
before the consumer reads it. So each pair of ranks issues its sends and receives in one
identical order: messages match by that order alone (no tags, which MPI bounds at 32767
and NCCL lacks). Nothing can deadlock, whatever the transport: take the earliest
communication in the global order that has not finished. Everything a participant
issued before it is earlier in the order, hence finished, so no participant is held up
before it: a ``Wait`` waits for an earlier receive, a ``Reopen`` (below) for earlier
work, and a computation for nothing else. So every participant issues it, with
nothing unfinished ahead of it on any serial queue (MPI's per-pair order, a rank's NCCL
stream, the host-staged copies), and it finishes; by induction, everything does. An
all-reduce likewise waits for members that each reach it once everything before it in
the order is done.

A rank holds a microbatch from its first instruction (often a receive posted early) to
its last, after which a ``Close`` drops its arrays; its buffers made once (receive,
data rows' and statistics buffers) are a slot's, one slot per microbatch the rank holds at
once (1F1B: at most ``held_at_most`` plus the receives posted ahead; GPipe: every
microbatch). A microbatch that takes a slot an earlier one of the step used starts with
a ``Reopen``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from onnx2soap.ops import definition
from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.buckets import (
    DEFAULT_BUCKET_MB,
    BucketScatter,
    all_rings,
    all_scatters,
    gradient_buckets,
)
from onnx2soap.soap.partition import Rect
from onnx2soap.soap.pipeline import Pass, Pipeline, Schedule, StagePass, stage_order
from onnx2soap.soap.saved import backward_reads
from onnx2soap.soap.stats_batches import run_of, stats_rings
from onnx2soap.soap.streamed import block_of, key_blocks
from onnx2soap.soap.zero import Zero, ZeroStage, group_stage, zero_group


class Phase(Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Piece:
    """One overlap as seen by the task that assembles it.

    Forward: a tile piece of input ``operand`` of the consumer task, coming from the
    output of producer task ``peer``. Backward: a piece of the producer task's output
    gradient, coming from input-gradient ``operand`` of consumer task ``peer``.
    ``transfer`` (the transfer's id) is set when the piece crosses devices: it is then
    received, not copied.
    """

    rect: Rect
    operand: int
    peer: tuple[int, int]  # (op index, task index)
    transfer: int | None


@dataclass(frozen=True)
class Transfer:
    """A tile (forward) or gradient piece (backward) that crosses devices. ``id`` names
    it in the program; it never goes on the wire."""

    id: int
    phase: Phase
    src: int
    dst: int
    rect: Rect
    operand: int
    producer: tuple[int, int]  # (op index, task index) of the forward producer
    consumer: tuple[int, int]  # (op index, task index) of the forward consumer


@dataclass(frozen=True)
class Compute:
    phase: Phase
    op: int
    task: int
    pieces: tuple[Piece, ...]  # forward: input tiles; backward: output-gradient pieces
    microbatch: int = 0


@dataclass(frozen=True)
class Partial:
    """Assemble a task's inputs (forward) or output gradient (backward) and compute its
    partial statistics; the ``Compute`` of the same task finishes it."""

    phase: Phase
    op: int
    task: int
    pieces: tuple[Piece, ...]
    microbatch: int = 0


@dataclass(frozen=True)
class ReduceStats:
    """Sum the partial statistics of ``members`` ((op, group) pairs: one
    ``soap.stats_batches.StatsRing``) over ``devices``, side by side in one all-reduce,
    and combine each member's."""

    phase: Phase
    members: tuple[tuple[int, int], ...]  # (op index, index into PartitionedGraph.stats)
    devices: tuple[int, ...]
    microbatch: int = 0


@dataclass(frozen=True)
class SumOutputs:
    """Forward of an op with partial sums: add the group's partial output tiles (an
    all-reduce over its devices); on each member device, the output of the group's
    holder there (``SumGroup.holders``) becomes the sum. Where the group reduce-scatters
    (``SumGroup.scatter``), a reduce-scatter instead, and the holder's output is its
    chunk of the sum: readers take their pieces from the chunks' holders."""

    op: int
    group: int  # index into PartitionedGraph.sums[op name]
    devices: tuple[int, ...]
    microbatch: int = 0


@dataclass(frozen=True)
class ShareGrad:
    """Backward of an op with partial sums: on each member device the holder assembles
    the gradient pieces its readers sent it (``pieces``), and an all-reduce of them gives
    every task of the group the whole tile's gradient; where the forward reduce-scattered,
    the pieces cover the holder's chunk alone, and an all-gather of the chunks does."""

    op: int
    group: int
    devices: tuple[int, ...]
    pieces: tuple[Piece, ...]
    microbatch: int = 0


@dataclass(frozen=True)
class Send:
    transfer: Transfer
    microbatch: int = 0


@dataclass(frozen=True)
class Recv:
    """Post the receive of ``transfer`` (at its ``Send``'s place in the global order)."""

    transfer: Transfer
    microbatch: int = 0


@dataclass(frozen=True)
class Wait:
    """The received ``transfer`` must be complete before the next instruction reads it."""

    transfer: Transfer
    microbatch: int = 0


@dataclass(frozen=True)
class AllReduce:
    """Start summing a gradient bucket's replica groups over ``devices`` (one
    ``BucketRing``, soap/buckets.py): their gradients as one flat run, ``members`` ((op,
    group) pairs) in order; the step's end completes it."""

    bucket: int
    members: tuple[tuple[int, int], ...]  # (op index, index into PartitionedGraph.groups)
    devices: tuple[int, ...]
    microbatch: int = 0


@dataclass(frozen=True)
class ReduceScatter:
    """ZeRO: start summing a gradient bucket's sharded replica groups over ``devices``
    (one ``BucketScatter``, soap/buckets.py) so that each member ends with the sum of
    its own rows of each (soap/zero.py); ``members`` ((op, group) pairs) in order."""

    bucket: int
    members: tuple[tuple[int, int], ...]  # (op index, index into PartitionedGraph.groups)
    devices: tuple[int, ...]
    microbatch: int = 0


@dataclass(frozen=True)
class GatherWeight:
    """ZeRO-3: every member starts all-gathering a sharded replica group's whole Rect
    from the members' rows (soap/zero.py), one op ahead of the op whose tasks of
    ``phase`` read it (FSDP's prefetch): while the op before runs."""

    phase: Phase
    op: int
    group: int  # index into PartitionedGraph.groups[op name]
    devices: tuple[int, ...]
    microbatch: int = 0


@dataclass(frozen=True)
class WaitWeight:
    """ZeRO-3: the gather ``GatherWeight`` started is complete before the op's tasks of
    ``phase`` on the rank read it; the rank lets go of it once they have run."""

    phase: Phase
    op: int
    group: int
    microbatch: int = 0


@dataclass(frozen=True)
class Reopen:
    """Microbatch ``microbatch`` takes buffers (a slot) that an earlier microbatch of
    the step used on this rank: on a GPU that one's kernels and transfers must be done
    before anything writes them (the host waits for the device)."""

    microbatch: int


@dataclass(frozen=True)
class Close:
    """The rank's last instruction of ``microbatch`` is done: its activations, inputs
    and gradients are dropped (its slot's buffers go to a later microbatch)."""

    microbatch: int


Instruction = (
    Compute
    | Partial
    | ReduceStats
    | SumOutputs
    | ShareGrad
    | Send
    | Recv
    | Wait
    | AllReduce
    | ReduceScatter
    | GatherWeight
    | WaitWeight
    | Reopen
    | Close
)


@dataclass(frozen=True)
class Program:
    """One rank's instructions for a step of ``microbatches`` microbatches. ``slot_of``:
    the set of buffers (slot) each microbatch uses; a slot serves one microbatch at a
    time, from its first instruction on the rank to its ``Close``."""

    rank: int
    instructions: tuple[Instruction, ...]
    microbatches: int = 1
    slot_of: tuple[int, ...] = (0,)

    @property
    def slots(self) -> int:
        return max(self.slot_of, default=-1) + 1

    @property
    def receives(self) -> tuple[Transfer, ...]:
        return tuple(ins.transfer for ins in self.instructions if isinstance(ins, Recv))


@dataclass(frozen=True)
class Stages:
    """How a step's passes are laid out: each op's stage, the stage count, the
    microbatches and the schedule. A plan without a pipeline is one stage of every op
    and one microbatch."""

    stage_of_op: tuple[int, ...]  # by op index
    count: int = 1
    microbatches: int = 1
    schedule: Schedule = Schedule.GPIPE

    @staticmethod
    def of(pg: PartitionedGraph, pipeline: Pipeline | None) -> Stages:
        if pipeline is None:
            return Stages((0,) * len(pg.graph.ops))
        stage = pipeline.stage_of()
        return Stages(
            tuple(stage[op.name] for op in pg.graph.ops),
            len(pipeline.stages),
            pipeline.microbatches,
            pipeline.schedule,
        )


def pass_order(stages: Stages) -> list[tuple[int, StagePass]]:
    """Every (stage, pass) of a step in one global order: each stage's passes in
    ``stage_order``'s order, a forward of microbatch m after the previous stage's, a
    backward after the next stage's (the passes whose data it reads), stages taken in
    turn, each as far as it can go (the order ``sim.pipeline_schedule`` times them)."""
    count, m = stages.count, stages.microbatches
    orders = [stage_order(stages.schedule, s, count, m) for s in range(count)]
    done: set[tuple[int, StagePass]] = set()
    cursor, order = [0] * count, []

    def ready(s: int, p: StagePass) -> bool:
        if p.kind is Pass.FORWARD:
            return s == 0 or (s - 1, p) in done
        return s == count - 1 or (s + 1, p) in done

    while len(order) < sum(len(o) for o in orders):
        progressed = False
        for s in range(count):
            while cursor[s] < len(orders[s]) and ready(s, orders[s][cursor[s]]):
                done.add((s, orders[s][cursor[s]]))
                order.append((s, orders[s][cursor[s]]))
                cursor[s] += 1
                progressed = True
        if not progressed:  # stage_order's schedules never wait on themselves
            raise AssertionError(f"the {stages.schedule.value} schedule waits on itself")
    return order


def _transfers(pg: PartitionedGraph) -> tuple[list[Transfer], list[Transfer]]:
    """Every overlap crossing devices, numbered in a fixed order: forward tiles, and the
    gradient pieces of the differentiable ones (token ids take no gradient), numbered as
    their forward tile plus the number of forward transfers."""
    index = {op.name: i for i, op in enumerate(pg.graph.ops)}
    crossing = []
    for edge, o, p, c in pg.moves():
        if p.device != c.device:
            ends = ((index[edge.producer], p.index), (index[edge.consumer], c.index))
            grad = pg.graph.differentiable(edge.tensor)
            crossing.append((p.device, c.device, o.rect, edge.operand, *ends, grad))
    fwd = [Transfer(i, Phase.FORWARD, *x[:-1]) for i, x in enumerate(crossing)]
    n = len(fwd)
    bwd = [
        Transfer(n + i, Phase.BACKWARD, c, p, rect, k, prod, cons)
        for i, (p, c, rect, k, prod, cons, grad) in enumerate(crossing)
        if grad
    ]
    return fwd, bwd


def _streamed(pg: PartitionedGraph) -> dict[tuple[int, int], tuple]:
    """Per (op, task) of a streamed op that takes its keys in blocks (ring attention,
    ``soap/streamed.py``): (the streamed operands and their key axis, the blocks)."""
    out = {}
    for i, op in enumerate(pg.graph.ops):
        streams = definition(op.type).streams
        if streams is None:
            continue
        tasks = pg.tasks[op.name]
        for task in tasks:
            blocks = key_blocks(op, tasks, task)
            if blocks:
                out[(i, task.index)] = (streams.operands, streams.axis, blocks)
    return out


def _step(streamed: dict, t: Transfer) -> int | None:
    """The block of its streamed reader a forward piece arrives for (the ring's step
    that brings it); None where the reader takes it whole, waiting before its kernel.
    Each device sends its block to the readers in step order, so on a switch each
    step's pieces use each device's ports once, as a ring's steps do; the simulator
    orders them so (``sim/taskgraph.py``'s ``_ring_order``)."""
    found = streamed.get(t.consumer)
    if found is None or t.operand not in found[0]:
        return None
    _, axis, blocks = found
    return block_of(blocks, t.rect[axis])


def _pieces(pg: PartitionedGraph, fwd: list[Transfer]) -> dict[tuple, list[Piece]]:
    """Pieces each (phase, op, task) assembles, in edge and overlap order."""
    index = {op.name: i for i, op in enumerate(pg.graph.ops)}
    ids = {(t.producer, t.consumer, t.operand, t.rect): t.id for t in fwd}
    n = len(fwd)
    pieces: dict[tuple, list[Piece]] = {}
    for edge, o, p, c in pg.moves():
        prod, cons = (index[edge.producer], p.index), (index[edge.consumer], c.index)
        sent = ids.get((prod, cons, edge.operand, o.rect))
        back = None if sent is None else sent + n
        key_f, key_b = (Phase.FORWARD, *cons), (Phase.BACKWARD, *prod)
        pieces.setdefault(key_f, []).append(Piece(o.rect, edge.operand, prod, sent))
        if pg.graph.differentiable(edge.tensor):
            pieces.setdefault(key_b, []).append(Piece(o.rect, edge.operand, cons, back))
    return pieces


def _plain_op(pg, phase: Phase, i: int, op, waits, sends, pieces) -> list:
    """One phase of an op: per task, wait, compute, send."""
    order: list[tuple[int, Instruction]] = []
    for task in pg.tasks[op.name]:
        key = (phase, i, task.index)
        order += [(t.dst, Wait(t)) for t in waits.get(key, [])]
        order.append((task.device, Compute(phase, i, task.index, tuple(pieces.get(key, [])))))
        order += _send_recv(sends.get(key, []))
    return order


def _synced_run(pg, phase: Phase, run, links, after) -> list:
    """One phase of a run of ops with statistics (``soap.stats_batches``; ``run`` in the
    phase's order): every member's tasks assemble and compute their partial statistics
    (``Partial``), each ring sums its members' (``ReduceStats``), then each member's
    tasks finish and send, followed by ``after(i)`` (the backward's gradient sums)."""
    waits, sends, pieces = links
    order: list[tuple[int, Instruction]] = []
    for i, op in run:
        for task in pg.tasks[op.name]:
            key = (phase, i, task.index)
            order += [(t.dst, Wait(t)) for t in waits.get(key, [])]
            order.append((task.device, Partial(phase, i, task.index, tuple(pieces.get(key, [])))))
    ops = pg.graph.ops
    for ring in stats_rings([i for i, _ in run], lambda i: pg.stats[ops[i].name]):
        order += [(d, ReduceStats(phase, ring.members, ring.devices)) for d in ring.devices]
    for i, op in run:
        for task in pg.tasks[op.name]:
            order.append((task.device, Compute(phase, i, task.index, ())))
            order += _send_recv(sends.get((phase, i, task.index), []))
        order += after(i)
    return order


def _send_recv(transfers: list[Transfer]) -> list[tuple[int, Instruction]]:
    """Each transfer's send and its receive side by side in the global order."""
    return [pair for t in transfers for pair in ((t.src, Send(t)), (t.dst, Recv(t)))]


def _summed_op(pg, phase: Phase, i: int, op, waits, sends, pieces) -> list:
    """One phase of an op with partial sums. Forward: every task computes its partial
    tile, each group sums them into its holders, which send the tile on. Backward: the
    holders receive their tiles' gradient pieces, each group sums them, every task
    computes."""
    order: list[tuple[int, Instruction]] = []
    tasks, groups = pg.tasks[op.name], pg.sums[op.name]
    for task in tasks:
        key = (phase, i, task.index)
        order += [(t.dst, Wait(t)) for t in waits.get(key, [])]
        if phase is Phase.FORWARD:
            order.append((task.device, Compute(phase, i, task.index, tuple(pieces.get(key, [])))))
    for g, group in enumerate(groups):
        if phase is Phase.FORWARD:
            order += [(d, SumOutputs(i, g, group.devices)) for d in group.devices]
        else:
            for d, holder in zip(group.devices, group.holders, strict=True):
                given = tuple(pieces.get((phase, i, holder), []))
                order.append((d, ShareGrad(i, g, group.devices, given)))
    for task in tasks:
        key = (phase, i, task.index)
        if phase is Phase.BACKWARD:
            order.append((task.device, Compute(phase, i, task.index, ())))
        order += _send_recv(sends.get(key, []))
    return order


def _gathers(pg, phase: Phase, i: int, op, zero: Zero) -> list:
    """ZeRO-3: the op's sharded weights' gathers for ``phase`` (for the backward, those
    it reads), each on its group's members."""
    if not zero.shards_weights:
        return []
    return [
        (d, GatherWeight(phase, i, g, group.devices))
        for g, group in enumerate(pg.groups[op.name])
        if group_stage(group, zero).shards_weights and zero_group(group, zero) is not None
        if phase is Phase.FORWARD or backward_reads(pg.graph, op, group.weight)
        for d in group.devices
    ]


def _units(pg, run) -> list[list]:
    """``run`` (a phase's ops, in its order) cut into units: each run of ops with
    statistics (``soap.stats_batches.stats_runs``) whose members come one after another
    here is one unit, any other op a unit of its own."""
    runs = run_of(pg.graph)
    units: list[list] = []
    for i, op in run:
        if units and i in runs and units[-1][-1][0] in runs[i]:
            units[-1].append((i, op))
        else:
            units.append([(i, op)])
    return units


def _with_gathers(pg, phase: Phase, run, zero: Zero, links, sync) -> list:
    """The phase of each op of ``run`` in turn (a run of ops with statistics together),
    each unit's ZeRO-3 gathers started as the unit before it begins (the first one's at
    once): FSDP's prefetch of the next block. Every member of a group starts its gather
    at the same place in the global order."""
    order: list[tuple[int, Instruction]] = []
    units = _units(pg, run)
    ahead = [[g for i, op in unit for g in _gathers(pg, phase, i, op, zero)] for unit in units]
    for j, unit in enumerate(units):
        if j == 0:
            order += ahead[0]
        if j + 1 < len(units):
            order += ahead[j + 1]
        # complete before the unit's phase begins
        order += [(d, WaitWeight(phase, ins.op, ins.group)) for d, ins in ahead[j]]
        order += _phase_of_unit(pg, phase, unit, links, sync)
    return order


def _sums_after(phase: Phase, i: int, sync) -> list:
    """After the backward of op ``i``, where ``sync`` (the stage's last backward: the
    buckets' reduce-scatters and rings by the op they start after), the sums of the
    gradients whose last one it made."""
    if phase is not Phase.BACKWARD or sync is None:
        return []
    # Sum them now, while the rest of the backward pass is still ahead (as the simulator
    # schedules it): ZeRO's sharded groups reduce-scattered, then the others all-reduced.
    order: list[tuple[int, Instruction]] = []
    for summed in sync.get(i, ()):
        kind = ReduceScatter if isinstance(summed, BucketScatter) else AllReduce
        ins = kind(summed.bucket, summed.members, summed.devices)
        order += [(d, ins) for d in summed.devices]
    return order


def _phase_of_unit(pg, phase: Phase, unit, links, sync) -> list:
    """One phase of one unit (``_units``) for one microbatch, each op followed by its
    weight-gradient sums (``_sums_after``)."""
    i, op = unit[0]
    if op.nest.sync_dims and not pg.sums[op.name]:
        return _synced_run(pg, phase, unit, links, lambda k: _sums_after(phase, k, sync))
    if pg.sums[op.name]:  # a split partial dim: partial tiles, summed
        order = _summed_op(pg, phase, i, op, *links)
    else:
        order = _plain_op(pg, phase, i, op, *links)
    return order + _sums_after(phase, i, sync)


def global_order(
    pg: PartitionedGraph,
    zero: Zero | ZeroStage = ZeroStage.NONE,
    stages: Stages | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> list[tuple[int, Instruction]]:
    """Every instruction of a step, with the device that executes it, in global order;
    ``zero``: the plan's ZeRO stages (sharded groups reduce-scatter their gradients);
    ``stages``: the pipeline (None: one stage, one microbatch); ``bucket_mb``: the
    gradient buckets' size. Pass by pass in ``pass_order``: a forward runs the stage's
    ops in graph order, a backward in reverse, each instruction tagged with its
    microbatch; weight gradients are summed over replicas in the stage's last backward,
    once the microbatches' are accumulated."""
    graph, zero = pg.graph, Zero.of(zero)
    stages = stages or Stages((0,) * len(graph.ops))
    groups = [pg.groups[op.name] for op in graph.ops]
    buckets = gradient_buckets(graph, bucket_mb)
    scatters = all_scatters(buckets, groups.__getitem__, zero)
    rings = all_rings(buckets, groups.__getitem__, zero)
    sums = {i: (*scatters.get(i, ()), *rings.get(i, ())) for i in {*scatters, *rings}}
    fwd, bwd = _transfers(pg)
    pieces = _pieces(pg, fwd)
    waits: dict[tuple, list[Transfer]] = {}
    sends: dict[tuple, list[Transfer]] = {}
    streamed = _streamed(pg)
    for t in fwd:
        if _step(streamed, t) is None:  # a streamed task's kernel waits for it itself
            waits.setdefault((Phase.FORWARD, *t.consumer), []).append(t)
        sends.setdefault((Phase.FORWARD, *t.producer), []).append(t)
    for sent in sends.values():  # to streamed readers, in the order they take them
        sent.sort(key=lambda t: _step(streamed, t) or 0)
    for t in bwd:
        waits.setdefault((Phase.BACKWARD, *t.producer), []).append(t)
        sends.setdefault((Phase.BACKWARD, *t.consumer), []).append(t)
    links = (waits, sends, pieces)
    ops = [
        [(i, op) for i, op in enumerate(graph.ops) if s == stages.stage_of_op[i]]
        for s in range(stages.count)
    ]
    last_backward = [
        stage_order(stages.schedule, s, stages.count, stages.microbatches)[-1].microbatch
        for s in range(stages.count)
    ]
    # Each (stage, phase)'s instructions are the same for every microbatch but its tag.
    made: dict[tuple[int, Pass, bool], list[tuple[int, Instruction]]] = {}
    order: list[tuple[int, Instruction]] = []
    for s, p in pass_order(stages):
        sync = p.kind is Pass.BACKWARD and p.microbatch == last_backward[s]
        key = (s, p.kind, sync)
        if key not in made:
            if p.kind is Pass.FORWARD:
                phase, run = Phase.FORWARD, ops[s]
            else:  # nothing flows back through ids
                phase = Phase.BACKWARD
                run = [(i, op) for i, op in ops[s][::-1] if graph.differentiable(op.output)]
            made[key] = _with_gathers(pg, phase, run, zero, links, sums if sync else None)
        if p.microbatch == 0:
            order += made[key]
        else:
            order += [(d, replace(ins, microbatch=p.microbatch)) for d, ins in made[key]]
    return order


def _with_lifetimes(rank: int, instructions: list, microbatches: int) -> Program:
    """The rank's program with each microbatch's ``Close`` after its last instruction
    and a slot of buffers per microbatch, the lowest free one when its first
    instruction comes (``Reopen`` first where an earlier microbatch used it): as many
    slots as microbatches are ever open at once on the rank."""
    last = {ins.microbatch: k for k, ins in enumerate(instructions)}
    slot_of = [0] * microbatches
    free, used, out = [], 0, []
    opened: set[int] = set()
    for k, ins in enumerate(instructions):
        m = ins.microbatch
        if m not in opened:
            opened.add(m)
            if free:
                slot_of[m] = min(free)
                free.remove(slot_of[m])
                out.append(Reopen(m))
            else:
                slot_of[m], used = used, used + 1
        out.append(ins)
        if last[m] == k:
            out.append(Close(m))
            free.append(slot_of[m])
    return Program(rank, tuple(out), microbatches, tuple(slot_of))


def compile_program(
    pg: PartitionedGraph,
    rank: int,
    zero: Zero | ZeroStage = ZeroStage.NONE,
    pipeline: Pipeline | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> Program:
    stages = Stages.of(pg, pipeline)
    order = global_order(pg, zero, stages, bucket_mb)
    mine = [ins for device, ins in order if device == rank]
    return _with_lifetimes(rank, mine, stages.microbatches)


def forward_program(program: Program) -> Program:
    """The forward phase of a program alone (evaluation, inference): the same global
    order, so still matched and deadlock-free, with its own microbatch lifetimes."""
    kept = [
        ins
        for ins in program.instructions
        if not isinstance(ins, Reopen | Close) and phase_of(ins) is Phase.FORWARD
    ]
    return _with_lifetimes(program.rank, kept, program.microbatches)


def phase_of(ins: Instruction) -> Phase:
    if isinstance(ins, Compute | Partial | ReduceStats | GatherWeight | WaitWeight):
        return ins.phase
    if isinstance(ins, SumOutputs):
        return Phase.FORWARD
    if isinstance(ins, Send | Recv | Wait):
        return ins.transfer.phase
    return Phase.BACKWARD  # all-reduces of weight gradients
