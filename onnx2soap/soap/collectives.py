"""The ring all-reduce schedule shared by the simulator (link tasks, bytes) and the
executor (the messages it sends), so both move exactly the same bytes.

A shard of ``numel`` elements is cut into ``k`` balanced chunks. In reduce-scatter step
``s`` (0 <= s < k-1) member ``r`` sends chunk ``(r - s) mod k`` to member ``r + 1`` and
adds the chunk ``(r - s - 1) mod k`` it receives; afterwards member ``r`` holds the sum of
chunk ``(r + 1) mod k``. All-gather step ``s`` sends chunk ``(r + 1 - s) mod k`` and stores
the received chunk ``(r - s) mod k``. Every chunk is summed once, in ring order, so all
members end with bit-identical results.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx2soap.soap.partition import Interval, chunk


@dataclass(frozen=True)
class RingStep:
    send_chunk: int
    recv_chunk: int
    reduce: bool  # True: add the received chunk; False: overwrite (all-gather)


def ring_chunks(numel: int, members: int) -> tuple[Interval, ...]:
    return tuple(chunk(numel, members, i) for i in range(members))


def ring_steps(position: int, members: int) -> tuple[RingStep, ...]:
    """The steps of the member at ``position`` in the ring (0-based)."""
    k, r = members, position
    scatter = [RingStep((r - s) % k, (r - s - 1) % k, True) for s in range(k - 1)]
    gather = [RingStep((r + 1 - s) % k, (r - s) % k, False) for s in range(k - 1)]
    return (*scatter, *gather)


def ring_bytes_sent(numel: int, members: int, position: int, itemsize: int) -> int:
    """Bytes the member at ``position`` sends during one all-reduce."""
    if members < 2:
        return 0
    chunks = ring_chunks(numel, members)
    return sum(
        (chunks[s.send_chunk][1] - chunks[s.send_chunk][0]) * itemsize
        for s in ring_steps(position, members)
    )


# ZeRO's halves (soap/zero.py): member ``r`` owns chunk ``r`` (its shard), so the
# reduce-scatter ends with each member holding the sum of its own chunk, and the
# all-gather starts from it. ``chunks`` are the shards' runs of the flat buffer (uneven
# where the rows do not divide); each half is k-1 lock-step steps, the same chunk sizes
# as the all-reduce's halves, so together they move what one all-reduce moves.


def reduce_scatter_steps(position: int, members: int) -> tuple[RingStep, ...]:
    """Step ``s``: send chunk ``(r - s - 1) mod k``, add the received ``(r - s - 2) mod
    k``; the last step adds chunk ``r``, which holds then the sum over the ring."""
    k, r = members, position
    return tuple(RingStep((r - s - 1) % k, (r - s - 2) % k, True) for s in range(k - 1))


def all_gather_steps(position: int, members: int) -> tuple[RingStep, ...]:
    """Step ``s``: send chunk ``(r - s) mod k`` (first its own), store the received
    ``(r - s - 1) mod k``."""
    k, r = members, position
    return tuple(RingStep((r - s) % k, (r - s - 1) % k, False) for s in range(k - 1))


def chunks_bytes_sent(
    chunks: tuple[Interval, ...], steps: tuple[RingStep, ...], itemsize: int
) -> int:
    """Bytes a member sends in ``steps`` over ``chunks``."""
    return sum((chunks[s.send_chunk][1] - chunks[s.send_chunk][0]) * itemsize for s in steps)


# The two-level all-reduce of ranks on several hosts (MPI's hierarchical form, what
# NCCL's tree and Horovod's hierarchical all-reduce do in spirit): a flat ring over
# h hosts of m ranks takes 2(hm - 1) lock-step steps, each as slow as its network hop,
# where this takes 2(m - 1) steps inside the hosts and 2(h - 1) across them, moving
# the same bytes over each host's network link.
#   1. inside each host, a reduce-scatter over its m ranks (``reduce_scatter_steps``):
#      the host's j-th rank ends with the host's sum of chunk j of m;
#   2. across hosts, the j-th ranks all-reduce chunk j (m rings side by side);
#   3. inside each host, an all-gather of the m chunks (``all_gather_steps``).
# Every chunk is summed in one order on one rank and then copied, so every member ends
# with the same bits, as with the flat ring. It saves 2(h - 1)(m - 1) network latencies
# but moves 2(m - 1)/m of the buffer through each host's memory besides, which over a
# network about as fast as a host's ring (25 Gb/s Ethernet next to a ring's 4-7 GB/s
# a member here) costs more than the flat ring from a few MiB: like MPI libraries'
# short-message algorithms, it runs up to ``TWO_LEVEL_MAX_BYTES`` and the flat ring
# above (``benchmarks/collectives.py``'s last table prices both).
TWO_LEVEL_MAX_BYTES = 1 << 20


def takes_two_levels(nbytes: int) -> bool:
    """Whether an all-reduce of ``nbytes`` over several hosts runs in two levels."""
    return nbytes <= TWO_LEVEL_MAX_BYTES


@dataclass(frozen=True)
class HostRings:
    """An all-reduce's members by host: ``hosts[i]`` the members on host ``i``
    (ascending), hosts in the order of their first member, every host with as many."""

    hosts: tuple[tuple[int, ...], ...]

    @property
    def local(self) -> int:
        """Members a host."""
        return len(self.hosts[0])

    def across(self) -> tuple[tuple[int, ...], ...]:
        """The cross-host rings: ring ``j`` joins every host's ``j``-th member."""
        return tuple(zip(*self.hosts, strict=True))

    def host_chunks(self, numel: int) -> tuple[Interval, ...]:
        """Phases 1 and 3: the flat buffer in ``local`` chunks; member ``j`` of a host
        owns chunk ``j``."""
        return ring_chunks(numel, self.local)

    def cross_chunks(self, numel: int, j: int) -> tuple[Interval, ...]:
        """Phase 2 of ring ``j``: chunk ``j`` cut in one piece a host."""
        lo, hi = self.host_chunks(numel)[j]
        return tuple((lo + a, lo + b) for a, b in ring_chunks(hi - lo, len(self.hosts)))

    def place(self, device: int) -> tuple[int, int]:
        """(host index, position on the host) of a member."""
        for h, members in enumerate(self.hosts):
            if device in members:
                return h, members.index(device)
        raise ValueError(f"device {device} is not a member")


