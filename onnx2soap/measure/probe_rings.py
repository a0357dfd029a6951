"""A ring step's time by the bytes of its chunk (``Machine.ring_step_curve``), measured
through the transport the executor's data parallelism runs.

The ranks all-reduce float32 arrays of ``RING_BYTES`` back to back with ``MpiTransport``
(the executor's ring: every step sends a chunk to the right, receives one from the left
and sums or copies it). Per size the figure is the median over ``repeats`` rings of the
least time a member spent in one (the member that arrives last spends only the ring's
own time there), over the ring's 2(k-1) steps, at the chunk's bytes. One bandwidth does
not describe it: on this host's 2 ranks a step moved 6.4 GB/s at 8 MiB chunks and 3.4
at 32 MiB, once the sums and copies left the caches (``benchmarks/mpi_allreduce.py``).
The latency stays ``ring_step_latency`` (what a ring costs inside a training step, from
traced ones); the curve gives what its bytes add.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from onnx2soap.sim.machine import RingCurve

KiB, MiB = 1 << 10, 1 << 20
RING_BYTES = (4 * KiB, 256 * KiB, 2 * MiB, 16 * MiB, 64 * MiB)  # the arrays summed
REPEATS = 5


def ring_seconds(comm, transport, devices, nbytes: int, repeats: int, warm: int = 1) -> float:
    """The median over ``repeats`` all-reduces of ``nbytes`` of float32, back to back
    after ``warm`` more (buffers and MPI's paths), of the least time a member spent in
    one: the member that arrives last spends only the ring's own time there. Every rank
    calls it and gets the figure."""
    array = np.ones(nbytes // 4, dtype=np.float32)
    least = []
    for attempt in range(repeats + warm):
        comm.Barrier()
        start = time.perf_counter()
        transport.wait(transport.allreduce(array, devices))
        transport.end_step()
        spent = comm.allgather(time.perf_counter() - start)
        if attempt >= warm:
            least.append(min(spent))
    return statistics.median(least)


def ring_step_curve(comm, nap: bool, repeats: int = REPEATS) -> RingCurve | None:
    """Every rank calls this and gets the curve; None on one rank. ``nap``: the ranks
    share cores and wait as the executor's then do (napping, then on doorbells)."""
    from executor.device import CpuDevice
    from executor.doorbell import Doorbell
    from executor.transport import MpiTransport

    ranks = comm.Get_size()
    if ranks == 1:
        return None
    bell = Doorbell.open(comm) if nap else None
    transport = MpiTransport(comm, CpuDevice(), nap=nap, bell=bell)
    devices = tuple(range(ranks))
    transport.make_groups([devices])
    points = []
    for size in RING_BYTES:
        seconds = ring_seconds(comm, transport, devices, size, repeats)
        points.append((size // ranks, seconds / (2 * (ranks - 1))))
    transport.close()
    if bell is not None:
        bell.close()
    rising, most = [], 0.0
    for nbytes, seconds in points:  # noise at the small end: never below a smaller chunk's
        most = max(most, seconds)
        rising.append((nbytes, most))
    return RingCurve(tuple(rising))
