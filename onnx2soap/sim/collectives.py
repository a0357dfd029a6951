"""Collectives as NCCL runs them on GPU nodes: one place prices every one.

NCCL picks, per collective and size, the algorithm (ring or tree) and the protocol (LL,
LL128, Simple) its cost model says is fastest, and stripes its channels over every
NVLink port and every NIC of a node. Its model (NVIDIA/nccl ``src/graph/tuning.cc``,
``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``, read at commit 01afd20) prices a
collective as a latency plus its bytes at an algorithm bandwidth:

- latency: a base per algorithm and protocol, plus a per-hop latency for each step,
  by the hop's kind (NVLink, PCIe, network): a ring all-reduce over k ranks on n nodes
  takes 2(k-1) steps of which 2(n-1) cross the network; a tree's two passes climb the
  ranks of a node and log2(n) levels of nodes;
- bandwidth: the bus bandwidth the topology sustains a rank (NCCL's channels times
  their speed), scaled by the protocol's efficiency (LL sends half its bytes as flags
  and runs at a quarter, LL128 at 120/128, Simple at all of it), turned into an
  algorithm bandwidth (a ring all-reduce moves 2(k-1)/k of the data a rank; a tree
  half its bandwidth each way).

The constants are NCCL's; the code is ours. Where this machine's topology would be
NCCL's channel search, we read it off the machine's links: a rank's bus bandwidth
inside a node is what its links to the other members carry (one NVSwitch port, or the
sum of its NVLinks to them) at the share of an NVLink NCCL counts on
(``NodeLayout.nvlink_share``: topo.h's 20.6 GB/s an NVLink 4 link), across nodes what
the node's network links carry together (every NIC, as NCCL stripes its channels over
them), the least over members and nodes.

On nodes whose NVSwitches reduce (``NodeLayout.nvls``: H100's NVLink SHARP) NCCL also
prices NVLS for an all-reduce (the switch sums what the GPUs write and multicasts the
sum, inside a node) and NVLS-tree (NVLS inside each node, a tree of nodes across the
network), Simple protocol only, with a channel per GPU of the node. Those constants
are from the newer tuning.cc at commit 5067397 (the all-reduce's two pipelined halves,
the tree's per-channel cap, NVLS's 25 us NVLink and 18-20.9 us network latencies); its
efficiency is what NVLS reaches (``NVLS_EFFICIENCY``).
Left out: NCCL's tree correction table for mid sizes, its per-channel LL128 caps, and
CollNet (a network switch's reductions).

Ranks that copy their own messages (CPU ranks, ``Machine.transfers_use_compute``) and
machines without nodes run the executor's own lock-step ring instead
(``taskgraph.Costs``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from onnx2soap.sim.machine import IntraLink, Machine

US = 1e-6
GB = 1e9


class Collective(Enum):
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all-to-all"

    def bus_factor(self, ranks: int) -> float:
        """nccl-tests' busbw / algbw (doc/PERFORMANCE.md): what a rank's busiest link
        carries of the data, so a bandwidth-optimal algorithm's busbw does not depend on
        the rank count."""
        k = ranks
        if self is Collective.ALL_REDUCE:
            return 2 * (k - 1) / k
        if self is Collective.BROADCAST:
            return 1.0
        return (k - 1) / k


class Algorithm(Enum):
    RING = "ring"
    TREE = "tree"
    NVLS = "nvls"  # the NVSwitch reduces (one node)
    NVLS_TREE = "nvls-tree"  # NVLS in each node, a tree of nodes


class Protocol(Enum):
    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


class Hop(Enum):
    NVLINK = 0
    PCI = 1
    NET = 2


# NCCL's latencies in microseconds (tuning.cc): a base per algorithm and protocol, and
# a per-hop latency by hop kind. Order: LL, LL128, Simple.
_PROTOCOLS = (Protocol.LL, Protocol.LL128, Protocol.SIMPLE)
BASE_LATENCY_US = {
    Algorithm.TREE: (4.4, 4.4, 0.0),
    Algorithm.RING: (3.6, 10.0, 8.4),
}
HOP_LATENCY_US = {
    Hop.NVLINK: {Algorithm.TREE: (0.52, 1.2, 28.0), Algorithm.RING: (0.47, 1.9, 3.4)},
    Hop.PCI: {Algorithm.TREE: (1.0, 1.9, 28.0), Algorithm.RING: (1.0, 2.5, 5.7)},
    Hop.NET: {Algorithm.TREE: (5.0, 8.5, 50.0), Algorithm.RING: (2.7, 4.0, 9.6)},
}
# A tree's bus bandwidth is capped (GB/s): its reductions run on fewer threads a rank.
TREE_CAP_GBS = {True: 80.0, False: 110.0}  # more than two nodes, or not
RING_PLATEAU = 1.9  # multi-node Simple ring all-reduces above k/16 * 64 KiB: lat x 1.9


# NVLS (tuning.cc at 5067397): the per-hop latencies of NVLS
# and NVLS-tree, Simple, on NVLink and on the network (their base latency is 0); the
# NVLS-tree's per-channel bandwidth cap (GB/s) on 2 nodes and on more.
#
# The NVLS efficiency prices what NVLS reaches, not NCCL's 0.85 (which only has to rank
# the algorithms): 8 H100s' NVLS all-reduce reaches ~480 GB/s busbw (NVIDIA/nccl-tests
# issue 212, an NVIDIA maintainer), where 0.85 gives 551 on their 8 x 18 NVLink 4 links
# at topo.h's 20.6 GB/s (x 7/8 channels, x 2 halves); 0.85 x 480 / 551 = 0.74.
NVLS_EFFICIENCY = 0.74
NVLS_LATENCY_US = {
    Algorithm.NVLS: {Hop.NVLINK: 25.0, Hop.NET: 18.0},
    Algorithm.NVLS_TREE: {Hop.NVLINK: 25.0, Hop.NET: 20.9},
}
NVLS_TREE_CHANNEL_CAP_GBS = {2: 57.7, 4: 45.5}


def _hop_latency(hop: Hop, algorithm: Algorithm, protocol: Protocol) -> float:
    return HOP_LATENCY_US[hop][algorithm][_PROTOCOLS.index(protocol)] * US


def _base_latency(algorithm: Algorithm, protocol: Protocol) -> float:
    return BASE_LATENCY_US[algorithm][_PROTOCOLS.index(protocol)] * US


@dataclass(frozen=True)
class GroupShape:
    """What NCCL's model needs of a group of ranks: how many, over how many nodes, the
    kind of their intra-node hops, and the bus bandwidths (bytes/s) a rank sustains
    inside its node and a node across the network (``inf`` where there is none)."""

    ranks: int
    nodes: int
    intra: Hop
    intra_bandwidth: float
    inter_bandwidth: float
    nvls: bool = False  # the nodes' switches reduce, and each holds 2 or more ranks

    @property
    def per_node(self) -> float:
        return self.ranks / self.nodes

    @property
    def bus_bandwidth(self) -> float:
        return min(self.intra_bandwidth, self.inter_bandwidth)


def group_shape(machine: Machine, devices: Sequence[int]) -> GroupShape:
    """The shape of ``devices`` on ``machine``, which has ``nodes``."""
    layout = machine.nodes
    assert layout is not None, "a machine without nodes runs the lock-step ring"
    node_of = layout.of
    members: dict[int, list[int]] = {}
    for d in devices:
        members.setdefault(node_of[d], []).append(d)
    share = layout.nvlink_share if layout.intra is IntraLink.NVLINK else 1.0
    intra = math.inf
    for group in members.values():
        for a in group:
            others = [b for b in group if b != a]
            if others:
                out = _distinct(machine, (machine.route(a, b)[0] for b in others))
                into = _distinct(machine, (machine.route(b, a)[-1] for b in others))
                intra = min(intra, out * share, into * share)
    inter = math.inf
    if len(members) > 1:
        for node, group in members.items():
            away = [d for d in devices if node_of[d] != node]
            egress = _distinct(
                machine, (_network_link(machine, a, b, 0) for a in group for b in away)
            )
            ingress = _distinct(
                machine, (_network_link(machine, b, a, -1) for a in group for b in away)
            )
            inter = min(inter, egress, ingress)
    hop = Hop.NVLINK if layout.intra is IntraLink.NVLINK else Hop.PCI
    nvls = layout.nvls and all(len(group) >= 2 for group in members.values())
    return GroupShape(len(devices), len(members), hop, intra, inter, nvls)


def _distinct(machine: Machine, links) -> float:
    """The bandwidth of a set of links together (each counted once)."""
    return sum(machine.links[i].bandwidth for i in set(links))


def _network_link(machine: Machine, src: int, dst: int, end: int) -> int:
    """The slowest link of a route between nodes, the first of them (``end`` 0: nearest
    the sender, for its node's egress) or the last (-1: its ingress): a node's NIC."""
    route = machine.route(src, dst)
    slowest = min(machine.links[i].bandwidth for i in route)
    ordered = route if end == 0 else route[::-1]
    return next(i for i in ordered if machine.links[i].bandwidth == slowest)


@dataclass(frozen=True)
class Priced:
    algorithm: Algorithm
    protocol: Protocol
    seconds: float


def collective_time(
    shape: GroupShape,
    kind: Collective,
    nbytes: int,
    allowed: frozenset[Algorithm] | None = None,
) -> Priced:
    """The fastest (algorithm, protocol) NCCL's model gives ``kind`` of ``nbytes``
    (the whole buffer: an all-gather's or reduce-scatter's k chunks) over the group;
    ``allowed``: only these algorithms (as ``NCCL_ALGO`` restricts them), all if None."""
    if shape.ranks < 2:
        return Priced(Algorithm.RING, Protocol.SIMPLE, 0.0)
    if kind is Collective.ALL_TO_ALL:
        return Priced(Algorithm.RING, Protocol.SIMPLE, _all_to_all(shape, nbytes))
    algorithms = (
        (Algorithm.RING, Algorithm.TREE) if kind is Collective.ALL_REDUCE else (Algorithm.RING,)
    )
    options = [
        Priced(a, p, _latency(shape, kind, a, p, nbytes) + nbytes / _bandwidth(shape, kind, a, p))
        for a in algorithms
        if allowed is None or a in allowed
        for p in _PROTOCOLS
    ]
    nvls = _nvls_algorithm(shape, kind)
    if nvls is not None and (allowed is None or nvls in allowed):
        seconds = _nvls_latency(shape, nvls) + nbytes / _nvls_bandwidth(shape, kind, nvls)
        options.append(Priced(nvls, Protocol.SIMPLE, seconds))
    if not options:
        raise ValueError(f"none of {sorted(a.value for a in allowed or ())} runs {kind.value}")
    return min(options, key=lambda x: x.seconds)


def _nvls_algorithm(shape: GroupShape, kind: Collective) -> Algorithm | None:
    """NVLS for an all-reduce where the switches reduce: in a node, or over nodes as
    NVLS-tree. NCCL also offers NVLS for a reduce-scatter or all-gather in a node, but
    its model (bandwidth x (k-1)/k, no ring's k/(k-1)) never prefers it to the ring
    there, so it is left out."""
    if not shape.nvls or kind is not Collective.ALL_REDUCE:
        return None
    return Algorithm.NVLS if shape.nodes == 1 else Algorithm.NVLS_TREE


def _nvls_bandwidth(shape: GroupShape, kind: Collective, a: Algorithm) -> float:
    """The algorithm bandwidth of an NVLS or NVLS-tree all-reduce (tuning.cc): a
    channel per GPU of the node, one of them lost; the reduce and multicast halves
    pipelined (x2); across nodes at most the network's (twice it for a tree of 2 nodes)
    and the tree's per-channel cap; k/(2(k-1)) of that the algorithm's, as a ring's."""
    channels = shape.per_node
    bus = 2 * shape.intra_bandwidth * NVLS_EFFICIENCY * (channels - 1) / channels
    if a is Algorithm.NVLS_TREE:
        bus = min(bus, shape.inter_bandwidth * (2 if shape.nodes <= 2 else 1))
        cap = NVLS_TREE_CHANNEL_CAP_GBS[2 if shape.nodes <= 2 else 4] * GB * channels
        bus = min(bus, cap)
    return bus * shape.ranks / _steps(shape, kind)[0]


def _nvls_latency(shape: GroupShape, a: Algorithm) -> float:
    """NVLS: its NVLink hop, and one network hop over nodes; NVLS-tree: its NVLink hop
    and two network hops a level of the tree of nodes."""
    intra, net = (NVLS_LATENCY_US[a][h] * US for h in (Hop.NVLINK, Hop.NET))
    if a is Algorithm.NVLS:
        return intra + (net if shape.nodes > 1 else 0.0)
    return intra + 2 * math.floor(math.log2(shape.nodes)) * net


def _steps(shape: GroupShape, kind: Collective) -> tuple[int, int]:
    """A ring's steps, and of them the ones that cross the network."""
    k, n = shape.ranks, shape.nodes
    if kind is Collective.ALL_REDUCE:
        return 2 * (k - 1), 2 * (n - 1)
    if kind in (Collective.REDUCE_SCATTER, Collective.ALL_GATHER):
        return k - 1, n - 1
    return k, n


def _bandwidth(shape: GroupShape, kind: Collective, a: Algorithm, p: Protocol) -> float:
    """The algorithm bandwidth (bytes/s of the buffer) of ``a`` with ``p``."""
    bus = shape.bus_bandwidth
    multi = shape.nodes > 1
    if a is Algorithm.RING:
        if p is Protocol.LL:
            reducing = kind in (Collective.ALL_REDUCE,)
            bus /= 4 if multi or reducing else 3
        elif p is Protocol.LL128:
            bus *= 0.7 if shape.per_node < 2 else 0.92
        nsteps, _ = _steps(shape, kind)
        return bus * shape.ranks / nsteps
    bus = min(bus * 0.9, TREE_CAP_GBS[shape.nodes > 2] * GB)
    if p is Protocol.LL:
        bus /= 3.8
    elif p is Protocol.LL128:
        bus *= 0.915 if multi else 7 / 9
    return bus * 0.5


def _latency(shape: GroupShape, kind: Collective, a: Algorithm, p: Protocol, nbytes: int) -> float:
    intra = _hop_latency(shape.intra, a, p)
    net = _hop_latency(Hop.NET, a, p)
    if shape.nodes > 1 and p is Protocol.LL:
        intra *= 1.8
    latency = _base_latency(a, p)
    if a is Algorithm.TREE:
        levels = math.floor(math.log2(shape.nodes))
        return latency + 2 * ((shape.ranks // shape.nodes - 1) * intra + levels * net)
    nsteps, inter = _steps(shape, kind)
    if kind is Collective.BROADCAST:
        hop = net if shape.nodes > 1 else intra
        if p is Protocol.SIMPLE:  # a chunk's latency along the chain (NCCL's tree figure)
            hop = _hop_latency(Hop.NET if shape.nodes > 1 else shape.intra, Algorithm.TREE, p)
        return latency + nsteps * hop
    latency += (nsteps - inter) * intra + inter * net
    plateau = kind is Collective.ALL_REDUCE and p is Protocol.SIMPLE and shape.nodes > 1
    if plateau and nbytes >= shape.ranks / 16 * 65536:
        latency *= RING_PLATEAU
    return latency


def _all_to_all(shape: GroupShape, nbytes: int) -> float:
    """Grouped sends and receives: each rank sends 1/k of its buffer to every other;
    the node's share for other nodes crosses its network links, the rest NVLink or
    PCIe, both at once; one message latency of each kind."""
    k, ppn = shape.ranks, shape.per_node
    chunk = nbytes / k
    inside = chunk * (ppn - 1) / shape.intra_bandwidth if ppn > 1 else 0.0
    outside = 0.0
    latency = _base_latency(Algorithm.RING, Protocol.SIMPLE)
    latency += _hop_latency(shape.intra, Algorithm.RING, Protocol.SIMPLE)
    if shape.nodes > 1:
        outside = chunk * (k - ppn) * ppn / shape.inter_bandwidth
        latency += _hop_latency(Hop.NET, Algorithm.RING, Protocol.SIMPLE)
    return latency + max(inside, outside)


def bus_bandwidth(kind: Collective, ranks: int, nbytes: int, seconds: float) -> float:
    """nccl-tests' busbw (bytes/s) of a collective of ``nbytes`` that took ``seconds``."""
    return nbytes / seconds * kind.bus_factor(ranks) if seconds > 0 else math.inf
