"""What the gradient buckets' rings hold on a CPU rank, for the memory model.

The MPI transport's ring (``executor/transport.py``) sums a bucket's gradients in place
as one run (soap/buckets.py; a chunk that spans two gradients goes as one message in
place), holding while it runs its receive scratch, as wide as its widest chunk: 1/k of
the bucket. A rank runs one ring at a time per communicator, and rings move on only
when it calls into the transport: in a data-parallel backward, which makes few calls,
most of the buckets' rings run as the rank waits for them after its backward, every
gradient held and the activations gone. The model counts them there: per
communicator, the widest scratch of its rings. (Counted besides in the backward, from
the op a ring starts after to the next ring's start, it put the example CNN's plan of
2 KiB buckets 11 % above its measured peak: fc1's ring queues behind fc2's, whose
scratch is tiny, until the next call.) GPUs hold none of it: NCCL sums in place,
``mpi-host`` rings over host copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.buckets import (
    BucketRing,
    BucketScatter,
    bucket_rings,
    bucket_scatters,
    gradient_buckets,
)
from onnx2soap.soap.collectives import ring_chunks
from onnx2soap.soap.zero import Zero, ZeroStage

Widest = dict[tuple[int, ...], int]  # per communicator, the widest scratch of its rings


def ring_scratch_bytes(
    numel: int, members: int, itemsize: int, chunks: tuple[tuple[int, int], ...] = ()
) -> int:
    """A member's receive scratch in a ring over ``numel`` elements: its widest chunk
    (any of the MPI transport's rings: all-reduce, reduce-scatter, all-gather), balanced
    unless ``chunks`` (a reduce-scatter's runs) says otherwise."""
    runs = chunks or ring_chunks(numel, members)
    return max(hi - lo for lo, hi in runs) * itemsize


def scratch_bytes(ring: BucketRing | BucketScatter, itemsize: int) -> int:
    """A member's receive scratch: the bucket ring's widest chunk (a reduce-scatter's:
    its widest member's runs of its gradients together)."""
    if isinstance(ring, BucketScatter):
        return ring_scratch_bytes(ring.numel, len(ring.devices), itemsize, ring.chunks())
    return ring_scratch_bytes(ring.numel, len(ring.devices), itemsize)


def widest(
    rings: Iterable[BucketRing | BucketScatter], itemsize: int, into: Widest | None = None
) -> Widest:
    """Per communicator, the widest scratch of ``rings`` (and of those ``into`` holds)."""
    out = {} if into is None else into
    for ring in rings:
        out[ring.devices] = max(out.get(ring.devices, 0), scratch_bytes(ring, itemsize))
    return out


def bucket_sums(
    bucket: int, ops: tuple[int, ...], groups, zero: Zero | ZeroStage
) -> tuple[BucketRing | BucketScatter, ...]:
    """Bucket ``bucket``'s reduce-scatters and rings (``ops``: the ops it sums)."""
    return (
        *bucket_scatters(bucket, ops, groups, zero),
        *bucket_rings(bucket, ops, groups, zero),
    )


def ring_widest(
    pg: PartitionedGraph, bucket_mb: float, itemsize: int, zero: Zero | ZeroStage
) -> Widest:
    """``widest`` of every bucket's rings and reduce-scatters of ``pg``."""
    ops = pg.graph.ops

    def groups(i: int):
        return pg.groups[ops[i].name]

    buckets = gradient_buckets(pg.graph, bucket_mb)
    sums = (
        x for b in range(len(buckets.ops)) for x in bucket_sums(b, buckets.summed(b), groups, zero)
    )
    return widest(sums, itemsize)


def ring_scratch(held: Mapping[tuple[int, ...], int], devices: int) -> list[int]:
    """Per device, what its communicators' rings hold together at most."""
    out = [0] * devices
    for members, n in held.items():
        for d in members:
            out[d] += n
    return out
