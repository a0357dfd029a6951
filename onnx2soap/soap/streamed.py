"""Ring attention's blocks: which keys a streamed task (``OpDef.streams``) takes in
which order, one answer for the executor (``executor/step.py``), the simulator
(``sim/taskgraph.py``) and the memory model (``sim/memory.py``).

Where an attention's queries are split over devices and the keys are as many as the
queries (self-attention, the sequence split alike: context parallelism), each device
makes the keys and values of its own queries' positions. A query task then takes the
keys in one block a device, its own device's first, then each other device's in ring
order (the previous device's, the one before it, ...: what a ring that passes each
device's block on to the next brings in turn), and the blocks past its causal diagonal
last, which it needs for nothing but holds (its backward reads the whole buffer). Its
kernel works on a block as soon as that block's pieces are there, carrying its online
softmax across blocks, so the later blocks' transfers overlap the earlier ones' work.

A block's share of the task's work is its (query, key) pairs over the task's (a causal
kernel's pairs past the diagonal are free: ``LoopNest.causal_pairs``), so the chain of
per-block tasks costs what the whole task costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from onnx2soap.ir import LoopNest, Op
from onnx2soap.ops import definition
from onnx2soap.soap.partition import Interval, Rect, Task


@dataclass(frozen=True)
class KeyBlock:
    """The keys one device makes, as a streamed task takes them."""

    device: int
    spans: tuple[Interval, ...]  # global key intervals, ascending
    share: float  # of the task's work


def _pairs(nest: LoopNest, rows: Interval, keys: Interval) -> int:
    """(query, key) pairs the kernel computes for ``rows`` over ``keys``."""
    if nest.causal is None:
        return (rows[1] - rows[0]) * (keys[1] - keys[0])
    return LoopNest.causal_pairs(rows, keys, nest.causal[2])


def key_blocks(op: Op, tasks: Sequence[Task], task: Task) -> tuple[KeyBlock, ...]:
    """The blocks ``task`` of ``op`` takes its streamed operands in, in order; () where
    it takes them whole (the op streams nothing, its queries are on one device, or the
    keys are not the queries' positions)."""
    streams = definition(op.type).streams
    if streams is None:
        return ()
    dims = op.nest.dims
    if dims[streams.rows].size != dims[streams.keys].size:
        return ()
    rows = streams.rows
    peers = [t for t in tasks if _same_but(t.box, task.box, rows)]
    spans: dict[int, list[Interval]] = {}
    for t in peers:  # devices in the order of their first queries' tiles
        spans.setdefault(t.device, []).append(t.box[rows])
    if len(spans) < 2:
        return ()
    ring = list(spans)
    at = ring.index(task.device)
    order = [ring[(at - s) % len(ring)] for s in range(len(ring))]
    mine = task.box[rows]
    work = [sum(_pairs(op.nest, mine, span) for span in spans[d]) for d in order]
    total = sum(work) or 1
    blocks = [
        KeyBlock(d, tuple(sorted(spans[d])), w / total) for d, w in zip(order, work, strict=True)
    ]
    # blocks it computes nothing on (past its causal diagonal) last: nothing waits on them
    return tuple(b for b in blocks if b.share > 0) + tuple(b for b in blocks if b.share == 0)


def _same_but(a: Rect, b: Rect, dim: int) -> bool:
    return all(x == y for i, (x, y) in enumerate(zip(a, b, strict=True)) if i != dim)


def block_of(blocks: Sequence[KeyBlock], keys: Interval) -> int:
    """The first block (in the order taken) holding any of ``keys``: the one a piece
    over them must be there for."""
    return span_of([b.spans for b in blocks], keys)


def span_of(spans: Sequence[Sequence[Interval]], keys: Interval) -> int:
    """``block_of`` over the blocks' key spans alone."""
    lo, hi = keys
    for j, block in enumerate(spans):
        if any(a < hi and lo < b for a, b in block):
            return j
    raise ValueError(f"keys {keys} lie in no block")


def streams_operand(op: Op, tasks: Sequence[Task], operand: int) -> bool:
    """Whether some task of ``op`` takes ``operand`` block by block."""
    streams = definition(op.type).streams
    if streams is None or operand not in streams.operands:
        return False
    return any(key_blocks(op, tasks, t) for t in tasks)


def widest_span(blocks: Sequence[KeyBlock]) -> int:
    """The most keys one span of ``blocks`` holds (0: none, the task takes them whole)."""
    return max((hi - lo for b in blocks for lo, hi in b.spans), default=0)
