"""ZeRO stages 1, 2 and 3 (DeepSpeed; stage 3 is PyTorch's FSDP): a data-parallel replica
group shards what its copies would each hold whole.

A plan's ``zero_stage`` applies to every trainable replica group over k > 1 devices
(``zero_stages`` may set another stage for named weights, FSDP's wrapping of some
layers and not others: ``Zero``):

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
from functools import cached_property

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


@dataclass(frozen=True)
class Zero:
    """The ZeRO stage of every weight: ``stage``, but for the weights ``weights`` names
    (sorted by name; a stage there may be NONE: that weight's replicas all-reduce)."""

    stage: ZeroStage = ZeroStage.NONE
    weights: tuple[tuple[str, ZeroStage], ...] = ()

    def __post_init__(self) -> None:
        names = [name for name, _ in self.weights]
        if names != sorted(set(names)):
            raise ValueError("Zero.weights must be sorted by name, each weight once")

    @staticmethod
    def of(zero: Zero | ZeroStage) -> Zero:
        """``zero`` as a ``Zero`` (one stage: every weight at it)."""
        return zero if isinstance(zero, Zero) else Zero(ZeroStage(zero))

    @staticmethod
    def mixed(stage: ZeroStage, by_weight: dict[str, ZeroStage]) -> Zero:
        """``stage`` everywhere but ``by_weight``'s weights (those at ``stage`` dropped)."""
        named = sorted((w, s) for w, s in by_weight.items() if s is not stage)
        return Zero(stage, tuple(named))

    @cached_property
    def _by_weight(self) -> dict[str, ZeroStage]:  # asked per replica group, per plan priced
        return dict(self.weights)

    def weight(self, name: str) -> ZeroStage:
        """The stage of weight ``name``."""
        return self._by_weight.get(name, self.stage)

    @property
    def stages(self) -> frozenset[ZeroStage]:
        return frozenset({self.stage, *(s for _, s in self.weights)})

    @property
    def top(self) -> ZeroStage:
        """The highest stage of any weight."""
        return max(self.stages)

    @property
    def shards_weights(self) -> bool:
        """Whether some weight is at stage 3."""
        return self.top.shards_weights

    @property
    def label(self) -> str:
        """``ZeRO-2``, or with weights at other stages ``ZeRO-2, 64 weights ZeRO-3``."""
        counts: dict[ZeroStage, int] = {}
        for _, stage in self.weights:
            counts[stage] = counts.get(stage, 0) + 1
        other = (f"{n} weights {stage.label}" for stage, n in sorted(counts.items()))
        return ", ".join((self.stage.label, *other))

    def __bool__(self) -> bool:
        return self.top is not ZeroStage.NONE


NO_ZERO = Zero()  # every weight whole on each of its replicas


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


def group_stage(group: ReplicaGroup, zero: Zero | ZeroStage) -> ZeroStage:
    """The stage of ``group``'s weight under ``zero``."""
    return zero.weight(group.weight) if isinstance(zero, Zero) else zero


def zero_group(group: ReplicaGroup, zero: Zero | ZeroStage) -> ZeroGroup | None:
    """The group's shards under ``zero``; None where the group stays whole: no ZeRO for
    its weight, a state tensor (no gradient or optimizer state), one device, fewer rows
    than devices."""
    if group_stage(group, zero) is ZeroStage.NONE or not group.trainable:
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
    zero: Zero | ZeroStage, groups: Iterable[ReplicaGroup], source: str, what: str | None = None
) -> None:
    """A ZeRO stage needs data parallelism: some weight replicated over devices.
    ``what`` names the stage where it is not the plan file's field."""
    stage = Zero.of(zero).top
    if stage is not ZeroStage.NONE and not data_parallel_groups(groups):
        what = what or f"field 'zero_stage': {int(stage)}"
        raise PlanError(
            f"{source}: {what} needs data parallelism, but no weight of the plan is "
            "replicated over more than one device (use a plan with data parallelism, or no "
            "ZeRO stage)"
        )