def host_rings(devices: tuple[int, ...], host_of: tuple[int, ...] | None) -> HostRings | None:
    """The two-level form of an all-reduce over ``devices`` where they span two hosts
    or more with the same number, at least 2, on each (``host_of[d]``: device ``d``'s
    host); None where the flat ring runs (one host, one rank a host, uneven hosts)."""
    if host_of is None:
        return None
    by_host: dict[int, list[int]] = {}
    for d in devices:
        by_host.setdefault(host_of[d], []).append(d)
    hosts = sorted(tuple(sorted(members)) for members in by_host.values())
    if len(hosts) < 2 or len({len(h) for h in hosts}) != 1 or len(hosts[0]) < 2:
        return None
    return HostRings(tuple(hosts))


def host_ring_bytes_sent(numel: int, rings: HostRings, device: int, itemsize: int) -> int:
    """Bytes ``device`` sends during one two-level all-reduce."""
    host, j = rings.place(device)
    m, h = rings.local, len(rings.hosts)
    chunks = rings.host_chunks(numel)
    inside = chunks_bytes_sent(chunks, reduce_scatter_steps(j, m), itemsize)
    inside += chunks_bytes_sent(chunks, all_gather_steps(j, m), itemsize)
    lo, hi = chunks[j]
    return inside + ring_bytes_sent(hi - lo, h, host, itemsize)
