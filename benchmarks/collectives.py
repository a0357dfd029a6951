"""All-reduce bus bandwidth as the simulator prices it on the GPU presets, next to
published nccl-tests figures.

    python -m benchmarks.collectives

busbw is nccl-tests' (doc/PERFORMANCE.md): S/t * 2(n-1)/n for an all-reduce of S bytes
over n ranks in t seconds. Every simulated figure is ``taskgraph.Costs.ring``'s, the
time the simulator gives an all-reduce in a plan's task graph (``sim/collectives.py``:
NCCL's model over the preset's links). Each reference row names its source and what it
measured; the issue's targets: within 20 % at 64 MiB and above, within 2x below.

The last table is CPU ranks on several hosts (``presets.cpu_hosts``: 25 Gb/s Ethernet a
host), as the executor's MPI transport runs them: the flat ring next to the two-level
form (``soap/collectives.py HostRings``), which the transport takes up to
``TWO_LEVEL_MAX_BYTES``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onnx2soap.sim.collectives import (
    Algorithm,
    Collective,
    bus_bandwidth,
    collective_time,
    group_shape,
)
from onnx2soap.sim.costs import RooflineCost
from onnx2soap.sim.presets import cpu_hosts, preset
from onnx2soap.sim.taskgraph import Costs, Memo
from onnx2soap.soap.collectives import host_rings, takes_two_levels

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
HOST_SIZES = (KiB, 64 * KiB, MiB, 4 * MiB, 64 * MiB)
HOSTS = ((2, 8), (4, 8), (8, 8), (16, 4))  # (hosts, ranks a host)
SIZES = (8, 64 * KiB, MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB, 8 * GiB)
MACHINES = ("dgx-h100:1", "dgx-h100:2", "dgx-h100:4", "dgx-h100:8", "alpa-v100:1", "alpa-v100:2")


@dataclass(frozen=True)
class Reference:
    machine: str
    size: int
    busbw_gbs: float
    source: str
    algorithm: Algorithm | None = None  # what the run was restricted to (NCCL_ALGO)


AZURE = (
    "Azure ND H100 v5 (8 H100, NVSwitch), nccl-tests, NCCL 2.18.5 (its NVLS): "
    "github.com/Azure/AI-benchmarking-guide, Azure Results/ND_H100_v5_results.md"
)
AWS = (
    "AWS 2 x p5.48xlarge (16 H100, 3,200 Gb/s EFA a node), nccl-tests, algorithm not "
    "stated: github.com/aws-samples/awsome-distributed-training, "
    "micro-benchmarks/nccl-tests/README.md"
)
VOLTAGE = (
    "Voltage Park, 4 nodes x 8 H100, 3.2 Tb/s InfiniBand a node, NCCL 2.24.3: "
    "their benchmarking README's multi-node table (peak)"
)
NEBIUS = (
    "Nebius, 2 x 8 H100 on InfiniBand, NCCL 2.20.5, a PyTorch script's timing (not "
    "nccl-tests; weak): github.com/drmysore/nebius-h100-16gpu-benchmark README"
)
RING = (
    "8 H100 on NVSwitch, NCCL_ALGO=RING, ~370 GB/s (NVLS ~480): NVIDIA/nccl-tests "
    "issue 212, an NVIDIA maintainer"
)
REFERENCES = (
    Reference("dgx-h100:1", MiB, 43.70, AZURE),
    Reference("dgx-h100:1", 256 * MiB, 423.38, AZURE),
    Reference("dgx-h100:1", GiB, 466.35, AZURE),
    Reference("dgx-h100:1", 8 * GiB, 478.87, AZURE),
    Reference("dgx-h100:1", 8 * GiB, 370.0, RING, Algorithm.RING),
    Reference("dgx-h100:2", 8, 8 / 69.12e-6 * 2 * 15 / 16 / 1e9, AWS),
    Reference("dgx-h100:2", MiB, 15.95, AWS),
    Reference("dgx-h100:2", MiB, MiB / 88e-6 * 2 * 15 / 16 / 1e9, NEBIUS),
    Reference("dgx-h100:2", GiB, 436.95, AWS),
    Reference("dgx-h100:2", 8 * GiB, 479.28, AWS),
    Reference("dgx-h100:4", 8 * GiB, 330.93, VOLTAGE),
)


def simulated(machine: str, size: int, only: Algorithm | None = None) -> tuple[float, str]:
    """(seconds, how) of an all-reduce of ``size`` bytes over every device: what a
    plan's task graph gives it, or with ``only`` NCCL's model restricted to it."""
    m = preset(machine)
    devices = tuple(range(m.size))
    allowed = None if only is None else frozenset({only})
    p = collective_time(group_shape(m, devices), Collective.ALL_REDUCE, size, allowed)
    seconds = (
        Costs(m, RooflineCost(), 1, Memo()).ring(devices, size)[0] if only is None else p.seconds
    )
    return seconds, f"{p.algorithm.value}/{p.protocol.value}"


def on_hosts(hosts: int, per_host: int, size: int) -> tuple[float, float]:
    """(flat ring, two-level form) seconds of an all-reduce of ``size`` bytes (float32)
    over every rank of ``hosts`` CPU hosts, whichever the transport takes."""
    machine = cpu_hosts(hosts, per_host)
    devices = tuple(range(machine.size))
    costs = Costs(machine, RooflineCost(), 4, Memo())
    flat = Costs(replace(machine, nodes=None), RooflineCost(), 4, Memo()).ring(devices, size // 4)
    rings = host_rings(devices, machine.nodes.of)
    return flat[0], costs.two_level(rings, size // 4)[0]


def _host_table() -> None:
    print("\nCPU ranks on several hosts, the MPI transport (us: flat ring / two levels;")
    print("the form the transport takes in bold):\n")
    print("| hosts x ranks | " + " | ".join(_label(s) for s in HOST_SIZES) + " |")
    print("|---|" + "---|" * len(HOST_SIZES))
    for hosts, per_host in HOSTS:
        cells = []
        for size in HOST_SIZES:
            flat, two = (f"{t * 1e6:,.0f}" for t in on_hosts(hosts, per_host, size))
            cells.append(f"{flat} / **{two}**" if takes_two_levels(size) else f"**{flat}** / {two}")
        print(f"| {hosts} x {per_host} | " + " | ".join(cells) + " |")


def _label(size: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if size >= unit:
            return f"{size // unit} {name}"
    return f"{size} B"


def main() -> int:
    print("Simulated all-reduce over every device of the preset (busbw GB/s, time us):\n")
    print("| machine | " + " | ".join(_label(s) for s in SIZES) + " |")
    print("|---|" + "---|" * len(SIZES))
    for machine in MACHINES:
        cells = []
        for size in SIZES:
            seconds, how = simulated(machine, size)
            ranks = preset(machine).size
            busbw = bus_bandwidth(Collective.ALL_REDUCE, ranks, size, seconds) / 1e9
            cells.append(f"{busbw:.3g} ({seconds * 1e6:,.0f} us, {how})")
        print(f"| {machine} | " + " | ".join(cells) + " |")
    print("\nNext to published figures (busbw GB/s):\n")
    print("| machine | size | simulated | published | simulated / published | target | source |")
    print("|---|---|---|---|---|---|---|")
    for ref in REFERENCES:
        seconds, how = simulated(ref.machine, ref.size, ref.algorithm)
        ranks = preset(ref.machine).size
        busbw = bus_bandwidth(Collective.ALL_REDUCE, ranks, ref.size, seconds) / 1e9
        ratio = busbw / ref.busbw_gbs
        bound = (0.8, 1.2) if ref.size >= 64 * MiB else (0.5, 2.0)
        verdict = "within" if bound[0] <= ratio <= bound[1] else "outside"
        print(
            f"| {ref.machine} | {_label(ref.size)} | {busbw:.3g} ({how}) | {ref.busbw_gbs:.3g} "
            f"| {ratio:.2f} | {verdict} {bound[0]}-{bound[1]} | {ref.source} |"
        )
    _host_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
