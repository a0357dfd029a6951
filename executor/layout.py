"""Where every array of a rank's step comes from, decided once before the first step.

For each local task: how each input buffer is filled (a weight shard, a constant cut
once, rows of a data input, a local producer's whole tile or a whole received piece used
as it is, or a buffer the step makes and copies the pieces into), and how its
output gradient is gathered (a local consumer's gradient or one received piece used as
it is, or an array summed from pieces, which the step makes). Buffers made here are
reused by every step; their padding is written once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from executor.buffers import empty_buffer, global_slices, local_slices, slice_from_full
from executor.precision import HalfStorage
from executor.program import Piece
from onnx2soap.ir import TensorRole
from onnx2soap.soap.partition import Rect, Region, Task, rect_shape

TaskKey = tuple[int, int]  # (op index, task index)
Slices = tuple[slice, ...]


@dataclass(frozen=True)
class Fixed:
    """A weight or state shard, or a constant cut once: the same array every step."""

    array: object


@dataclass(frozen=True)
class Gathered:
    """ZeRO-3: a weight shard the rank holds rows of; the step gathers it whole for each
    phase of the op (``GatherWeight``, ``WaitWeight``: executor/step.py). Never kept
    from the forward to the backward: gathered again (but by a recomputed op)."""

    key: tuple[str, Rect]


@dataclass(frozen=True)
class Rows:
    """A data input or the labels: the task's rows copied from the batch every step into
    ``buffer`` (made once, padding included) at ``into``; ``data`` is the global rect.
    On a GPU the rows go through ``host`` (pinned: the copy runs asynchronously) and,
    where the buffer has padding, ``staged`` on the device."""

    name: str
    data: Rect
    buffer: object
    into: Slices
    host: object = None
    staged: object = None


@dataclass(frozen=True)
class Alias:
    """The producer's whole output tile is exactly this buffer: read it without a copy
    (kernels never write their inputs)."""

    producer: TaskKey


@dataclass(frozen=True)
class Received:
    """The operand's whole buffer (or the task's whole output gradient) is exactly one
    received piece: read the receive buffer of transfer ``transfer`` without a copy
    (kernels never write their inputs). The step makes it when it posts the receive."""

    transfer: int


@dataclass(frozen=True)
class Copy:
    """One piece of an assembled buffer: ``into`` the buffer, from the local producer's
    (or consumer's) array at ``source``, or from received transfer ``transfer``."""

    into: Slices
    peer: TaskKey
    operand: int
    source: Slices
    transfer: int | None


@dataclass(frozen=True)
class Assembled:
    """An input buffer for ``region`` the step makes (padding written) and fills from
    pieces; it lives while the task's forward runs, or to its backward where that reads
    it (``executor/lifetimes.py``). Every local task that assembles the same ``region``
    of the same tensor reads one such buffer (``share``): the first to run makes it
    (attention's query, key and value projections, all reading the gathered input)."""

    region: Region
    dtype: object
    copies: tuple[Copy, ...]
    half: HalfStorage
    # (tensor, region): what makes two the same; None: its own (padding only)
    share: tuple[str, Region] | None = None

    def make(self, xp):
        """A fresh buffer: the pieces cover the data, so only padding needs a value."""
        if self.region.buffer == self.region.data:
            return xp.empty(rect_shape(self.region.buffer), dtype=self.dtype)
        return _padded(xp, self.half, self.region, self.dtype)


InputSource = Fixed | Gathered | Rows | Alias | Received | Assembled


@dataclass(frozen=True)
class GradAlias:
    """The task's whole output gradient is one local consumer's input gradient."""

    consumer: TaskKey
    operand: int


@dataclass(frozen=True)
class GradSum:
    """The output gradient summed from pieces into a zeroed array of ``shape``, made by
    the step that gathers it and dropped after the task's backward."""

    shape: tuple[int, ...]
    copies: tuple[Copy, ...]


GradSource = GradAlias | Received | GradSum


def _whole(rect: Rect, origin: Rect) -> bool:
    return rect == origin


def input_source(rt, key: TaskKey, task: Task, k: int, pieces: list[Piece]) -> InputSource:
    """How input ``k`` of a local task is filled."""
    op = rt.graph.ops[key[0]]
    name, role, region = op.inputs[k], rt.roles[key[0]][k], task.inputs[k]
    if role in (TensorRole.WEIGHT, TensorRole.STATE):
        if (name, region.data) in rt.zero3:
            return Gathered((name, region.data))
        return Fixed(rt.weight_values((name, region.data)))
    if role is TensorRole.CONSTANT:
        return Fixed(_cut_constant(rt, name, region))
    if role in (TensorRole.INPUT, TensorRole.LABELS):
        # the rows come in the run's dtype; the buffer holds them as the step stores them
        dtype, stored = rt.dtype_of(name), rt.storage_of(name)
        buffer = padded_buffer(rt, region, stored)
        into = local_slices(region.data, region.buffer)
        if rt.xp is np:
            return Rows(name, region.data, buffer, into)
        shape = rect_shape(region.data)
        host = rt.device.host_empty(shape, dtype)
        direct = region.data == region.buffer and stored == dtype
        staged = None if direct else rt.xp.empty(shape, dtype=dtype)
        return Rows(name, region.data, buffer, into, host, staged)
    mine = [p for p in pieces if p.operand == k]
    if len(mine) == 1 and _whole(mine[0].rect, region.buffer):
        # A received piece is its receive buffer whole; a local one must be the
        # producer's whole tile (a part of it would be a strided view).
        if mine[0].transfer is not None:
            return Received(mine[0].transfer)
        if _whole(mine[0].rect, rt.output_rect(mine[0].peer)):
            return Alias(mine[0].peer)
    copies = tuple(
        Copy(
            local_slices(p.rect, region.buffer),
            p.peer,
            k,
            local_slices(p.rect, rt.output_rect(p.peer)),
            p.transfer,
        )
        for p in mine
    )
    share = (name, region) if copies else None
    return Assembled(region, rt.storage_of(name), copies, rt.half, share)


def padded_buffer(rt, region: Region, dtype):
    """A buffer for ``region`` in ``dtype``, its padding the pad value as stored."""
    return _padded(rt.xp, rt.half, region, dtype)


def _padded(xp, half: HalfStorage, region: Region, dtype):
    if half.active and dtype == half.dtype and region.pad_value:  # -inf's bits, say
        return half.narrow(empty_buffer(xp, region, np.float32))
    return empty_buffer(xp, region, dtype)


def _cut_constant(rt, name: str, region: Region):
    """A task's buffer of a constant: a copy of its region, or, for a broadcast constant
    (``Tensor.distinct``) read without padding, a view of it: a causal mask at the bound
    batch is held once, not once a layer."""
    full = rt.constants[name]
    if rt.graph.tensors[name].distinct and region.buffer == region.data:
        return full[global_slices(region.data)]
    return slice_from_full(rt.xp, full, region)


def grad_source(rt, key: TaskKey, pieces: tuple[Piece, ...]) -> GradSource:
    """How a local task's output gradient is gathered from its consumers' pieces (over
    the rect its output spans: a reduce-scattering sum's holder, its chunk)."""
    output = rt.output_rect(key)
    if len(pieces) == 1 and _whole(pieces[0].rect, output):
        p = pieces[0]
        if p.transfer is not None:
            return Received(p.transfer)
        if _whole(p.rect, rt.task(p.peer).inputs[p.operand].buffer):
            return GradAlias(p.peer, p.operand)
    copies = tuple(
        Copy(
            local_slices(p.rect, output),
            p.peer,
            p.operand,
            local_slices(p.rect, rt.task(p.peer).inputs[p.operand].buffer),
            p.transfer,
        )
        for p in pieces
    )
    return GradSum(rect_shape(output), copies)
