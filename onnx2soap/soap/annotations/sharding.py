"""One op's config in the terms of ONNX's multi-device standard (``ShardingSpecProto``).

The standard says, for an input or output of a node, which axes are cut into how many
blocks and which device, or group of devices (replicas), holds each block; blocks are
numbered row-major over the cut axes in the order they are listed. A SOAP config says
it for the op's iteration dims; each tensor's sharding follows from the access maps:

- the output: a split kept dim cuts the output axis it indexes. Tasks that differ only
  in split reduction dims (partial sums) all end with the summed block: a group, as the
  standard's reductions broadcast their result to every device that took part.
- an input: an axis a dim reads one to one (``direct_dim``) is cut as the dim is; the
  tasks that read the same block (they differ in dims the input does not read) are its
  replicas, a group.
- an input read through windows, offsets or channel groups along a split dim (a Conv's
  halo, a Concat's part, a grouped Conv's channels): the standard has no words for
  such a region, so it gets no sharding (``input_shardings`` leaves it out).

Blocks are SOAP's balanced chunks (``numpy.array_split``; whole groups for a grouped
Conv's channels), which the standard leaves to the backend where a cut is uneven.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product

from onnx2soap.ir import Affine, AxisMap, Broadcast, Grouped, LoopNest, Op, Whole
from onnx2soap.soap.partition import ParallelConfig, task_coords


@dataclass(frozen=True)
class Cut:
    """An axis cut into ``shards`` blocks; ``size`` is its length (None where unknown:
    a symbolic ``dim_param``)."""

    axis: int
    shards: int
    size: int | None


@dataclass(frozen=True)
class Sharding:
    """How one tensor of a node is laid out over the devices: ``holders[b]`` are the
    devices holding block ``b``, blocks row-major over ``cuts`` in their order."""

    tensor: str
    cuts: tuple[Cut, ...]
    holders: tuple[frozenset[int], ...]

    def canonical(self) -> Sharding:
        """The same layout with its cuts in axis order and cuts into one block dropped,
        so that two spellings of one layout compare equal."""
        keep = sorted((i for i, c in enumerate(self.cuts) if c.shards > 1), key=self._axis)
        holders = []
        for coord in product(*(range(self.cuts[i].shards) for i in keep)):
            at = dict(zip(keep, coord, strict=True))  # a dropped cut's one block is 0
            holders.append(self.holders[self.block([at.get(i, 0) for i in range(len(self.cuts))])])
        return Sharding(self.tensor, tuple(self.cuts[i] for i in keep), tuple(holders))

    def _axis(self, i: int) -> int:
        return self.cuts[i].axis

    def block(self, coord: Sequence[int]) -> int:
        """The index of the block at ``coord`` (one index per cut)."""
        index = 0
        for cut, c in zip(self.cuts, coord, strict=True):
            index = index * cut.shards + c
        return index


def dims_read(m: AxisMap) -> tuple[int, ...]:
    """The iteration dims an operand axis's index depends on."""
    if isinstance(m, Affine):
        return m.dims
    if isinstance(m, Grouped):
        return (m.dim,)
    if isinstance(m, Whole):
        return m.dims
    assert isinstance(m, Broadcast)
    return ()


def direct_dim(nest: LoopNest, operand: int, axis: int, size: int) -> int | None:
    """The dim that reads axis ``axis`` (of length ``size``) of input ``operand`` one to
    one, index for index: cutting the dim cuts the axis into the same blocks."""
    m = nest.inputs[operand].axes[axis]
    if not isinstance(m, Affine) or len(m.terms) != 1 or m.offset != 0:
        return None
    dim, coef = m.terms[0]
    return dim if coef == 1 and nest.dims[dim].size == size else None


def output_dims(op: Op, sharding: Sharding) -> tuple[int | None, ...]:
    """The dim that cuts each cut axis of the op's output (None: a size-1 axis)."""
    out = op.nest.out_dims
    return tuple(out[c.axis] if 0 <= c.axis < len(out) else None for c in sharding.cuts)


def input_dims(
    op: Op, operand: int, sharding: Sharding, shape: Sequence[int]
) -> tuple[int | None, ...]:
    """The dim that reads each cut axis of input ``operand`` one to one (None where
    no dim does: the cut cannot say which task reads which block)."""
    return tuple(
        direct_dim(op.nest, operand, c.axis, shape[c.axis]) if 0 <= c.axis < len(shape) else None
        for c in sharding.cuts
    )


def _holders(config: ParallelConfig, dims: Sequence[int]) -> tuple[frozenset[int], ...]:
    """Per block of the dims ``dims`` (row-major): the devices of the tasks in it (every
    copy's: a replicated block's device group)."""
    found: dict[tuple[int, ...], set[int]] = {}
    coords = (c for c in task_coords(config.degrees) for _ in range(config.copies))
    for coord, device in zip(coords, config.devices, strict=True):
        found.setdefault(tuple(coord[d] for d in dims), set()).add(device)
    blocks = product(*(range(config.degrees[d]) for d in dims))
    return tuple(frozenset(found[b]) for b in blocks)


def output_sharding(op: Op, config: ParallelConfig) -> Sharding:
    nest, degrees = op.nest, config.degrees
    cuts, dims = [], []
    for axis, d in enumerate(nest.out_dims):
        if d is not None and degrees[d] > 1:
            cuts.append(Cut(axis, degrees[d], nest.dims[d].size))
            dims.append(d)
    return Sharding(op.output, tuple(cuts), _holders(config, dims))


def _input_sharding(
    op: Op, config: ParallelConfig, operand: int, shape: Sequence[int]
) -> Sharding | None:
    """None where a split dim reads the input other than one to one."""
    nest, degrees = op.nest, config.degrees
    cuts, dims = [], []
    for axis, m in enumerate(nest.inputs[operand].axes):
        if not any(degrees[d] > 1 for d in dims_read(m)):
            continue
        d = direct_dim(nest, operand, axis, shape[axis])
        if d is None:
            return None
        cuts.append(Cut(axis, degrees[d], shape[axis]))
        dims.append(d)
    return Sharding(op.inputs[operand], tuple(cuts), _holders(config, dims))


def input_shardings(
    op: Op, config: ParallelConfig, shapes: Sequence[Sequence[int]]
) -> dict[str, Sharding]:
    """The sharding of each input tensor the standard can state (see the module's
    notes), by tensor name; a tensor read twice in two layouts (``Mul(x, x)`` never is)
    gets none."""
    found: dict[str, Sharding | None] = {}
    for k, shape in enumerate(shapes):
        s = _input_sharding(op, config, k, shape)
        name = op.inputs[k]
        found[name] = s if found.get(name, s) == s else None
    return {name: s for name, s in found.items() if s is not None}


def block_count(cuts: Sequence[Cut]) -> int:
    return math.prod(c.shards for c in cuts)
