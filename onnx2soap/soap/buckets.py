"""Gradient buckets (PyTorch DDP's): which weight gradients are summed together.

The ops that own trainable weights are taken in backward order (reverse graph order, the
order their backward kernels make the gradients) and cut into buckets of at least
``bucket_mb`` MiB of whole weights each (the last may hold less), as DDP fills its
buckets: a bucket closes once the weights put in it reach the size. The first bucket
closes at ``FIRST_BUCKET_MB`` already (or ``bucket_mb`` where less), as DDP's does
(``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), so that the first ring starts
early in the backward. The cut depends on the model and ``bucket_mb`` alone, never on
the ops' configs, so a proposal that changes one op's config changes only the rings of
its own bucket (delta simulation).

Within a bucket, the gradients replicated over the same devices (the trainable replica
groups over more than one device with the same ``devices``, not sharded by ZeRO) are
summed by one ring all-reduce over their concatenation (``BucketRing``): its members
in backward order, each op's groups in group order. A ring starts once its last
member's gradient is made: after the backward of its ``closing`` op, while the rest of
the backward goes on. The groups ZeRO shards over the same devices are summed alike by
one reduce-scatter (``BucketScatter``), so that each member ends with the sum of its
rows of every one of them, as DeepSpeed's ZeRO and FSDP reduce-scatter a bucket (or a
wrapped unit) at once. The executor (``executor/program.py``) and the simulator
(``sim/taskgraph.py``) both take their rings from here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from onnx2soap.ir import Graph, TensorRole
from onnx2soap.soap.partition import Interval, ReplicaGroup, rect_volume
from onnx2soap.soap.zero import Zero, ZeroStage, zero_group

DEFAULT_BUCKET_MB = 25.0  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb
FIRST_BUCKET_MB = 1.0  # and its first bucket's (dist._DEFAULT_FIRST_BUCKET_BYTES)
MIB = 1 << 20


@dataclass(frozen=True)
class Buckets:
    """The graph's weight ops cut into buckets: per bucket its op indices in backward
    order; buckets in backward order too. ``unsummed``: weight ops whose output takes no
    gradient (ids): the executor runs no backward for them, so their weights' gradients
    stay zero and no ring sums them (they count in the buckets' sizes, as DDP counts
    every parameter)."""

    ops: tuple[tuple[int, ...], ...]
    unsummed: frozenset[int] = frozenset()

    def summed(self, bucket: int) -> tuple[int, ...]:
        """The ops of ``bucket`` whose gradients its rings sum."""
        return tuple(i for i in self.ops[bucket] if i not in self.unsummed)

    def bucket_of(self) -> dict[int, int]:
        """Op index -> its bucket, for the ops that own trainable weights."""
        return {i: b for b, ops in enumerate(self.ops) for i in ops}


def weight_bytes(graph: Graph, op_index: int) -> int:
    """The bytes of the op's trainable weights, whole, in the model's own dtype."""
    tensors = (graph.tensors[t] for t in graph.ops[op_index].inputs)
    return sum(
        t.dtype.itemsize * math.prod(t.shape) for t in tensors if t.role is TensorRole.WEIGHT
    )


def gradient_buckets(graph: Graph, bucket_mb: float = DEFAULT_BUCKET_MB) -> Buckets:
    """The weight ops in backward order, cut where a bucket reaches ``bucket_mb`` MiB
    (the first at ``FIRST_BUCKET_MB``)."""
    cap = min(FIRST_BUCKET_MB, bucket_mb) * MIB
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    filled, unsummed = 0, set()
    for i in reversed(range(len(graph.ops))):
        size = weight_bytes(graph, i)
        if not size:
            continue
        if not graph.differentiable(graph.ops[i].output):
            unsummed.add(i)
        current.append(i)
        filled += size
        if filled >= cap:
            buckets.append(tuple(current))
            current, filled, cap = [], 0, bucket_mb * MIB
    if current:
        buckets.append(tuple(current))
    return Buckets(tuple(buckets), frozenset(unsummed))


def summed_by_ring(group: ReplicaGroup, zero: Zero | ZeroStage) -> bool:
    """Whether a bucket's all-reduce sums the group's gradient: a trainable group over
    several devices that ZeRO does not shard (a sharded one is reduce-scattered alone)."""
    return group.trainable and len(group.devices) > 1 and zero_group(group, zero) is None


@dataclass(frozen=True)
class BucketRing:
    """One all-reduce of a bucket: the gradients of ``members`` ((op index, group index
    in ``PartitionedGraph.groups``), in backward order) over ``devices``, summed as one
    flat run of ``numel`` elements, their concatenation in member order."""

    bucket: int
    devices: tuple[int, ...]
    members: tuple[tuple[int, int], ...]
    numel: int

    @property
    def closing(self) -> int:
        """The op after whose backward the ring starts: its last member's."""
        return self.members[-1][0]

    @property
    def name(self) -> str:
        return ring_name(self.bucket, self.devices)


def ring_name(bucket: int, devices: tuple[int, ...]) -> str:
    """The simulator's and the executor's trace's name of a bucket's ring."""
    return f"allreduce bucket {bucket} on {','.join(map(str, devices))}"


