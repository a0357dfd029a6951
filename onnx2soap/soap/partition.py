"""The one partition math: task boxes, operand regions, overlaps, weight replica groups.

The simulator turns these into tasks and bytes, the executor into kernels, sends and
receives; neither recomputes them.

Coordinates are half-open intervals ``(lo, hi)``; a ``Rect`` has one per tensor axis.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import product

from onnx2soap.ir import Affine, AxisMap, Broadcast, Grouped, IterDim, LoopNest, Op, Whole

Interval = tuple[int, int]
Rect = tuple[Interval, ...]


def chunk(size: int, degree: int, index: int) -> Interval:
    """Chunk ``index`` of ``degree`` balanced chunks of ``range(size)`` (numpy.array_split)."""
    base, extra = divmod(size, degree)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def rect_volume(rect: Rect) -> int:
    # A plain loop: called per overlap and per task, where a generator costs twice this.
    n = 1
    for lo, hi in rect:
        if hi <= lo:
            return 0
        n *= hi - lo
    return n


def rect_contiguous(rect: Rect, origin: Rect) -> bool:
    """Whether ``rect`` of an array spanning ``origin`` is one C-contiguous run (as numpy
    says: axes of extent 1 do not count), so that sending it needs no staging copy."""
    if rect_volume(rect) == 0:
        return True
    cut = False
    for (lo, hi), (olo, ohi) in zip(rect, origin, strict=True):
        if cut and hi - lo != ohi - olo:
            return False
        cut = cut or hi - lo > 1
    return True


def rect_shape(rect: Rect) -> tuple[int, ...]:
    return tuple(max(0, hi - lo) for lo, hi in rect)


def intersect(a: Rect, b: Rect) -> Rect | None:
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b, strict=True):
        lo, hi = max(alo, blo), min(ahi, bhi)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def task_coords(degrees: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Task grid coordinates in row-major order (task index = position in this order)."""
    return product(*(range(d) for d in degrees))


def task_box(nest: LoopNest, degrees: Sequence[int], coord: Sequence[int]) -> Rect:
    """Balanced chunks per dim, in units of the dim's granule (whole groups)."""
    return tuple(
        _dim_chunk(dim, deg, c) for dim, deg, c in zip(nest.dims, degrees, coord, strict=True)
    )


