"""The MPI transport's all-reduce on this host, measured, next to the simulator's price
for it on the host's probed machine file.

    python -m benchmarks.mpi_allreduce [--ranks 2 4] [--repeats 15]

For each rank count: ``onnx2soap machine probe`` writes the machine file, then the ranks
sum float32 arrays of 1 KiB to 64 MiB with the executor's transport (``MpiTransport``,
the ring the executor's data parallelism runs), back to back, each size ``--repeats``
times after a warm-up; the figure is the median over repeats of the least time a rank
spent in the ring (the rank that arrives last spends only the ring's own time there).
The simulated one is ``taskgraph.Costs.ring`` on the probed machine, what a plan's task
graph gives such an all-reduce (its steps at the probed ``ring_step_latency``, what a
ring step costs inside a training step, plus what the probed ``ring_step_curve`` says
the chunk's bytes add; no cooling after a silence, which ``benchmarks/cooling.py``
measures). The issue's target: within 25 %.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


KiB, MiB = 1 << 10, 1 << 20
SIZES = (KiB, 16 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB)


def _mpiexec() -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec") or "mpiexec"


def measure(repeats: int) -> dict[int, float] | None:
    """Under mpiexec: per size, the median over ``repeats`` of the least seconds a rank
    spent in one all-reduce (rank 0 gets them; the others None)."""
    from mpi4py import MPI

    from executor.device import CpuDevice
    from executor.doorbell import Doorbell
    from executor.transport import MpiTransport, nap_precisely, oversubscribed
    from onnx2soap.measure.probe_rings import ring_seconds

    comm = MPI.COMM_WORLD
    nap = oversubscribed(comm)
    if nap:
        nap_precisely()
    bell = Doorbell.open(comm) if nap else None
    transport = MpiTransport(comm, CpuDevice(), nap=nap, bell=bell)
    devices = tuple(range(comm.Get_size()))
    transport.make_groups([devices])
    figures = {size: ring_seconds(comm, transport, devices, size, repeats, 2) for size in SIZES}
    if bell is not None:
        bell.close()
    transport.close()
    return figures if comm.Get_rank() == 0 else None


def simulated(machine_file: Path, ranks: int) -> dict[int, float]:
    from onnx2soap.sim.costs import RooflineCost
    from onnx2soap.sim.machine import load_machine_file
    from onnx2soap.sim.taskgraph import Costs, Memo

    machine = load_machine_file(machine_file)
    costs = Costs(machine, RooflineCost(), 4, Memo())
    return {size: costs.ring(tuple(range(ranks)), size // 4)[0] for size in SIZES}


def _label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        figures = measure(args.repeats)
        if figures is not None:
            print(json.dumps(figures))
        return 0
    print("| ranks | size | measured us | simulated us | simulated / measured |")
    print("|---|---|---|---|---|")
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory() as scratch:
            machine_file = Path(scratch) / "host.yaml"
            probe = [sys.executable, "-m", "onnx2soap", "machine", "probe", "-n", str(ranks)]
            subprocess.run([*probe, "-o", str(machine_file)], check=True, capture_output=True)
            run = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "benchmarks.mpi_allreduce"]
            done = subprocess.run(
                [*run, "--worker", "--repeats", str(args.repeats)],
                check=True,
                capture_output=True,
                text=True,
            )
            measured = {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
            priced = simulated(machine_file, ranks)
        for size in SIZES:
            m, s = measured[size], priced[size]
            print(f"| {ranks} | {_label(size)} | {m * 1e6:,.0f} | {s * 1e6:,.0f} | {s / m:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
