"""Recomputation: the plan's ``recompute`` ops keep no output from forward to backward.

A recomputed op's output tile is dropped as soon as the last forward instruction of
the rank that reads it has run (a local consumer's ``Compute``, or the ``Send`` of a
piece of it), together with every reference a consumer kept to it for its backward
(an ``Alias`` input). Before a backward instruction that needs it (the op's own where
its backward reads its output, or a consumer's that aliased it and keeps it, or a
recomputed consumer's, which runs its forward again from it) the tile is computed again
from its inputs, recursively where those were dropped too, and after the last such
backward it is dropped again (``release_after``; the op's own comes after its
consumers': the backward runs the ops in reverse order). On a pipeline every microbatch
has its ``Step`` and runs the same forward instructions: the same plan serves each.

Recomputing needs no message: a recomputed op keeps every input buffer to its backward
(weights, constants, data rows, received pieces, assembled buffers). So an op with
partial sums (its output is an all-reduce over its group) is kept, as is the loss; an
op with batch statistics is recomputed with the statistics its forward summed (kept for
its backward anyway), and Dropout with the same random key, so the recomputed tile
equals the forward's bit for bit.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from executor.layout import Alias, TaskKey
from executor.lifetimes import Event, after_last, compute_event, send_event, tiles_read
from executor.program import Compute, Phase, Send, phase_of
from onnx2soap.soap.recompute import recomputes
from onnx2soap.soap.saved import kept_for_backward


@dataclass(frozen=True)
class RecomputePlan:
    """When a rank drops each recomputed tile and who aliased it."""

    ops: frozenset[int]  # op indices recomputed on this rank
    drop_after: dict[Event, tuple[TaskKey, ...]]
    alias_readers: dict[TaskKey, tuple[tuple[TaskKey, int], ...]]
    # of ``ops``, those whose own backward reads their output tile
    own_output: frozenset[int] = frozenset()
    # a tile made again for its readers' backwards goes after the last of them, by
    # the task whose backward that is (``release_after``)
    release_after: dict[TaskKey, tuple[TaskKey, ...]] = field(default_factory=dict)


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
            read += [p for p in tiles_read(rt.buffers.inputs.get(key, ())) if p[0] in ops]
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
    readers: dict[TaskKey, list[tuple[TaskKey, int]]] = defaultdict(list)
    for consumer, sources in rt.buffers.inputs.items():
        for k, source in enumerate(sources):
            if isinstance(source, Alias) and source.producer in last:
                readers[source.producer].append((consumer, k))
    own = frozenset(i for i in ops if kept_for_backward(rt.graph, rt.graph.ops[i], False)[1])
    return RecomputePlan(
        ops,
        after_last(last, events),
        {p: tuple(r) for p, r in readers.items()},
        own,
        _release_after(rt, ops, own, frozenset(last)),
    )


def _release_after(rt, ops, own, dropped) -> dict[TaskKey, tuple[TaskKey, ...]]:
    """After which task's backward each dropped tile made again goes: the last, in the
    backward's order, of the tasks that make it again for their backward (a reader
    that keeps it, read in place, or a recomputed reader, which runs its forward again
    from it); for an op whose own backward reads it, that backward (``Step._drop``)."""
    last: dict[TaskKey, TaskKey] = {}
    for ins in rt.program.instructions:
        if not isinstance(ins, Compute) or ins.microbatch or ins.phase is not Phase.BACKWARD:
            continue
        key = (ins.op, ins.task)
        kept = kept_for_backward(rt.graph, rt.graph.ops[ins.op], ins.op in ops)[0]
        for k, source in enumerate(rt.buffers.inputs.get(key, ())):
            if isinstance(source, Alias) and source.producer in dropped and k in kept:
                last[source.producer] = key
    after: dict[TaskKey, list[TaskKey]] = defaultdict(list)
    for producer, key in last.items():
        if producer[0] not in own:
            after[key].append(producer)
    return {key: tuple(tiles) for key, tiles in after.items()}


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