def _dim_chunk(dim: IterDim, degree: int, index: int) -> Interval:
    lo, hi = chunk(dim.size // dim.granule, degree, index)
    return lo * dim.granule, hi * dim.granule


def output_rect(nest: LoopNest, box: Rect) -> Rect:
    return tuple((0, 1) if d is None else box[d] for d in nest.out_dims)


def _image(m: AxisMap, box: Rect, size: int) -> Interval:
    if isinstance(m, Affine):  # the common case first: this runs per task and operand axis
        lo = hi = m.offset
        for d, c in m.terms:
            lo += c * box[d][0]
            hi += c * (box[d][1] - 1)
        return lo, hi + 1
    if isinstance(m, Broadcast):
        return 0, 1
    if isinstance(m, Whole):
        return 0, size
    lo, hi = box[m.dim]  # Grouped
    first, last = lo // m.out_per_group, (hi - 1) // m.out_per_group
    return first * m.in_per_group, (last + 1) * m.in_per_group


@dataclass(frozen=True)
class Region:
    """What one task reads of one operand.

    ``data`` is the part inside the tensor (what has to be on the task's device);
    ``buffer`` is the span of the task's input buffer: equal to ``data``, or, for window
    operands with a pad value, reaching past the tensor where the buffer holds the pad
    value. An empty ``data`` (a Concat input outside the task's box) has zero extent.
    """

    buffer: Rect
    data: Rect
    pad_value: float | None

    @property
    def empty(self) -> bool:
        return rect_volume(self.data) == 0

    @property
    def valid(self) -> tuple[Interval, ...]:
        """Where ``data`` lies inside the buffer, in buffer-local coordinates.

        Where the data is empty (a task whose windows read only padding) the interval is
        empty and may lie outside the buffer; it still marks where the tensor's edge is,
        which is what an average pool's divisor needs."""
        return tuple(
            (dlo - blo, dhi - blo)
            for (blo, _), (dlo, dhi) in zip(self.buffer, self.data, strict=True)
        )


def input_region(nest: LoopNest, operand: int, box: Rect, shape: Sequence[int]) -> Region:
    spec = nest.inputs[operand]
    images = [_image(m, box, size) for m, size in zip(spec.axes, shape, strict=True)]
    data = []
    for (lo, hi), size in zip(images, shape, strict=True):
        clo = 0 if lo < 0 else size if lo > size else lo  # min(max(lo, 0), size)
        chi = size if hi > size else hi
        data.append((clo, chi if chi > clo else clo))
    if spec.pad_value is None:
        return Region(tuple(data), tuple(data), None)
    return Region(tuple(images), tuple(data), spec.pad_value)


@dataclass(frozen=True)
class ParallelConfig:
    """How one op is split: a degree per iteration dim (1 for dims not split) and the
    device of every task, tasks in row-major order of the degree grid.

    ``copies`` > 1 (a weight-only op alone, ``soap/copies.py``): each box is computed
    that many times, on distinct devices; task ``box * copies + copy`` (box-major). A
    reader takes its piece from the copy on its own device where there is one, else
    from the box's first copy (its owner); each copy's weight gradients are summed over
    its replica group as any replica's."""

    degrees: tuple[int, ...]
    devices: tuple[int, ...]
    copies: int = 1

    @property
    def tasks(self) -> int:
        return len(self.devices)

    @property
    def boxes(self) -> int:
        return math.prod(self.degrees)


@dataclass(frozen=True)
class Task:
    op: str
    index: int
    device: int
    box: Rect
    output: Rect
    inputs: tuple[Region, ...]

    @property
    def points(self) -> int:
        return rect_volume(self.box)


def op_tasks(op: Op, config: ParallelConfig, shapes: Sequence[Sequence[int]]) -> tuple[Task, ...]:
    """The tasks of ``op`` under ``config``; ``shapes`` are the operand tensor shapes.

    An operand's region depends only on the dims its axes read, so tasks that agree on
    those share one region, made once (replicas read the same weight, a batch split's
    tasks the same channels)."""
    nest = op.nest
    chunks = [
        [_dim_chunk(dim, deg, c) for c in range(deg)]
        for dim, deg in zip(nest.dims, config.degrees, strict=True)
    ]
    read = [_dims_read(spec.axes) for spec in nest.inputs]
    regions: dict[tuple, Region] = {}
    tasks = []
    copies = config.copies
    for b, coord in enumerate(task_coords(config.degrees)):
        box = tuple([chunks[d][c] for d, c in enumerate(coord)])
        inputs = []
        for i, s in enumerate(shapes):
            key = (i, *[box[d] for d in read[i]])
            if key not in regions:
                regions[key] = input_region(nest, i, box, s)
            inputs.append(regions[key])
        out, inputs = output_rect(nest, box), tuple(inputs)
        for index in range(b * copies, (b + 1) * copies):
            tasks.append(Task(op.name, index, config.devices[index], box, out, inputs))
    return tuple(tasks)


def copy_groups(tasks: Sequence[Task]) -> dict[int, dict[int, int]]:
    """Per box computed more than once (a config with ``copies``), keyed by its first
    copy's task index (the owner): the copy task on each device, the first where one
    device had several. Empty for a config without copies. Copies are the tasks with
    the same box: a split partial dim's tasks differ in their boxes."""
    by_box: dict[Rect, dict[int, int]] = {}
    owner: dict[Rect, int] = {}
    for t in tasks:
        by_box.setdefault(t.box, {}).setdefault(t.device, t.index)
        owner.setdefault(t.box, t.index)
    if len(by_box) == len(tasks):
        return {}
    return {owner[box]: on for box, on in by_box.items()}


def _dims_read(axes: Sequence[AxisMap]) -> tuple[int, ...]:
    """The iteration dims an operand's region depends on (``_image``)."""
    dims: list[int] = []
    for m in axes:
        if isinstance(m, Grouped):
            dims.append(m.dim)
        elif not isinstance(m, (Broadcast, Whole)):
            dims.extend(d for d, _ in m.terms)
    return tuple(sorted(set(dims)))


@dataclass(frozen=True)
class Overlap:
    """``rect`` of a tensor moves from a producer task to a consumer task's operand;
    ``volume`` is its element count (``rect_volume(rect)``, counted where it is found)."""

    src_task: int
    dst_task: int
    operand: int
    rect: Rect
    volume: int


def overlaps(
    producers: Sequence[Task], consumers: Sequence[Task], operand: int
) -> tuple[Overlap, ...]:
    """Which producer tiles feed which consumer regions. The producer tiles partition the
    tensor, so the overlaps of one consumer region cover it exactly once.

    Found per distinct region (replicated consumers read the same one) from a per-axis
    index of the tiles: a producer overlaps a region where its interval overlaps on every
    axis, so only those producers are intersected. A region's pieces come in the order
    of their producers' devices, then tasks: where a device has several tiles that are
    not neighbours in task order (head-tail chunks: devices 0, 1, .., 1, 0), its pieces
    to one reader go one after the other, not interleaved with the other devices' on
    the links (LLaMA-3-8B at 32k tokens on 8 H100s, head-tail context parallelism: a
    1.07 s step in task order, 0.86 s in device order)."""
    index = _TileIndex(producers)
    device_of = {t.index: t.device for t in producers}
    found = []
    by_region: dict[Rect, list[tuple[int, Rect, int]]] = {}
    for c in consumers:
        data = c.inputs[operand].data
        if data not in by_region:
            pieces = index.intersections(data)
            pieces.sort(key=lambda x: device_of[x[0]])  # stable: tasks in order per device
            by_region[data] = pieces
        for p, rect, volume in by_region[data]:
            found.append(Overlap(p, c.index, operand, rect, volume))
    return tuple(found)


class _TileIndex:
    """Per axis, the producers' distinct output intervals, each with a bit mask of the
    producers (by position) that have it."""

    def __init__(self, producers: Sequence[Task]) -> None:
        self.producers = producers
        rank = len(producers[0].output) if producers else 0
        self.axes: list[dict[Interval, int]] = [{} for _ in range(rank)]
        for k, t in enumerate(producers):
            for masks, interval in zip(self.axes, t.output, strict=True):
                masks[interval] = masks.get(interval, 0) | 1 << k
        self.cut: dict[tuple[int, Interval], tuple[int, dict, dict]] = {}

    def intersections(self, data: Rect) -> list[tuple[int, Rect, int]]:
        """(producer task index, intersection, its volume) of every producer tile that
        overlaps ``data``, in producer order (none where ``data`` is empty)."""
        if not self.producers or rect_volume(data) == 0:
            return []
        hits = (1 << len(self.producers)) - 1
        clips, lengths = [], []
        for axis, interval in enumerate(data):
            key = (axis, interval)
            if key not in self.cut:
                self.cut[key] = self._cut(self.axes[axis], interval)
            mask, clip, length = self.cut[key]
            hits &= mask
            if not hits:
                return []
            clips.append(clip)
            lengths.append(length)
        out = []
        get = dict.__getitem__
        while hits:
            low = hits & -hits
            hits ^= low
            p = self.producers[low.bit_length() - 1]
            rect = tuple(map(get, clips, p.output))
            out.append((p.index, rect, math.prod(map(get, lengths, p.output))))
        return out

    @staticmethod
    def _cut(masks: dict[Interval, int], data: Interval) -> tuple[int, dict, dict]:
        """Along one axis: the producers whose interval overlaps ``data``, and each such
        interval clipped to ``data`` and its length (a tile's intersection is then one
        look-up per axis; regions share most of their axes' intervals)."""
        dlo, dhi = data
        hits, clip, length = 0, {}, {}
        for interval, mask in masks.items():
            lo, hi = interval
            lo, hi = (lo if lo > dlo else dlo), (hi if hi < dhi else dhi)
            if lo < hi:
                hits |= mask
                clip[interval], length[interval] = (lo, hi), hi - lo
        return hits, clip, length


@dataclass(frozen=True)
class StatGroup:
    """Tasks of an op with statistics (``LoopNest.sync_dims``) whose boxes differ only in
    the sync dims. Each task puts its partial statistics in its slot (its position in
    ``tasks``) of a zeroed array, the group all-reduces it over ``devices`` (distinct,
    sorted): a sum that adds only zeros to each slot, so exact, and every member then
    combines the slots in the same order. ``numel`` is that array's length, per phase."""

    tasks: tuple[int, ...]
    devices: tuple[int, ...]
    numel: tuple[int, int]  # forward, backward


def stat_groups(op: Op, tasks: Sequence[Task]) -> tuple[StatGroup, ...]:
    nest = op.nest
    if not nest.sync_dims:
        return ()
    others = [i for i in range(len(nest.dims)) if i not in nest.sync_dims]
    by_box: dict[Rect, list[Task]] = {}
    for t in tasks:
        by_box.setdefault(tuple(t.box[i] for i in others), []).append(t)
    return tuple(
        StatGroup(
            tasks=tuple(t.index for t in members),
            devices=tuple(sorted({t.device for t in members})),
            numel=tuple(len(members) * v * rect_volume(box) for v in nest.sync_values),
        )
        for box, members in by_box.items()
    )


@dataclass(frozen=True)
class Scatter:
    """A sum group reduce-scattered rather than all-reduced (``soap/sum_scatter.py``):
    member ``i`` (in ``SumGroup.devices`` order) ends with the sum of ``chunks[i]`` only,
    consecutive blocks of the tile along ``axis`` that together cover it. The ring works
    on the tile laid out with ``axis`` first (C order), where every chunk is one run."""

    axis: int
    chunks: tuple[Rect, ...]

    def in_place(self, tile: Rect) -> bool:
        """Whether the tile's own C order is already the ring's (no axis before ``axis``
        longer than 1), so that the partial tile is summed where it is, not copied."""
        return all(hi - lo == 1 for lo, hi in tile[: self.axis])

    def runs(self, tile: Rect) -> tuple[Interval, ...]:
        """Each chunk's run of the flat tile laid out with ``axis`` first."""
        rest = rect_volume(tile) // max(1, tile[self.axis][1] - tile[self.axis][0])
        first = tile[self.axis][0]
        return tuple(
            ((c[self.axis][0] - first) * rest, (c[self.axis][1] - first) * rest)
            for c in self.chunks
        )


@dataclass(frozen=True)
class SumGroup:
    """Tasks of an op with ``LoopNest.partial_dims`` (a split reduction dim: MatMul's,
    Gemm's and Conv's contraction, an embedding's vocabulary) that write the same output
    tile: each computes a partial tile, and the group all-reduces them over ``devices``
    (distinct, sorted), so that every member device ends with the sum.

    Per device, its first member task, its *holder*, holds the summed tile: a consumer
    on a member device reads it there, with no transfer (Megatron's all-reduce after a
    row-parallel linear); a consumer elsewhere reads it from ``owner``, the first task.
    In the backward every holder assembles the gradient pieces its readers send it,
    and the same all-reduce sums them, so that every member task gets the whole tile's
    gradient. ``numel`` is the tile's size.

    With ``scatter`` (where each member's readers need a disjoint part of the tile) the
    group reduce-scatters instead: each holder holds only its chunk of the sum, every
    reader reads from the holders of the chunks it overlaps, and in the backward an
    all-gather of the holders' chunk gradients gives every task the whole tile's."""

    tasks: tuple[int, ...]
    devices: tuple[int, ...]
    numel: int
    holders: tuple[int, ...] = ()  # per device of ``devices``, its first member task
    tile: Rect = ()
    scatter: Scatter | None = None

    @property
    def owner(self) -> int:
        return self.tasks[0]

    def holder(self, device: int) -> int | None:
        """The member task on ``device`` that holds the sum; None off the group."""
        for d, t in zip(self.devices, self.holders, strict=True):
            if d == device:
                return t
        return None

    def held(self, device: int) -> Rect:
        """The part of the tile the holder on ``device`` (a member) ends with."""
        if self.scatter is None:
            return self.tile
        return self.scatter.chunks[self.devices.index(device)]

    def held_numel(self, device: int) -> int:
        return rect_volume(self.held(device))


def sum_groups(op: Op, tasks: Sequence[Task]) -> tuple[SumGroup, ...]:
    """The op's groups of partial tiles; none where the config splits no partial dim:
    then every task computes its whole tile, as any op's does. All are all-reduced:
    ``sum_scatter.scattered`` decides, from the readers, which reduce-scatter."""
    if not op.nest.partial_dims:
        return ()
    by_tile: dict[Rect, list[Task]] = {}
    boxes: set[Rect] = set()
    for t in tasks:
        by_tile.setdefault(t.output, []).append(t)
        boxes.add(t.box)
    if len(by_tile) == len(boxes):
        return ()  # every tile whole (computed once, or copied: ``copy_groups``)
    if len(boxes) < len(tasks):
        raise ValueError(f"op '{op.name}': copies of partial sums (a split reduction dim)")
    groups = []
    for tile, members in by_tile.items():
        first: dict[int, int] = {}
        for t in members:
            first.setdefault(t.device, t.index)
        devices = tuple(sorted(first))
        groups.append(
            SumGroup(
                tasks=tuple(t.index for t in members),
                devices=devices,
                numel=rect_volume(tile),
                holders=tuple(first[d] for d in devices),
                tile=tile,
            )
        )
    return tuple(groups)


def held_rects(groups: Sequence[SumGroup]) -> dict[int, Rect]:
    """Per task whose output array is not its own tile: the chunk a reduce-scattering
    group's holder ends with (the rect its array spans)."""
    held: dict[int, Rect] = {}
    for g in groups:
        if g.scatter is not None:
            for d, h in zip(g.devices, g.holders, strict=True):
                held[h] = g.held(d)
    return held


def owners(op: Op, tasks: Sequence[Task]) -> tuple[Task, ...]:
    """The tasks whose output tiles partition the tensor: all of them, or for an op with
    partial sums the first task of each tile, or for one with copies each box's first
    copy."""
    groups = sum_groups(op, tasks)
    if groups:
        first = {g.owner for g in groups}
        return tuple(t for t in tasks if t.index in first)
    copied = copy_groups(tasks)
    if copied:
        return tuple(t for t in tasks if t.index in copied)
    return tuple(tasks)


def summed_overlaps(
    op: Op,
    producers: Sequence[Task],
    consumers: Sequence[Task],
    operand: int,
    groups: Sequence[SumGroup] | None = None,
) -> tuple[Overlap, ...]:
    """``overlaps`` of a producer's tiles into ``consumers``' regions; for an op with
    partial sums (``groups``: its sum groups, ``sum_groups``'s when None) each piece comes
    from the holder of the sum on the consumer's device where the tile's group has one
    (no transfer), else from the tile's owner; where the group reduce-scatters, from the
    holders of the chunks the piece overlaps, one piece per chunk. For an op with copies
    (``copy_groups``) likewise: from the box's copy on the consumer's device where there
    is one, else from its first copy."""
    found = overlaps(owners(op, producers), consumers, operand)
    groups = sum_groups(op, producers) if groups is None else groups
    if not groups:
        copied = copy_groups(producers)
        if not copied:
            return found
        return tuple(
            replace(o, src_task=copied[o.src_task].get(consumers[o.dst_task].device, o.src_task))
            for o in found
        )
    group_of = {g.owner: g for g in groups}
    moved = []
    for o in found:
        group = group_of[o.src_task]
        if group.scatter is not None:
            for holder, chunk_rect in zip(group.holders, group.scatter.chunks, strict=True):
                rect = intersect(o.rect, chunk_rect)
                if rect is not None:
                    moved.append(replace(o, src_task=holder, rect=rect, volume=rect_volume(rect)))
            continue
        holder = group.holder(consumers[o.dst_task].device)
        moved.append(o if holder is None else replace(o, src_task=holder))
    return tuple(moved)


@dataclass(frozen=True)
class ReplicaGroup:
    """Tasks of one op that read the same Rect of a weight (or a state tensor); each of
    ``devices`` (distinct, sorted) holds one copy of the Rect. A weight's gradients are
    summed over them; a state tensor's copies are updated alike by the op's forward."""

    weight: str
    operand: int
    rect: Rect
    tasks: tuple[int, ...]
    devices: tuple[int, ...]
    trainable: bool = True


def replica_groups(
    op: Op, tasks: Sequence[Task], weight_operands: Sequence[int], state_operands=()
) -> tuple[ReplicaGroup, ...]:
    groups = []
    for operand in (*weight_operands, *state_operands):
        by_rect: dict[Rect, list[Task]] = {}
        for t in tasks:
            by_rect.setdefault(t.inputs[operand].data, []).append(t)
        for rect, members in by_rect.items():
            groups.append(
                ReplicaGroup(
                    weight=op.inputs[operand],
                    operand=operand,
                    rect=rect,
                    tasks=tuple(t.index for t in members),
                    devices=tuple(sorted({t.device for t in members})),
                    trainable=operand not in state_operands,
                )
            )
    return tuple(groups)
