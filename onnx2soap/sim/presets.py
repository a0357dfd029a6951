"""Named machines: the papers' clusters, a DGX H100 pod, and this host's MPI ranks.

``NAME:N`` means N nodes (N ranks for ``cpu``). Device figures are FP32 datasheet peaks
(the executor trains in float32); links are one per direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from onnx2soap.errors import MachineError
from onnx2soap.sim.machine import (
    MAX_DEVICES,
    ComputeDevice,
    IntraLink,
    Link,
    Machine,
    NodeLayout,
    load_machine_file,
)

GiB = 1 << 30


class Fabric(Enum):
    PAIRWISE = "pairwise"  # a dedicated link per ordered GPU pair (P100 NVLink mesh)
    SWITCH = "switch"  # one port per GPU and direction into a switch (NVSwitch)
    PCIE = "pcie"  # one PCIe port per GPU and direction; inter-node traffic crosses it too


@dataclass(frozen=True)
class NodeSpec:
    description: str
    gpu: ComputeDevice
    gpus: int
    fabric: Fabric
    intra_bandwidth: float
    intra_latency: float
    nic_bandwidth: float
    nic_latency: float
    nic_per_gpu: bool = False
    # NCCL's figure for an NVLink over the datasheet's (NodeLayout.nvlink_share), and
    # whether the NVSwitches reduce (NVLS)
    nvlink_share: float = 1.0
    nvls: bool = False


# Datasheet peaks: FP32, and (last) FP16 matrix products: P100's packed FP16, V100's and
# H100's (SXM, dense) tensor cores; a K80 multiplies FP16 no faster than FP32.
P100 = ComputeDevice("P100", 10.6e12, 732e9, 16 * GiB, 5e-6, 21.2e12, "P100 SXM2")
K80 = ComputeDevice("K80", 4.37e12, 240e9, 12 * GiB, 5e-6)  # one GK210 die
V100 = ComputeDevice("V100", 15.7e12, 900e9, 16 * GiB, 5e-6, 125e12, "V100 SXM2")
H100 = ComputeDevice("H100", 67e12, 3.35e12, 80 * GiB, 4e-6, 989e12, "H100 SXM")
# Meta's Grand Teton hosts (torchtitan's published runs): H100 SXM with 96 GB of HBM2e at
# 2.4 TB/s, power-limited to 500 W. Its 16-bit peak "is between SXM and NVL, and we don't
# know its exact value" (torchtitan's benchmark, footnote 2): the middle of 835 (H100 NVL)
# and 989 (SXM) TFLOPS, and FP32's scaled alike.
H100_96 = ComputeDevice("H100-96GB", 61.8e12, 2.4e12, 96 * 10**9, 4e-6, 912e12, "H100 SXM")
# A100 SXM 80 GB: 19.5 TFLOPS FP32, 312 TFLOPS BF16/FP16 dense, 2,039 GB/s HBM2e.
A100 = ComputeDevice("A100", 19.5e12, 2.039e12, 80 * GiB, 4e-6, 312e12, "A100 SXM")

# NCCL's bandwidth for one NVLink over the datasheet's (NVIDIA/nccl src/graph/topo.h,
# SM60/SM70/SM80/SM90_NVLINK_BW: 18, 20, 20 and 20.6 GB/s a link each way, against 20,
# 25, 25 and 25): what its collectives' channels get of a GPU's NVLinks. 18 NVLink 4
# links at 20.6 give the ~370 GB/s an 8-H100 ring all-reduce reaches (nccl-tests
# issue 212).
NVLINK1, NVLINK2, NVLINK3, NVLINK4 = 18 / 20, 20 / 25, 20 / 25, 20.6 / 25

CLUSTERS = {
    "flexflow-p100": NodeSpec(
        "N nodes x 4 P100 on NVLink, 100 Gb/s InfiniBand between nodes (FlexFlow paper)",
        P100,
        4,
        Fabric.PAIRWISE,
        20e9,
        1e-6,
        12.5e9,
        2e-6,
        nvlink_share=NVLINK1,
    ),
    "flexflow-k80": NodeSpec(
        "N nodes x 4 K80 on PCIe, 56 Gb/s InfiniBand between nodes (FlexFlow paper)",
        K80,
        4,
        Fabric.PCIE,
        12e9,
        5e-6,
        7e9,
        2e-6,
    ),
    "alpa-v100": NodeSpec(
        "N nodes x 8 V100 on NVLink, 25 Gb/s Ethernet between nodes (Alpa paper)",
        V100,
        8,
        Fabric.SWITCH,
        150e9,
        1e-6,
        3.125e9,
        25e-6,
        nvlink_share=NVLINK2,
    ),
    "dgx-h100": NodeSpec(
        "N nodes x 8 H100 on NVSwitch, one 400 Gb/s InfiniBand NIC per GPU",
        H100,
        8,
        Fabric.SWITCH,
        450e9,
        1e-6,
        50e9,
        3e-6,
        nic_per_gpu=True,
        nvlink_share=NVLINK4,
        nvls=True,
    ),
    "grand-teton": NodeSpec(
        "N Meta Grand Teton hosts x 8 H100 SXM (96 GB HBM2e, 2.4 TB/s, 500 W) on NVLink 4 "
        "(450 GB/s a GPU each way), 400 Gb/s RDMA a GPU between hosts: torchtitan's "
        "published runs (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md)",
        H100_96,
        8,
        Fabric.SWITCH,
        450e9,
        1e-6,
        50e9,
        3e-6,
        nic_per_gpu=True,
        nvlink_share=NVLINK4,
        nvls=True,
    ),
    "dgx-a100": NodeSpec(
        "N DGX A100 nodes x 8 A100 SXM 80 GB on NVLink 3 (300 GB/s a GPU each way through "
        "NVSwitch), 8 x 200 Gb/s HDR InfiniBand a node: Megatron-LM's Selene (Narayanan et "
        "al. 2021)",
        A100,
        8,
        Fabric.SWITCH,
        300e9,
        1e-6,
        25e9,
        3e-6,
        nic_per_gpu=True,
        nvlink_share=NVLINK3,
    ),
}

CPU_RANK = ComputeDevice("cpu-rank", 2e10, 8e9, 2 * GiB, 30e-6)
CPU_DESCRIPTION = "N MPI ranks on this host (shared memory); `machine probe` measures real figures"


class _Builder:
    def __init__(self) -> None:
        self.links: list[Link] = []
        self.routes: dict[tuple[int, int], tuple[int, ...]] = {}

    def link(self, name: str, bandwidth: float, latency: float) -> int:
        self.links.append(Link(name, bandwidth, latency))
        return len(self.links) - 1


def _ports(b: _Builder, prefix: str, count: int, bw: float, lat: float) -> tuple[list, list]:
    up = [b.link(f"{prefix}{i}-out", bw, lat) for i in range(count)]
    down = [b.link(f"{prefix}{i}-in", bw, lat) for i in range(count)]
    return up, down


def cluster(name: str, spec: NodeSpec, nodes: int) -> Machine:
    g = spec.gpus
    total = nodes * g
    devices = tuple(
        ComputeDevice(f"node{n}-{spec.gpu.name.lower()}{i}", *_fields(spec.gpu))
        for n in range(nodes)
        for i in range(g)
    )
    b = _Builder()
    pair = {}
    if spec.fabric is Fabric.PAIRWISE:
        for a in range(total):
            for c in range(total):
                if a != c and a // g == c // g:
                    pair[(a, c)] = b.link(
                        f"nvlink-{a}-{c}", spec.intra_bandwidth, spec.intra_latency
                    )
    else:
        port = "pcie" if spec.fabric is Fabric.PCIE else "nvswitch"
        up, down = _ports(b, f"{port}-gpu", total, spec.intra_bandwidth, spec.intra_latency)
    nic_count = total if spec.nic_per_gpu else nodes
    nic_out, nic_in = _ports(b, "nic", nic_count, spec.nic_bandwidth, spec.nic_latency)
    for a in range(total):
        for c in range(total):
            if a == c:
                continue
            if a // g == c // g:
                b.routes[(a, c)] = (pair[(a, c)],) if pair else (up[a], down[c])
                continue
            na, nc = (a, c) if spec.nic_per_gpu else (a // g, c // g)
            hops = (nic_out[na], nic_in[nc])
            b.routes[(a, c)] = (up[a], *hops, down[c]) if spec.fabric is Fabric.PCIE else hops
    intra = IntraLink.PCIE if spec.fabric is Fabric.PCIE else IntraLink.NVLINK
    layout = NodeLayout(tuple(d // g for d in range(total)), intra, spec.nvlink_share, spec.nvls)
    return Machine(f"{name}:{nodes}", devices, tuple(b.links), b.routes, nodes=layout)


def _fields(d: ComputeDevice) -> tuple:
    return (
        d.peak_flops,
        d.memory_bandwidth,
        d.memory,
        d.kernel_overhead,
        d.peak_flops_half,
        d.model,
    )


def cpu(
    ranks: int, device: ComputeDevice = CPU_RANK, bandwidth: float = 4e9, latency: float = 5e-6
) -> Machine:
    b = _Builder()
    out, into = _ports(b, "rank", ranks, bandwidth, latency)
    for a in range(ranks):
        for c in range(ranks):
            if a != c:
                b.routes[(a, c)] = (out[a], into[c])
    devices = tuple(ComputeDevice(f"rank{i}", *_fields(device)) for i in range(ranks))
    return Machine(f"cpu:{ranks}", devices, tuple(b.links), b.routes, transfers_use_compute=True)


# A host's Ethernet between CPU hosts (25 Gb/s, and what a message's trip through the
# kernel's network stack and the switch costs beyond shared memory's).
HOST_NIC_BANDWIDTH, HOST_NIC_LATENCY = 25e9 / 8, 15e-6


def cpu_hosts(
    hosts: int,
    per_host: int,
    device: ComputeDevice = CPU_RANK,
    bandwidth: float = 4e9,
    latency: float = 5e-6,
    nic: tuple[float, float] = (HOST_NIC_BANDWIDTH, HOST_NIC_LATENCY),
) -> Machine:
    """MPI ranks on several hosts, ``per_host`` each: a rank's ports into its host's
    shared memory (as ``cpu``), and one network link each way a host (``nic``:
    bandwidth, latency), which every message between two hosts crosses. Its ``nodes``
    say which host each rank is on: all-reduces over several hosts are priced in the
    transport's two-level form (``soap/collectives.py host_rings``)."""
    b = _Builder()
    total = hosts * per_host
    out, into = _ports(b, "rank", total, bandwidth, latency)
    nic_out, nic_in = _ports(b, "host-nic", hosts, *nic)
    for a in range(total):
        for c in range(total):
            ha, hc = a // per_host, c // per_host
            if a != c:
                across = (nic_out[ha], nic_in[hc]) if ha != hc else ()
                b.routes[(a, c)] = (out[a], *across, into[c])
    devices = tuple(ComputeDevice(f"rank{i}", *_fields(device)) for i in range(total))
    layout = NodeLayout(tuple(d // per_host for d in range(total)))
    name = f"cpu-hosts:{hosts}x{per_host}"
    return Machine(name, devices, tuple(b.links), b.routes, True, nodes=layout)


def preset_names() -> dict[str, str]:
    return {**{k: v.description for k, v in CLUSTERS.items()}, "cpu": CPU_DESCRIPTION}


def _count(text: str, count: str, per_node: int) -> int:
    """N of ``NAME:N``: ASCII digits only (``str.isdigit`` accepts "²"), and a machine of
    at most ``MAX_DEVICES`` devices, checked before anything quadratic is built."""
    most = MAX_DEVICES // per_node
    if ":" not in text:
        return 1
    if not 1 <= len(count) <= 9 or any(c not in "0123456789" for c in count) or int(count) < 1:
        raise MachineError(f"machine {text[:80]!r}: N must be a positive integer, at most {most}")
    if int(count) > most:
        raise MachineError(
            f"machine {text!r}: at most {most} (a machine has at most {MAX_DEVICES} devices)"
        )
    return int(count)


def preset(text: str) -> Machine:
    name, _, count = text.partition(":")
    if name not in preset_names():
        raise MachineError(
            f"unknown machine {text[:80]!r}; presets: "
            f"{', '.join(f'{n}:N' for n in preset_names())} (or a machine file path)"
        )
    per_node = 1 if name == "cpu" else CLUSTERS[name].gpus
    n = _count(text, count, per_node)
    return cpu(n) if name == "cpu" else cluster(name, CLUSTERS[name], n)


def resolve_machine(text: str) -> Machine:
    """A preset name (``flexflow-p100:4``) or the path of a machine file."""
    if not text or "\0" in text:
        raise MachineError(f"machine {text!r}: give a preset name or a machine file path")
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or _is_file(path):
        return load_machine_file(path)
    return preset(text)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the OS is no file
        return False
