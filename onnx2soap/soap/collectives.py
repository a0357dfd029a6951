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
