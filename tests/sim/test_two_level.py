"""The simulator's price of the MPI transport's two-level all-reduce over CPU hosts
(``presets.cpu_hosts``, ``soap/collectives.py HostRings``), by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from onnx2soap.errors import MachineError
from onnx2soap.measure.probe import Peer, between, host_layout
from onnx2soap.sim.costs import RooflineCost
from onnx2soap.sim.presets import HOST_NIC_BANDWIDTH, HOST_NIC_LATENCY, cpu_hosts
from onnx2soap.sim.taskgraph import Costs, Memo
from onnx2soap.soap.collectives import TWO_LEVEL_MAX_BYTES

SHM_BANDWIDTH, SHM_LATENCY = 4e9, 5e-6  # cpu_hosts' defaults: a rank's port each way


def _ring(machine, numel: int) -> tuple[float, tuple[int, ...], int]:
    costs = Costs(machine, RooflineCost(), 4, Memo())
    return costs.ring(tuple(range(len(machine.devices))), numel)


def test_two_hosts_of_two_ranks_by_hand() -> None:
    """1 KiB over 2 hosts x 2 ranks: a reduce-scatter step inside each host (512 B
    over two shared-memory ports), two steps of the cross-host rings (256 B each, the
    two rings' sends sharing each host's network link: 512 B on it), an all-gather
    step; every byte copied by the cores at both ends (``transfers_use_compute``)."""
    seconds, _, nbytes = _ring(cpu_hosts(2, 2), 256)
    inside = 2 * SHM_LATENCY + 2 * 512 / SHM_BANDWIDTH
    across = 2 * SHM_LATENCY + 2 * HOST_NIC_LATENCY + 2 * (2 * 256) / HOST_NIC_BANDWIDTH
    assert seconds == pytest.approx(2 * inside + 2 * across, rel=1e-12)
    # a member: 512 B inside, two 256 B sends across, 512 B inside; as a flat ring of 4
    assert nbytes == 4 * (512 + 2 * 256 + 512) == 4 * 2 * 3 * 256


def test_the_flat_ring_pays_a_network_latency_every_step() -> None:
    """8 hosts x 8 ranks, 1 KiB: the flat ring's 126 lock-step steps each wait for a
    network hop; the two levels cross the network in 14 steps."""
    machine = cpu_hosts(8, 8)
    two_level, _, moved = _ring(machine, 256)
    flat, _, flat_moved = _ring(replace(machine, nodes=None), 256)
    assert moved == flat_moved
    network_step = 2 * SHM_LATENCY + 2 * HOST_NIC_LATENCY
    assert flat > 126 * network_step
    assert two_level < 14 * network_step + 28 * 2 * SHM_LATENCY + 1e-6
    assert flat > 5 * two_level


def test_above_the_threshold_the_flat_ring() -> None:
    machine = cpu_hosts(4, 2)
    numel = TWO_LEVEL_MAX_BYTES // 4 + 1
    assert _ring(machine, numel) == _ring(replace(machine, nodes=None), numel)


def test_the_probe_reads_the_network_from_rank_0s_peers() -> None:
    """What a message between hosts adds: the median small ping-pong to other hosts'
    ranks less that to rank 0's own host's; their median bandwidth."""
    peers = [
        Peer(10e-6, 8e9, True),
        Peer(12e-6, 6e9, True),
        Peer(40e-6, 1e9, False),
        Peer(50e-6, 3e9, False),
        Peer(45e-6, 2e9, False),
    ]
    extra, bandwidth = between(peers)
    assert extra == pytest.approx(45e-6 - 11e-6) and bandwidth == 2e9
    assert between(peers[:2]) is None  # one host
    assert between(peers[2:]) == (pytest.approx(45e-6), 2e9)  # a rank a host


def test_the_probe_takes_hosts_filled_in_order() -> None:
    assert host_layout((0, 0, 2, 2, 4, 4)) == (3, 2)
    assert host_layout((0, 0, 0)) == (1, 3)
    with pytest.raises(MachineError, match="fill their hosts in order"):
        host_layout((0, 1, 0, 1))
