"""A message after a silence: what a round trip and a ring cost after the ranks go quiet.

    python -m benchmarks.cooling                 # 2 ranks (it runs mpiexec itself)
    python -m benchmarks.cooling --ranks 2 --repeats 80

``Machine.cooling`` charges a message or a ring ``cost (1 - exp(-gap / after))`` more
after its ends have not communicated for ``gap``; ``machine probe`` fits it from the
runtime's rings (``onnx2soap/measure/probe_cooling.py``). This prints, per gap of the
probe's (``GAPS``):

- ``bare MPI round trip``: rank 1 spins in Python for the gap (touching no memory), then
  a blocking send to rank 0 and a receive of its answer; rank 0 waits in ``Test`` all
  along and answers at once. Rank 1's time from its send to the answer, the median.
- ``runtime's ring``: every rank streams memory for the gap, then the transport's ring
  all-reduce of 128 floats over every rank; the least time a rank spends in it, the
  median (``probe_cooling.ring_after_gaps``, the probe's own figures);
- ``fitted``: the probe's fit of the ring's figures, ``hot + cost (1 - exp(-gap /
  after))``, its ``cost`` and ``after`` printed below the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import math
import os
import statistics
import subprocess
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from onnx2soap.measure.probe_cooling import GAPS, REPEATS, fit_curve, ring_after_gaps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def round_trips(comm, repeats: int) -> list[float]:
    """Per gap, rank 1's median round trip to rank 0 after spinning that long (ranks
    past 1 wait at the barrier)."""
    from executor.transport import wait_patiently

    rank, buffer, figures = comm.Get_rank(), np.zeros(16, np.float32), []
    for gap in GAPS:
        spent = []
        for _ in range(repeats):
            comm.Barrier()
            if rank == 0:
                wait_patiently(comm.Irecv(buffer, source=1).Test)  # spins: a core each
                comm.Send(buffer, dest=1)
            elif rank == 1:
                _quiet(gap)
                start = time.perf_counter()
                comm.Send(buffer, dest=0)
                wait_patiently(comm.Irecv(buffer, source=0).Test)
                spent.append(time.perf_counter() - start)
        figures.append(statistics.median(spent) if spent else 0.0)
    return comm.bcast(figures, root=1)


def _quiet(seconds: float) -> None:
    """Spin for ``seconds``, touching no memory and calling no MPI."""
    from executor.transport import wait_patiently

    end = time.perf_counter() + seconds
    wait_patiently(lambda: time.perf_counter() >= end)


def measure(repeats: int) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    trips = round_trips(comm, repeats)
    rings = ring_after_gaps(comm, repeats)
    if comm.Get_rank() != 0:
        return
    hot, cost, after = fit_curve(GAPS, rings)
    print(f"{comm.Get_size()} ranks, {repeats} repeats a gap; microseconds")
    print("| silence | bare MPI round trip | runtime's ring | fitted |")
    print("|---|---|---|---|")
    for gap, trip, ring in zip(GAPS, trips, rings, strict=True):
        fitted = hot + cost * -math.expm1(-gap / after)
        print(f"| {gap * 1e3:g} ms | {trip * 1e6:.1f} | {ring * 1e6:.1f} | {fitted * 1e6:.1f} |")
    print(f"fit: hot {hot * 1e6:.1f} us, cost {cost * 1e6:.1f} us, after {after * 1e3:.2f} ms")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cooling")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (at least 2)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="rings and round trips a gap")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.repeats < 1:
        print("cooling: --ranks must be at least 2 and --repeats at least 1", file=sys.stderr)
        return 2
    if args.child:
        measure(args.repeats)
        return 0
    from onnx2soap.cli.machine_cmd import find_mpiexec

    command = [find_mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "benchmarks.cooling"]
    command += ["--repeats", str(args.repeats), "--child"]
    return subprocess.run(command, cwd=ROOT, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
