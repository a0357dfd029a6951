"""Collectives on GPU nodes priced with NCCL's model (sim/collectives.py), against figures
computed by hand from NCCL's constants (tuning.cc) and the presets' links.

dgx-h100:N: 8 H100 a node, one 450 GB/s NVSwitch port each way a GPU (18 NVLink 4
links, which NCCL counts at 20.6 GB/s each: 370.8 GB/s), one 50 GB/s NIC a GPU. A
rank's bus bandwidth inside a node is its port's at NCCL's figure, a node's across the
network its members' NICs' together (NCCL stripes its channels over them).
"""

from __future__ import annotations

import pytest

from onnx2soap.sim import RooflineCost
from onnx2soap.sim.collectives import (
    Algorithm,
    Collective,
    Hop,
    Protocol,
    bus_bandwidth,
    collective_time,
    group_shape,
)
from onnx2soap.sim.presets import preset
from onnx2soap.sim.taskgraph import Costs, Memo
from onnx2soap.soap.collectives import all_gather_steps

US, GB = 1e-6, 1e9


@pytest.mark.parametrize(
    ("name", "devices", "nodes", "intra", "inter"),
    [
        ("dgx-h100:2", range(16), 2, 18 * 20.6 * GB, 8 * 50 * GB),
        ("dgx-h100:2", (0, 1, 8, 9), 2, 18 * 20.6 * GB, 2 * 50 * GB),  # two NICs a node in use
        ("dgx-h100:1", range(8), 1, 18 * 20.6 * GB, float("inf")),
        ("alpa-v100:2", range(16), 2, 6 * 20 * GB, 3.125 * GB),  # one NIC a node
        ("dgx-a100:2", range(16), 2, 12 * 20 * GB, 8 * 25 * GB),  # Selene: 8 HDR NICs a node
        ("grand-teton:2", range(16), 2, 18 * 20.6 * GB, 8 * 50 * GB),
        ("flexflow-p100:1", range(4), 1, 3 * 18 * GB, float("inf")),  # an NVLink to each
        ("flexflow-k80:2", range(8), 2, 12 * GB, 7 * GB),  # the NIC, not the PCIe port
    ],
)
def test_bus_bandwidths_from_the_links(name, devices, nodes, intra, inter) -> None:
    shape = group_shape(preset(name), tuple(devices))
    assert (shape.ranks, shape.nodes) == (len(devices), nodes)
    assert shape.intra_bandwidth == pytest.approx(intra)
    assert shape.inter_bandwidth == pytest.approx(inter)
    assert shape.intra is (Hop.PCI if "k80" in name else Hop.NVLINK)


def test_a_large_ring_all_reduce_across_two_nodes_by_hand() -> None:
    """1 GiB over 16 GPUs as the ring alone (NCCL_ALGO=RING): Simple, 30 steps, 2 across
    the network, latency x 1.9 (NCCL's plateau), at 370.8 GB/s bus bandwidth (the NVLinks
    at NCCL's figure, below the 400 of the NICs): algorithm bandwidth 370.8 * 16/30."""
    shape = group_shape(preset("dgx-h100:2"), tuple(range(16)))
    size = 1 << 30
    latency = (8.4 + 28 * 3.4 + 2 * 9.6) * 1.9 * US
    seconds = latency + size / (370.8 * GB * 16 / 30)
    priced = collective_time(shape, Collective.ALL_REDUCE, size, frozenset({Algorithm.RING}))
    assert (priced.algorithm, priced.protocol) == (Algorithm.RING, Protocol.SIMPLE)
    assert priced.seconds == pytest.approx(seconds, rel=1e-12)


def test_a_large_all_reduce_across_two_nodes_takes_nvls_tree() -> None:
    """The same 1 GiB with every algorithm: NVLS-tree. NVLS in each node at 370.8 GB/s x
    0.74 x 7/8 (a channel of 8 lost) x 2 (reduce and multicast pipelined) = 480 GB/s;
    the network's 400 GB/s doubled on 2 nodes; the tree's cap 57.7 GB/s x 8 channels =
    461.6 GB/s wins; latency 25 us + 2 x log2(2) x 20.9 us."""
    shape = group_shape(preset("dgx-h100:2"), tuple(range(16)))
    assert shape.nvls
    size = 1 << 30
    priced = collective_time(shape, Collective.ALL_REDUCE, size)
    assert (priced.algorithm, priced.protocol) == (Algorithm.NVLS_TREE, Protocol.SIMPLE)
    seconds = (25 + 2 * 20.9) * US + size / (57.7 * 8 * GB * 16 / 30)
    assert priced.seconds == pytest.approx(seconds, rel=1e-12)
    busbw = bus_bandwidth(Collective.ALL_REDUCE, 16, size, priced.seconds)
    assert 430 * GB < busbw < 480 * GB  # nccl-tests on such pods: docs/benchmarks.md


def test_a_large_all_reduce_in_a_node_takes_nvls_by_hand() -> None:
    """1 GiB over one node's 8 H100s: NVLS at 370.8 x 0.74 x 7/8 x 2 GB/s of bus
    bandwidth (~480, what NVIDIA states NVLS reaches), 8/14 of it the algorithm's; its
    25 us NVLink latency and no base. A reduce-scatter takes the ring."""
    shape = group_shape(preset("dgx-h100:1"), tuple(range(8)))
    size = 1 << 30
    nvls = 370.8 * GB * 0.74 * 7 / 8
    priced = collective_time(shape, Collective.ALL_REDUCE, size)
    assert (priced.algorithm, priced.protocol) == (Algorithm.NVLS, Protocol.SIMPLE)
    assert priced.seconds == pytest.approx(25 * US + size / (2 * nvls * 8 / 14), rel=1e-12)
    assert collective_time(shape, Collective.REDUCE_SCATTER, size).algorithm is Algorithm.RING


