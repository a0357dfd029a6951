"""Compile a partitioned graph into each rank's static instruction list.

All ranks derive their lists from one global order, so message matching is
deterministic and nothing can deadlock:

    forward,  ops in graph order:   per task: wait for its input tiles, compute, send
                                    its output tiles to the tasks that read them;
    backward, ops in reverse order: per task: wait for its output-gradient pieces,
                                    compute, send input-gradient pieces to producers;
                                    then all-reduce the op's weight replica groups
                                    (under ZeRO, reduce-scatter the sharded ones);
    then the update (under ZeRO, each sharded group's all-gather after its update:
    executor/runtime.py).

An op with statistics (BatchNorm in training mode) computes in two halves in each phase:
every task assembles its inputs and its partial statistics (``Partial``), each group of
tasks that split the statistics' dims sums them (``ReduceStats``, an all-reduce over the
group's devices), then every task finishes (``Compute``) and sends.

Every transfer is a ``Send`` on its source and a ``Recv`` on its destination at the same
place in the global order, and a ``Wait`` on the destination before the consumer reads
it. So each pair of ranks issues its sends and receives in one identical order: messages
match by that order alone (no tags, which MPI bounds at 32767 and NCCL lacks), and with
every communication of a rank issued in global order the earliest unfinished one always
has both ends issued, so nothing can deadlock, even where a transport serializes a
rank's transfers on one stream (NCCL). An all-reduce waits for members that each reach
it once everything before it in the order is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.partition import Rect
from onnx2soap.soap.zero import ZeroStage, zero_group


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


@dataclass(frozen=True)
class Partial:
    """Assemble a task's inputs (forward) or output gradient (backward) and compute its
    partial statistics; the ``Compute`` of the same task finishes it."""

    phase: Phase
    op: int
    task: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class ReduceStats:
    phase: Phase
    op: int
    group: int  # index into PartitionedGraph.stats[op name]
    devices: tuple[int, ...]


@dataclass(frozen=True)
class SumOutputs:
    """Forward of an op with partial sums: add the group's partial output tiles (an
    all-reduce over its devices); on each member device, the output of the group's
    holder there (``SumGroup.holders``) becomes the sum."""

    op: int
    group: int  # index into PartitionedGraph.sums[op name]
    devices: tuple[int, ...]


@dataclass(frozen=True)
class ShareGrad:
    """Backward of an op with partial sums: on each member device the holder assembles
    the gradient pieces its readers sent it (``pieces``), and an all-reduce of them gives
    every task of the group the whole tile's gradient."""

    op: int
    group: int
    devices: tuple[int, ...]
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Send:
    transfer: Transfer


@dataclass(frozen=True)
class Recv:
    """Post the receive of ``transfer`` (at its ``Send``'s place in the global order)."""

    transfer: Transfer


@dataclass(frozen=True)
class Wait:
    """The received ``transfer`` must be complete before the next instruction reads it."""

    transfer: Transfer


@dataclass(frozen=True)
class AllReduce:
    op: int
    group: int  # index into PartitionedGraph.groups[op name]
    devices: tuple[int, ...]


@dataclass(frozen=True)
class ReduceScatter:
    """ZeRO: start summing a sharded replica group's gradient so that each member ends
    with the sum of its own shard (soap/zero.py)."""

    op: int
    group: int  # index into PartitionedGraph.groups[op name]
    devices: tuple[int, ...]


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
)


@dataclass(frozen=True)
class Program:
    rank: int
    instructions: tuple[Instruction, ...]

    @property
    def receives(self) -> tuple[Transfer, ...]:
        return tuple(ins.transfer for ins in self.instructions if isinstance(ins, Recv))


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
    """One phase of an op: per task, wait, compute, send; an op with statistics first
    assembles and reduces them (``Partial``, ``ReduceStats``)."""
    order: list[tuple[int, Instruction]] = []
    tasks = pg.tasks[op.name]
    synced = bool(op.nest.sync_dims)
    if synced:
        for task in tasks:
            key = (phase, i, task.index)
            order += [(t.dst, Wait(t)) for t in waits.get(key, [])]
            order.append((task.device, Partial(phase, i, task.index, tuple(pieces.get(key, [])))))
        for g, group in enumerate(pg.stats[op.name]):
            order += [(d, ReduceStats(phase, i, g, group.devices)) for d in group.devices]
    for task in tasks:
        key = (phase, i, task.index)
        if not synced:
            order += [(t.dst, Wait(t)) for t in waits.get(key, [])]
        given = () if synced else tuple(pieces.get(key, []))
        order.append((task.device, Compute(phase, i, task.index, given)))
        order += _send_recv(sends.get(key, []))
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


def global_order(
    pg: PartitionedGraph, zero: ZeroStage = ZeroStage.NONE
) -> list[tuple[int, Instruction]]:
    """Every instruction of a step, with the device that executes it, in global order;
    ``zero``: the plan's ZeRO stage (sharded groups reduce-scatter their gradients)."""
    graph = pg.graph
    fwd, bwd = _transfers(pg)
    pieces = _pieces(pg, fwd)
    waits: dict[tuple, list[Transfer]] = {}
    sends: dict[tuple, list[Transfer]] = {}
    for t in fwd:
        waits.setdefault((Phase.FORWARD, *t.consumer), []).append(t)
        sends.setdefault((Phase.FORWARD, *t.producer), []).append(t)
    for t in bwd:
        waits.setdefault((Phase.BACKWARD, *t.producer), []).append(t)
        sends.setdefault((Phase.BACKWARD, *t.consumer), []).append(t)

    order: list[tuple[int, Instruction]] = []
    indexed = list(enumerate(graph.ops))
    for phase, ops in ((Phase.FORWARD, indexed), (Phase.BACKWARD, indexed[::-1])):
        for i, op in ops:
            if phase is Phase.BACKWARD and not graph.differentiable(op.output):
                continue  # nothing flows back through ids or masks computed from them
            links = (waits, sends, pieces)
            if pg.sums[op.name]:  # a split partial dim: partial tiles, summed
                order += _summed_op(pg, phase, i, op, *links)
            else:
                order += _plain_op(pg, phase, i, op, *links)
            if phase is Phase.BACKWARD:
                # The op's weight gradients are complete: all-reduce them now, while the
                # rest of the backward pass is still ahead (as the simulator schedules it).
                for g, group in enumerate(pg.groups[op.name]):
                    if group.trainable and len(group.devices) > 1:
                        kind = AllReduce if zero_group(group, zero) is None else ReduceScatter
                        order += [(d, kind(i, g, group.devices)) for d in group.devices]
    return order


def compile_program(pg: PartitionedGraph, rank: int, zero: ZeroStage = ZeroStage.NONE) -> Program:
    return Program(rank, tuple(ins for device, ins in global_order(pg, zero) if device == rank))
