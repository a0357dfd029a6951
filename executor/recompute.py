"""Recomputation: the plan's ``recompute`` ops keep no output from forward to backward.

A recomputed op's output tile is dropped as soon as the last forward instruction of
the rank that reads it has run (a local consumer's ``Compute``, or the ``Send`` of a
piece of it), together with every reference a consumer kept to it for its backward
(an ``Alias`` input). Before a backward instruction that needs it (the op's own, or a
consumer's that aliased it) the tile is computed again from its inputs, recursively
where those were dropped too, and after the op's own backward it is dropped again (its
consumers' backwards come before it: the backward runs the ops in reverse order). On a
pipeline every microbatch has its ``Step`` and runs the same forward instructions: the
same plan serves each.

Recomputing needs no message: an op's other inputs are buffers that keep their forward
values until the next step (weights, constants, data rows, received pieces, assembled
buffers). So an op with partial sums (its output is an all-reduce over its group) is
kept, as is the loss; an op with batch statistics is recomputed with the statistics
its forward summed (kept for its backward anyway), and Dropout with the same random
key, so the recomputed tile equals the forward's bit for bit.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from executor.layout import Alias, Assembled, TaskKey
from executor.program import Compute, Phase, Send, phase_of
from onnx2soap.soap.recompute import recomputes

# What a forward instruction is known by: ("compute", op, task) or ("send", transfer id).
Event = tuple


def compute_event(key: TaskKey) -> Event:
    return ("compute", *key)


def send_event(transfer: int) -> Event:
    return ("send", transfer)


@dataclass(frozen=True)
class RecomputePlan:
    """When a rank drops each recomputed tile and who aliased it."""

    ops: frozenset[int]  # op indices recomputed on this rank
    drop_after: dict[Event, tuple[TaskKey, ...]]
    alias_readers: dict[TaskKey, tuple[tuple[TaskKey, int], ...]]


def recomputed_ops(rt, names: frozenset[str]) -> frozenset[int]:
    """The indices of the named ops the rank recomputes (``soap/recompute.py``)."""
    return frozenset(
        i for i, op in enumerate(rt.graph.ops) if recomputes(op, rt.pg.sums[op.name], names)
    )


def recompute_plan(rt, names: frozenset[str]) -> RecomputePlan | None:
    """The rank's plan for the named ops; None where it recomputes nothing."""
    ops = recomputed_ops(rt, names)
    last: dict[TaskKey, int] = {}
    events: list[Event] = []
    for ins in _one_forward(rt.program):
        if isinstance(ins, Compute):
            key = (ins.op, ins.task)
            events.append(compute_event(key))
            read = [key] if ins.op in ops else []
            read += [p for p in _local_reads(rt.buffers.inputs.get(key, ())) if p[0] in ops]
        elif isinstance(ins, Send):
            events.append(send_event(ins.transfer.id))
            producer = ins.transfer.producer
            read = [producer] if producer[0] in ops else []
        else:
            continue
        for key in read:
            last[key] = len(events) - 1
    if not last:
        return None
    drop_after: dict[Event, list[TaskKey]] = defaultdict(list)
    for key, at in last.items():
        drop_after[events[at]].append(key)
    readers: dict[TaskKey, list[tuple[TaskKey, int]]] = defaultdict(list)
    for consumer, sources in rt.buffers.inputs.items():
        for k, source in enumerate(sources):
            if isinstance(source, Alias) and source.producer in last:
                readers[source.producer].append((consumer, k))
    return RecomputePlan(
        ops,
        {e: tuple(keys) for e, keys in drop_after.items()},
        {p: tuple(r) for p, r in readers.items()},
    )


def _one_forward(program):
    """The forward instructions of one microbatch (every microbatch of a pipeline runs
    the same ones, in the same order, on its own ``Step``)."""
    return (
        ins
        for ins in program.instructions
        if isinstance(ins, Compute | Send)
        and ins.microbatch == 0
        and phase_of(ins) is Phase.FORWARD
    )


def _local_reads(sources) -> list[TaskKey]:
    """The local tasks whose output tiles a task's forward reads."""
    read = []
    for source in sources:
        if isinstance(source, Alias):
            read.append(source.producer)
        elif isinstance(source, Assembled):
            read += [c.peer for c in source.copies if c.transfer is None]
    return read
