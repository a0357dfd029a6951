"""``onnx2soap machine list|show|probe``: the machines plans are made for."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from onnx2soap.cli.common import gib, human
from onnx2soap.errors import MachineError, UserError
from onnx2soap.files import check_output
from onnx2soap.options import float_in, int_in
from onnx2soap.sim.collectives import Collective, bus_bandwidth, collective_time, group_shape
from onnx2soap.sim.costs import RooflineCost
from onnx2soap.sim.machine import Machine, dump_machine
from onnx2soap.sim.presets import preset_names, resolve_machine
from onnx2soap.sim.taskgraph import Costs, Memo
from onnx2soap.soap.plan import MAX_DEVICES

MAX_PROBE_SECONDS = 600.0


def register(sub) -> None:
    p = sub.add_parser("machine", help="list, show or probe machines")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    verbs.add_parser("list", help="the presets").set_defaults(run=run_list)
    show = verbs.add_parser("show", help="describe a preset or machine file")
    show.add_argument("name", help="preset (e.g. flexflow-p100:4) or machine file")
    show.add_argument("--yaml", action="store_true", help="print it as a machine file")
    show.set_defaults(run=run_show)
    probe = verbs.add_parser("probe", help="measure this host's MPI ranks into a machine file")
    probe.add_argument(
        "-n",
        "--ranks",
        type=int_in(1, MAX_DEVICES),
        required=True,
        help=f"number of MPI ranks (1 to {MAX_DEVICES})",
    )
    probe.add_argument("-o", "--output", required=True, help="machine file to write")
    probe.add_argument(
        "--seconds",
        type=float_in(0, MAX_PROBE_SECONDS, low_open=True),
        default=0.3,
        help="time per measurement; the message and ring figures take 5 rounds at 0.3, "
        "proportionally fewer or more otherwise",
    )
    probe.set_defaults(run=run_probe)


def run_list(args: argparse.Namespace) -> int:
    for name, description in preset_names().items():
        print(f"{name + ':N':<18} {description}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    m = resolve_machine(args.name)
    if args.yaml:
        print(dump_machine(m), end="")
        return 0
    kinds: dict[tuple, int] = {}
    for d in m.devices:
        key = (d.peak_flops, d.memory_bandwidth, d.memory, d.kernel_overhead)
        kinds[key] = kinds.get(key, 0) + 1
    print(f"{m.name}: {m.size} devices, {len(m.links)} links")
    for (flops, bw, mem, overhead), count in kinds.items():
        print(
            f"  {count} x {human(flops)}FLOP/s, {human(bw)}B/s memory, {gib(mem)}, "
            f"{overhead * 1e6:.1f} us per task"
        )
    for src, dst in sorted({(0, d) for d in range(1, m.size)}):
        hops = ", ".join(
            f"{m.links[i].name} ({human(m.links[i].bandwidth)}B/s)" for i in m.route(src, dst)
        )
        print(f"  route {src} -> {dst}: {hops}")
    if m.size > 1:
        _print_all_reduce(m)
    return 0


BUSBW_SIZES = {8: "8 B", 1 << 20: "1 MiB", 64 << 20: "64 MiB", 1 << 30: "1 GiB"}


def _print_all_reduce(m: Machine) -> None:
    """An all-reduce over every device, as the simulator prices it: nccl-tests' busbw
    (docs/benchmarks.md holds it next to published figures)."""
    costs = Costs(m, RooflineCost(), 1, Memo())
    devices = tuple(range(m.size))
    how = "NCCL's model" if m.nodes is not None and not m.transfers_use_compute else "a ring"
    print(f"  all-reduce over all {m.size} devices ({how}):")
    for size, label in BUSBW_SIZES.items():
        seconds = costs.ring(devices, size)[0]
        busbw = bus_bandwidth(Collective.ALL_REDUCE, m.size, size, seconds)
        picked = ""
        if m.nodes is not None and not m.transfers_use_compute:
            p = collective_time(group_shape(m, devices), Collective.ALL_REDUCE, size)
            picked = f", {p.algorithm.value}/{p.protocol.value}"
        print(f"    {label:>6}: {seconds * 1e6:,.1f} us, busbw {human(busbw)}B/s{picked}")


def find_mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise UserError("mpiexec not found: install the project (pip install .) to get MPICH")
    return found


def run_probe(args: argparse.Namespace) -> int:
    check_output(args.output)  # before the ranks start measuring
    command = [
        find_mpiexec(),
        "-n",
        str(args.ranks),
        sys.executable,
        "-m",
        "onnx2soap.measure.probe",
        "-o",
        args.output,
        "--seconds",
        str(args.seconds),
    ]
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")  # as the executor runs: one BLAS thread per rank
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise MachineError(f"probe under mpiexec failed ({done.returncode}): {last}")
    print(f"wrote {args.output}: {args.ranks} ranks measured")
    return 0