@pytest.mark.parametrize(
    ("name", "devices"),
    [
        ("dgx-a100:1", range(8)),  # NVSwitch 2 does not reduce
        ("alpa-v100:1", range(8)),
        ("dgx-h100:2", (0, 8)),  # a rank a node: nothing for the switch to reduce
        ("dgx-h100:2", (0, 1, 2, 8)),
    ],
)
def test_no_nvls_where_the_switches_cannot_reduce(name, devices) -> None:
    shape = group_shape(preset(name), tuple(devices))
    assert not shape.nvls
    for p in range(3, 34, 2):
        priced = collective_time(shape, Collective.ALL_REDUCE, 1 << p)
        assert priced.algorithm in (Algorithm.RING, Algorithm.TREE)


def test_algorithms_allowed() -> None:
    shape = group_shape(preset("dgx-h100:1"), tuple(range(8)))
    only_tree = collective_time(shape, Collective.ALL_REDUCE, 1 << 30, frozenset({Algorithm.TREE}))
    assert only_tree.algorithm is Algorithm.TREE
    with pytest.raises(ValueError, match="none of"):
        collective_time(shape, Collective.ALL_GATHER, 1 << 20, frozenset({Algorithm.TREE}))


def test_a_small_all_reduce_in_a_node_by_hand() -> None:
    """8 bytes over 8 GPUs of a node: the LL ring, base 3.6 us and 14 NVLink hops of
    0.47 us, its bytes at a quarter of the NVLinks' rate (LL's flags): latency-bound.
    NVLS's 25 us latency loses here."""
    shape = group_shape(preset("dgx-h100:1"), tuple(range(8)))
    priced = collective_time(shape, Collective.ALL_REDUCE, 8)
    seconds = (3.6 + 14 * 0.47) * US + 8 / (370.8 * GB / 4 * 8 / 14)
    assert (priced.algorithm, priced.protocol) == (Algorithm.RING, Protocol.LL)
    assert priced.seconds == pytest.approx(seconds, rel=1e-12)


def test_a_mid_size_all_reduce_over_many_nodes_takes_the_tree() -> None:
    """1 MiB over 8 nodes: the tree's 2 * (7 NVLink + log2(8) network) hops beat the
    ring's 126 steps; LL128 on the tree, capped at 80 GB/s over more than two nodes."""
    shape = group_shape(preset("dgx-h100:8"), tuple(range(64)))
    priced = collective_time(shape, Collective.ALL_REDUCE, 1 << 20)
    assert (priced.algorithm, priced.protocol) == (Algorithm.TREE, Protocol.LL128)
    latency = (4.4 + 2 * (7 * 1.2 + 3 * 8.5)) * US
    bandwidth = min(400 * GB * 0.9, 80 * GB) * 0.915 * 0.5
    assert priced.seconds == pytest.approx(latency + (1 << 20) / bandwidth, rel=1e-12)


def test_busbw_grows_with_size_and_stays_under_the_links() -> None:
    for name in ("dgx-h100:1", "dgx-h100:2", "dgx-h100:8", "alpa-v100:2"):
        m = preset(name)
        shape = group_shape(m, tuple(range(m.size)))
        for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
            busbw = [
                bus_bandwidth(kind, m.size, 1 << p, collective_time(shape, kind, 1 << p).seconds)
                for p in range(3, 31)
            ]
            assert busbw == sorted(busbw), (name, kind)
            # where the switch reduces, a GPU sends its data once and receives the sum
            # once: at most twice the ring's busbw
            assert busbw[-1] <= shape.bus_bandwidth * (2 if shape.nvls else 1)


def test_all_to_all_by_hand() -> None:
    """16 GPUs on 2 nodes, 16 MiB a rank: 1/16 to each peer; a node's 8 ranks send 8 of
    their 16 chunks across its 400 GB/s of NICs, 7 over their own NVLinks (370.8 GB/s
    at NCCL's figure)."""
    shape = group_shape(preset("dgx-h100:2"), tuple(range(16)))
    size = 16 << 20
    chunk = size / 16
    latency = (8.4 + 3.4 + 9.6) * US
    seconds = latency + max(chunk * 7 / (370.8 * GB), chunk * 8 * 8 / (400 * GB))
    assert collective_time(shape, Collective.ALL_TO_ALL, size).seconds == pytest.approx(seconds)


def test_the_simulator_times_its_rings_with_the_model() -> None:
    """Costs.ring and ZeRO's half rings on GPU nodes: NCCL's time, every link between
    the members held, the ring's bytes (what the executor's counters see)."""
    m = preset("dgx-h100:2")
    costs = Costs(m, RooflineCost(), 4, Memo())
    devices = tuple(range(16))
    numel = 1 << 26
    seconds, links, nbytes = costs.ring(devices, numel)
    expected = collective_time(group_shape(m, devices), Collective.ALL_REDUCE, 4 * numel)
    assert seconds == expected.seconds
    assert nbytes == 2 * 15 * 4 * numel
    nics = {m.size + i for i, link in enumerate(m.links) if link.name.startswith("nic")}
    assert nics <= set(links)  # striped over every NIC of both nodes
    chunks = tuple((i * 100, (i + 1) * 100 - (i % 2)) for i in range(16))  # uneven runs
    seconds, _, nbytes = costs.half_ring(devices, chunks, all_gather_steps, 2)
    gather = collective_time(group_shape(m, devices), Collective.ALL_GATHER, 16 * 100 * 2)
    assert seconds == gather.seconds
    assert nbytes == 15 * sum(hi - lo for lo, hi in chunks) * 2
