"""ZeRO stages 1, 2 and 3 (DeepSpeed; stage 3 is PyTorch's FSDP): a data-parallel replica
group shards what its copies would each hold whole.

A plan's ``zero_stage`` applies to every trainable replica group over k > 1 devices:

- stage 1: each member keeps the optimizer's state of its shard only; the gradient is
  reduce-scattered (each member ends with the sum of its shard; the full-size gradient
  buffer stays allocated until the update, as ZeRO-1 keeps full gradients), the member
  updates its shard and an all-gather gives every member the whole updated Rect;
- stage 2: as stage 1, but once the reduce-scatter is done the member keeps only its
  shard's gradient;
- stage 3: as stage 2, and the member keeps only its shard of the weight itself: before
  each forward and each backward of an op that reads it, every member all-gathers the
  whole Rect, which goes once the op's tasks on the member have run; after the update
  nothing is gathered (the next forward does).

The reduce-scatter and the all-gather together move the bytes of the ring all-reduce
they replace (``collectives.py``); the all-gather runs after the update.

A shard is a block of rows (axis 0) of the group's Rect: ``k`` balanced chunks as
``numpy.array_split`` cuts them, member ``i`` (in ``ReplicaGroup.devices`` order) the
``i``-th. Each shard is then itself a Rect (checkpoints, shard writes and re-sharding
reuse the Rect machinery) and one contiguous run of the Rect's C-ordered buffer (the
rings work on flat buffers with uneven counts). A Rect with fewer than k rows stays
whole (its group is all-reduced and updated as without ZeRO). The simulator, the
memory model and the executor all take shards from here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

from onnx2soap.errors import PlanError
from onnx2soap.soap.partition import Interval, Rect, ReplicaGroup, chunk


class ZeroStage(IntEnum):
    """What a data-parallel replica group shards across its devices."""

    NONE = 0
    OPTIMIZER = 1  # the optimizer's state
    GRADIENTS = 2  # and the summed gradient
    PARAMETERS = 3  # and the weights, gathered for each use

    @property
    def label(self) -> str:
        return "none" if self is ZeroStage.NONE else f"ZeRO-{int(self)}"

    @property
    def shards_gradients(self) -> bool:
        """Whether a member keeps only its rows of the summed gradient (stages 2, 3)."""
        return self >= ZeroStage.GRADIENTS

    @property
    def shards_weights(self) -> bool:
        """Whether a member keeps only its rows of the weight (stage 3)."""
        return self is ZeroStage.PARAMETERS


ZERO_STAGES = (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS)


def zero_stage(value: int) -> ZeroStage:
    """A stage a plan or an option may name (1, 2 or 3); ``ValueError`` otherwise."""
    if isinstance(value, bool) or value not in [int(s) for s in ZERO_STAGES]:
        raise ValueError(f"a ZeRO stage is 1, 2 or 3, got {value!r}")
    return ZeroStage(value)


def row_shards(rect: Rect, members: int) -> tuple[Rect, ...] | None:
    """``members`` balanced row blocks of ``rect``; None where it has fewer rows (or no
    axis), so that no member's shard is empty."""
    if members < 2 or not rect:
        return None
    lo, hi = rect[0]
    if hi - lo < members:
        return None
    blocks = (chunk(hi - lo, members, i) for i in range(members))
    return tuple(((lo + a, lo + b), *rect[1:]) for a, b in blocks)


@dataclass(frozen=True)
class ZeroGroup:
    """A sharded replica group: per member (``group.devices`` order) its Rect and where
    that Rect lies in the group Rect's C-ordered flat buffer."""

    group: ReplicaGroup
    shards: tuple[Rect, ...]
    chunks: tuple[Interval, ...]

    def position(self, device: int) -> int:
        return self.group.devices.index(device)

    def shard(self, device: int) -> Rect:
        return self.shards[self.position(device)]

    def rows(self, device: int) -> Interval:
        """The device's shard as rows of the group's local buffer (0-based)."""
        lo, hi = self.shard(device)[0]
        first = self.group.rect[0][0]
        return lo - first, hi - first

    def numel(self, device: int) -> int:
        lo, hi = self.chunks[self.position(device)]
        return hi - lo


def zero_group(group: ReplicaGroup, stage: ZeroStage) -> ZeroGroup | None:
    """The group's shards under ``stage``; None where the group stays whole: no ZeRO, a
    state tensor (no gradient or optimizer state), one device, fewer rows than devices."""
    if stage is ZeroStage.NONE or not group.trainable:
        return None
    shards = row_shards(group.rect, len(group.devices))
    if shards is None:
        return None
    row = math.prod(hi - lo for lo, hi in group.rect[1:])
    first = group.rect[0][0]
    chunks = tuple(((s[0][0] - first) * row, (s[0][1] - first) * row) for s in shards)
    return ZeroGroup(group, shards, chunks)


def data_parallel_groups(groups: Iterable[ReplicaGroup]) -> int:
    """Trainable replica groups over more than one device: what ZeRO shards."""
    return sum(1 for g in groups if g.trainable and len(g.devices) > 1)


def check_zero(
    stage: ZeroStage, groups: Iterable[ReplicaGroup], source: str, what: str | None = None
) -> None:
    """A ZeRO stage needs data parallelism: some weight replicated over devices.
    ``what`` names the stage where it is not the plan file's field."""
    if stage is not ZeroStage.NONE and not data_parallel_groups(groups):
        what = what or f"field 'zero_stage': {int(stage)}"
        raise PlanError(
            f"{source}: {what} needs data parallelism, but no weight of the plan is "
            "replicated over more than one device (use a plan with data parallelism, or no "
            "ZeRO stage)"
        )
