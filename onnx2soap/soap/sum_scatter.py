"""Which partial sums reduce-scatter rather than all-reduce (issue 31).

A sum group (``partition.SumGroup``) all-reduces its partial tiles so that every member
device holds the whole sum. Where the readers on each member device read only a part of
the tile, and those parts are disjoint between the members (a row-parallel linear read
by an op split by samples or along the sequence over the same devices: Megatron's
LayerNorm and residual add), the group reduce-scatters instead: each member ends with
one chunk of the sum, half the ring's traffic of the all-reduce and 1/k of its tile.

The chunks are consecutive blocks of the tile along one axis, each member's covering
what its own readers read (their bounding box along that axis), together covering the
tile so that readers elsewhere get every piece from some member. The first axis along
which the members' parts are disjoint is taken (the outermost: most often a run of the
C-ordered tile already). A member with no reader of the tile, or parts that overlap
along every axis, keeps the all-reduce. The simulator, the memory model and the
executor all take the decision from here, through ``Partitioner.sums``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise

from onnx2soap.soap.partition import Interval, Rect, Scatter, SumGroup, Task, intersect

Reader = tuple[Sequence[Task], int]  # a consumer op's tasks and the operand it reads


def scattered(groups: Sequence[SumGroup], readers: Sequence[Reader]) -> tuple[SumGroup, ...]:
    """``groups`` with ``scatter`` set on those whose members' readers need disjoint
    parts of the tile (see the module's docstring); the others unchanged."""
    return tuple(_scatter(g, readers) for g in groups)


def _needs(group: SumGroup, readers: Sequence[Reader]) -> dict[int, list[Interval]] | None:
    """Per member device, the bounding box of what its readers read of the tile; None
    where the tile has no reader at all."""
    members = set(group.devices)
    boxes: dict[int, list[Interval]] = {}
    read = False
    for tasks, operand in readers:
        for t in tasks:
            part = intersect(t.inputs[operand].data, group.tile)
            if part is None:
                continue
            read = True
            if t.device not in members:
                continue
            box = boxes.get(t.device)
            if box is None:
                boxes[t.device] = list(part)
            else:
                boxes[t.device] = [
                    (min(a, c), max(b, d)) for (a, b), (c, d) in zip(box, part, strict=True)
                ]
    return boxes if read else None


def _scatter(group: SumGroup, readers: Sequence[Reader]) -> SumGroup:
    if len(group.devices) < 2:
        return group
    boxes = _needs(group, readers)
    if boxes is None or len(boxes) < len(group.devices):
        return group
    for axis, (lo, hi) in enumerate(group.tile):
        if hi - lo < 2:
            continue
        chunks = _chunks(group, boxes, axis)
        if chunks is not None:
            return replace(group, scatter=Scatter(axis, chunks))
    return group


def _chunks(group: SumGroup, boxes: dict[int, list[Interval]], axis: int):
    """Consecutive blocks of the tile along ``axis``, member by member in the order of
    their parts, each from the end of the one before to the end of its own part (the
    last to the tile's end); None where two members' parts overlap along ``axis``."""
    order = sorted(group.devices, key=lambda d: boxes[d][axis])
    for a, b in pairwise(order):
        if boxes[a][axis][1] > boxes[b][axis][0]:
            return None
    lo, end = group.tile[axis]
    spans: dict[int, Interval] = {}
    for k, d in enumerate(order):
        hi = end if k == len(order) - 1 else boxes[d][axis][1]
        spans[d] = (lo, hi)
        lo = hi
    tile: Rect = group.tile
    return tuple((*tile[:axis], spans[d], *tile[axis + 1 :]) for d in group.devices)
