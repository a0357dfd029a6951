"""Lifetimes: what a training step lets go of, and after which instruction.

A task's output tile is read by its local consumers' forwards and by the ``Send``s of
its pieces; unless its op's backward reads it (``OpDef.saves``), the step drops it
after the last of those on the rank. An op with partial sums has its tasks' partial
tiles summed by its ``SumOutputs``, which lets them go; the sum, each member's holder's
output, then lives as any tile. A consumer keeps, from its forward to its
backward, only the input buffers its backward reads; the others become ``Released``
(shape and dtype) once its forward has run, so an input it read in place (``Alias``)
lives only as long as its producer or another reader keeps it, and an assembled one
(made by the step) goes at once. After its backward a task keeps nothing. A piece sent
as a view keeps its whole tile with the transport until the send completes (the
transport lets it go then, executor/transport.py). Recomputed ops follow
``executor/recompute.py``.

An activation gradient (a consumer task's gradient of one of its inputs) is read by the
producer tasks that gather their output gradient from it (a local piece copied, or the
whole of it used as it is: ``GradAlias``) and by the ``Send``s of its pieces to other
ranks. The step drops it after the last of those on the rank, so that a backward holds
the gradients between the ops it has run and their producers, not every gradient of the
step (``sim/memory.py`` prices the same). A piece sent as a view of it keeps the array
alive until the transport lets the send go, once it has completed.

A tile's events are its readers' forward ``("compute", op, task)`` and the forward
``("send", transfer id)`` of its pieces. A gradient's are ``("gather", op, task)``,
where a producer task gathers its output gradient (``Step._grad_output``: a backward
``Partial`` for an op with statistics, a ``ShareGrad`` for a partial sum's holder, else
the backward ``Compute``), and the backward ``("send", transfer id)`` of its pieces.
Every microbatch of a pipeline runs the same instructions on its own ``Step``: one plan
serves them all.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from executor.layout import Alias, Assembled, GradAlias, GradSum, TaskKey
from executor.program import Compute, Partial, Phase, Send, ShareGrad, SumOutputs, phase_of
from onnx2soap.soap.saved import kept_for_backward

Event = tuple
GradKey = tuple[TaskKey, int]  # (consumer task, input operand)


def gather_event(key: TaskKey) -> Event:
    return ("gather", *key)


def send_event(transfer: int) -> Event:
    return ("send", transfer)


def compute_event(key: TaskKey) -> Event:
    return ("compute", *key)


def sum_event(op: int, group: int) -> Event:
    return ("sum", op, group)


@dataclass(frozen=True)
class Lifetimes:
    """After which event the rank drops each output tile and each activation gradient,
    and which ops keep what for their backward."""

    tiles_after: dict[Event, tuple[TaskKey, ...]]
    grads_after: dict[Event, tuple[GradKey, ...]]
    # per op index: the input operands its backward reads (all, for ops it recomputes
    # or without a backward: none), and whether it reads its output tile
    keeps: tuple[tuple[frozenset[int], bool], ...]


def lifetimes(rt, recomputed: frozenset[int] = frozenset()) -> Lifetimes:
    """The rank's plan, from its program's first microbatch and its buffers;
    ``recomputed``: the ops ``executor/recompute.py`` drops and makes again."""
    keeps = tuple(
        kept_for_backward(rt.graph, op, i in recomputed) for i, op in enumerate(rt.graph.ops)
    )
    return Lifetimes(_tiles_after(rt, keeps, recomputed), _grads_after(rt), keeps)


def _tiles_after(rt, keeps, recomputed) -> dict[Event, tuple[TaskKey, ...]]:
    """After which forward event each local tile the backward does not read goes."""
    last: dict[TaskKey, int] = {}
    events: list[Event] = []
    for ins in rt.program.instructions:
        if ins.microbatch != 0 or phase_of(ins) is not Phase.FORWARD:
            continue
        if isinstance(ins, Compute):
            key = (ins.op, ins.task)
            events.append(compute_event(key))
            read = [key, *tiles_read(rt.buffers.inputs.get(key, ()))]
        elif isinstance(ins, Send):
            events.append(send_event(ins.transfer.id))
            read = [ins.transfer.producer]
        elif isinstance(ins, SumOutputs):  # the partial tiles, the holder's then the sum
            events.append(sum_event(ins.op, ins.group))
            group = rt.pg.sums[rt.graph.ops[ins.op].name][ins.group]
            read = [(ins.op, t) for t in group.tasks if rt.task((ins.op, t)).device == rt.rank]
        else:
            continue
        for key in read:
            last[key] = len(events) - 1
    kept = {key for key in last if key[0] in recomputed or keeps[key[0]][1]}
    return after_last({k: at for k, at in last.items() if k not in kept}, events)


def after_last(last: dict, events: list[Event]) -> dict[Event, tuple]:
    """Event -> what goes after it, from each thing's last reading event (its index)."""
    after: dict[Event, list] = defaultdict(list)
    for key, at in last.items():
        after[events[at]].append(key)
    return {e: tuple(keys) for e, keys in after.items()}


def tiles_read(sources) -> list[TaskKey]:
    """The local tasks whose output tiles a task's forward reads."""
    read = []
    for source in sources:
        if isinstance(source, Alias):
            read.append(source.producer)
        elif isinstance(source, Assembled):
            read += [c.peer for c in source.copies if c.transfer is None]
    return read


def _grads_after(rt) -> dict[Event, tuple[GradKey, ...]]:
    """After which backward event each local activation gradient goes."""
    last: dict[GradKey, int] = {}
    events: list[Event] = []
    for ins in rt.program.instructions:
        if ins.microbatch != 0:
            continue
        gathered = _gatherer(rt, ins)
        if gathered is not None:
            events.append(gather_event(gathered))
            read = _grads_read(rt.buffers.grad_outputs.get(gathered))
        elif isinstance(ins, Send) and ins.transfer.phase is Phase.BACKWARD:
            events.append(send_event(ins.transfer.id))
            read = [(ins.transfer.consumer, ins.transfer.operand)]
        else:
            continue
        for key in read:
            last[key] = len(events) - 1
    return after_last(last, events)


def _gatherer(rt, ins) -> TaskKey | None:
    """The task whose output gradient ``ins`` gathers (``Step._grad_output``), if any."""
    if isinstance(ins, ShareGrad):
        group = rt.pg.sums[rt.graph.ops[ins.op].name][ins.group]
        return (ins.op, group.holder(rt.rank))
    if not isinstance(ins, Compute | Partial) or ins.phase is not Phase.BACKWARD:
        return None
    op = rt.graph.ops[ins.op]
    if isinstance(ins, Compute) and (op.nest.sync_dims or rt.pg.sums[op.name]):
        return None  # gathered by its Partial, or by the group's ShareGrad
    return (ins.op, ins.task)


def _grads_read(source) -> list[GradKey]:
    """The local activation gradients an output gradient is gathered from."""
    if isinstance(source, GradAlias):
        return [(source.consumer, source.operand)]
    if isinstance(source, GradSum):
        return [(c.peer, c.operand) for c in source.copies if c.transfer is None]
    return []