def bucket_rings(
    bucket: int,
    ops: Sequence[int],
    groups: Callable[[int], Sequence[ReplicaGroup]],
    zero: Zero | ZeroStage = ZeroStage.NONE,
) -> tuple[BucketRing, ...]:
    """The rings of bucket ``bucket`` (its ``ops`` in backward order; ``groups(i)``: op
    i's replica groups under its config), one per device set, in the order their
    first members come."""
    members: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    numel: dict[tuple[int, ...], int] = {}
    for i in ops:
        for g, group in enumerate(groups(i)):
            if summed_by_ring(group, zero):
                members.setdefault(group.devices, []).append((i, g))
                numel[group.devices] = numel.get(group.devices, 0) + rect_volume(group.rect)
    return tuple(
        BucketRing(bucket, devices, tuple(m), numel[devices]) for devices, m in members.items()
    )


def all_rings(
    buckets: Buckets,
    groups: Callable[[int], Sequence[ReplicaGroup]],
    zero: Zero | ZeroStage = ZeroStage.NONE,
) -> dict[int, tuple[BucketRing, ...]]:
    """Every bucket's rings by the op they start after (``BucketRing.closing``), in
    the order they start there."""
    return _by_closing(buckets, lambda b, ops: bucket_rings(b, ops, groups, zero))


def _by_closing(buckets: Buckets, made: Callable[[int, tuple[int, ...]], Sequence]) -> dict:
    """What ``made(bucket, its summed ops)`` gives for every bucket, by the op each one
    starts after (its ``closing``), in the order they start there."""
    closing: dict[int, list] = {}
    for b in range(len(buckets.ops)):
        for summed in made(b, buckets.summed(b)):
            closing.setdefault(summed.closing, []).append(summed)
    return {i: tuple(found) for i, found in closing.items()}


@dataclass(frozen=True)
class BucketScatter:
    """One reduce-scatter of a bucket: the gradients of ``members`` ((op index, group
    index), in backward order), groups ZeRO shards over ``devices``, summed as one flat
    run laid out shard-major: member position 0's rows of every member in member order,
    then position 1's, and so on, so that each position's ``chunks`` entry is one run,
    of which it ends with the sum. ``runs``: per member, its group's shard runs in its
    own flat buffer (``ZeroGroup.chunks``)."""

    bucket: int
    devices: tuple[int, ...]
    members: tuple[tuple[int, int], ...]
    runs: tuple[tuple[Interval, ...], ...]

    @property
    def closing(self) -> int:
        """The op after whose backward it starts: its last member's."""
        return self.members[-1][0]

    @property
    def name(self) -> str:
        return scatter_name(self.bucket, self.devices)

    @property
    def numel(self) -> int:
        return sum(hi - lo for runs in self.runs for lo, hi in runs)

    def chunks(self) -> tuple[Interval, ...]:
        """Each member position's run of the flat run."""
        return shard_major(self.runs)[1]


def shard_major(
    runs: Sequence[tuple[Interval, ...]],
) -> tuple[tuple[tuple[int, Interval], ...], tuple[Interval, ...]]:
    """Arrays whose member position ``p`` owns run ``runs[a][p]`` of array ``a``, laid
    out as one flat run shard-major: (array index, run) of each piece in that order,
    and each position's run of the whole (the rings' ``chunks``)."""
    positions = len(runs[0]) if runs else 0
    pieces, chunks, at = [], [], 0
    for p in range(positions):
        start = at
        for a, own in enumerate(runs):
            pieces.append((a, own[p]))
            at += own[p][1] - own[p][0]
        chunks.append((start, at))
    return tuple(pieces), tuple(chunks)


def scatter_name(bucket: int, devices: tuple[int, ...]) -> str:
    """The simulator's and the executor's trace's name of a bucket's reduce-scatter."""
    return f"reduce-scatter bucket {bucket} on {','.join(map(str, devices))}"


def bucket_scatters(
    bucket: int,
    ops: Sequence[int],
    groups: Callable[[int], Sequence[ReplicaGroup]],
    zero: Zero | ZeroStage,
) -> tuple[BucketScatter, ...]:
    """The reduce-scatters of bucket ``bucket`` (its ``ops`` in backward order), one per
    device set of its sharded groups, in the order their first members come."""
    members: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    runs: dict[tuple[int, ...], list[tuple[Interval, ...]]] = {}
    for i in ops:
        for g, group in enumerate(groups(i)):
            sharded = zero_group(group, zero)
            if sharded is None or len(group.devices) < 2:
                continue
            members.setdefault(group.devices, []).append((i, g))
            runs.setdefault(group.devices, []).append(sharded.chunks)
    return tuple(
        BucketScatter(bucket, devices, tuple(m), tuple(runs[devices]))
        for devices, m in members.items()
    )


def all_scatters(
    buckets: Buckets,
    groups: Callable[[int], Sequence[ReplicaGroup]],
    zero: Zero | ZeroStage,
) -> dict[int, tuple[BucketScatter, ...]]:
    """Every bucket's reduce-scatters by the op they start after, in the order they
    start there (before the bucket's rings)."""
    return _by_closing(buckets, lambda b, ops: bucket_scatters(b, ops, groups, zero))


def check_bucket_mb(value: float) -> float:
    """A bucket size a plan or an option may give: a finite number of MiB above 0;
    ``ValueError`` otherwise."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise ValueError(f"a gradient bucket is a finite number of MiB above 0, got {value!r}")
    return float(value)
