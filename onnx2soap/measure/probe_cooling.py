"""What a ring costs its ranks after a silence (``Machine.cooling``), measured through the
executor's own transport.

On this project's 2-core VM a message costs more the longer its ends have not
communicated: a bare MPI round trip 3 us back to back, 12, 29 and 80 us after 1, 3 and 10
ms without one (the ranks spinning or sleeping alike), and the transport's two-rank ring
of 128 floats 40-200 us after 0.1-6 ms of the ranks streaming memory. The probes of
messages and rings (``probe_messages.py``) run their chains back to back and see none of
it; a model's rings and messages come an op's compute apart.

So every rank streams through ``POOL_BYTES`` of memory for a gap (a few tenths of a
millisecond to ``GAPS[-1]``), then the ranks sum ``RING_FLOATS`` floats in a ring. The
member that comes last spends only the ring's own time in it (the others wait for it
there too), so per gap the ring costs the least time a member spends, the median over
``REPEATS`` rings; and

    ring(gap) = hot + cost · (1 - exp(-gap / after))

is fitted by least squares (``after`` on a grid, ``hot`` and ``cost`` linear). Only ranks
with a core each: ranks that share cores nap and sleep while they wait, and what they
pay when they come back is ``Machine.resume``'s.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np

from onnx2soap.sim.machine import Cooling

GAPS = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2)  # seconds of streaming before a ring
REPEATS = 40
POOL_BYTES = 64 << 20  # beyond the L3 (32 MiB here), as a model step streams
CHUNK_FLOATS = 1 << 15  # a pass over one chunk: ~10 us, so a gap ends on time
RING_FLOATS = 128
AFTER_GRID = np.geomspace(5e-5, 5e-2, 61)


def ring_after_gaps(comm, repeats: int = REPEATS) -> list[float]:
    """Per gap of ``GAPS``, the median over ``repeats`` rings of the least time a rank
    spent in the ring (every rank calls this, and gets the figures)."""
    from mpi4py import MPI

    from executor.device import CpuDevice
    from executor.transport import MpiTransport, wait_patiently

    transport = MpiTransport(comm, CpuDevice())
    everyone = tuple(range(comm.Get_size()))
    transport.make_groups([everyone])
    pool = np.ones(POOL_BYTES // 4, np.float32).reshape(-1, CHUNK_FLOATS)
    out = np.empty(CHUNK_FLOATS, np.float32)
    figures = []
    try:
        for gap in GAPS:
            spent = np.empty(repeats)
            for i in range(repeats):
                wait_patiently(comm.Ibarrier().Test)  # the ranks' last communication
                _stream(pool, out, gap)
                values = np.ones(RING_FLOATS, np.float32)
                start = time.perf_counter()
                transport.wait(transport.allreduce(values, everyone))
                spent[i] = time.perf_counter() - start
                transport.end_step()
            least = np.empty(repeats)
            comm.Allreduce(spent, least, op=MPI.MIN)
            figures.append(statistics.median(least.tolist()))
    finally:
        transport.close()
    return figures


def _stream(pool: np.ndarray, out: np.ndarray, seconds: float) -> None:
    """Read the pool chunk by chunk, as an op streams its tensors, for ``seconds``."""
    end, i = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        np.multiply(pool[i % len(pool)], 1.0001, out=out)
        i += 1


def fit_curve(gaps, seconds) -> tuple[float, float, float]:
    """(hot, cost, after) of ``seconds[i] = hot + cost · (1 - exp(-gaps[i] / after))``
    by least squares: ``after`` the best on ``AFTER_GRID``, the others linear."""
    g, y = np.asarray(gaps, float), np.asarray(seconds, float)
    best = (math.inf, 0.0, 0.0, float(AFTER_GRID[0]))  # (squared error, hot, cost, after)
    for after in AFTER_GRID:
        a = np.column_stack([np.ones_like(g), -np.expm1(-g / after)])
        (hot, cost), *_ = np.linalg.lstsq(a, y, rcond=None)
        error = float(np.sum((a @ (hot, cost) - y) ** 2))
        if error < best[0]:
            best = (error, float(hot), float(cost), float(after))
    return best[1:]


def fit_cooling(gaps, seconds) -> Cooling | None:
    """The cooling ``fit_curve`` finds; None where a silence costs nothing (its cost
    under a nanosecond)."""
    _, cost, after = fit_curve(gaps, seconds)
    return Cooling(cost, after) if cost >= 1e-9 else None


def cooling_cost(comm, repeats: int = REPEATS) -> Cooling | None:
    """The machine's cooling, on every rank; None on one rank or where none is seen."""
    if comm.Get_size() == 1:
        return None
    figures = ring_after_gaps(comm, repeats)
    return comm.bcast(fit_cooling(GAPS, figures) if comm.Get_rank() == 0 else None, root=0)
