"""Measure this host's MPI ranks and write a machine file (``onnx2soap machine probe``).

Run under mpiexec (``python -m onnx2soap.measure.probe -o FILE.yaml``); the ranks measure at
the same time, one per core (where ranks outnumber the cores, the file says how many
cores they share, ``Machine.cores``, and the simulator gives them turns): matmul FLOP/s,
copy bandwidth, the fixed cost of a tiny task, and rank-to-rank latency
and bandwidth between rank 0 and every other rank. The bandwidth from a ping-pong of 4
MiB messages through the executor's own transport (``executor/transport.py``: a
nonblocking send, a posted receive, the wait that completes it, the end of the step);
the latency from what a message adds to a step of the executor's runtime
(``probe_messages.py``: its instructions and their dispatch included, 5-25 us on a
2-core VM, where bare MPI takes about 1 us and the transport's calls alone 2 us); and
the latency of a ring all-reduce's step from the rings of a traced data-parallel step
of the runtime (``Machine.ring_step_latency``: several times a message's there), and
what its chunk's bytes add, by size, from the transport's all-reduces of growing arrays
(``probe_rings.py``, ``Machine.ring_step_curve``); where
ranks have a core each, what a ring costs beyond that after a silence
(``probe_cooling.py``, ``Machine.cooling``); where MPI reports the ranks on several
hosts (``executor/transport.py hosts_of``; run the module under your own ``mpiexec -f
HOSTFILE``), the hosts (``Machine.nodes``) and what a message between two of them adds
in latency and takes in bandwidth, from rank 0's ping-pongs with other hosts' ranks next
to its own host's (``presets.cpu_hosts``: a network link each way a host); and,
where ranks share cores (they nap and sleep while they wait), what a rank pays for
having slept through a long wait, from what handing a chain of matrix products from
rank to rank adds to its step beyond its messages (``probe_resume.py``,
``Machine.resume``; ranks with a core each spin, and their file has none).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from onnx2soap.errors import MachineError
from onnx2soap.files import write_atomic
from onnx2soap.measure.probe_cooling import cooling_cost
from onnx2soap.measure.probe_messages import ROUNDS, message_costs, ring_step_seconds
from onnx2soap.measure.probe_resume import PAIRS, resume_cost
from onnx2soap.measure.probe_rings import ring_step_curve
from onnx2soap.sim.machine import ComputeDevice, dump_machine
from onnx2soap.sim.presets import cpu, cpu_hosts

# The machine's margin (``Machine.margin``) is not probed: it is the simulator's step
# error on such ranks, which only timing whole plans shows. benchmarks/fidelity.py
# measured 6-21 % (after the common factor) on CPU ranks of this project's 2-core VM;
# a tenth, near the low end, is what the search is told unless the file says otherwise.
CPU_RANKS_MARGIN = 0.1


def _rate(work: Callable[[], None], seconds: float) -> float:
    """Calls per second of ``work``, measured over about ``seconds``."""
    work()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or calls < 3:
        work()
        calls += 1
    return calls / elapsed


def _compute_rates(seconds: float) -> tuple[float, float, float]:
    """FLOP/s, bytes/s and per-task seconds as the executor's numpy kernels see them: a
    convolution by gathered columns and a matrix product, a strided gather like a
    window's, and the handful of small array operations every task costs whatever its
    size."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 16, 34, 34), dtype=np.float32)
    w = rng.standard_normal((32, 16 * 9), dtype=np.float32)

    def conv() -> None:  # a 3x3 convolution as the kernels run it: gather columns, GEMM
        taps = [x[:, :, i : i + 32, j : j + 32] for i in range(3) for j in range(3)]
        cols = np.stack(taps, axis=2).reshape(16, 16 * 9, 32 * 32).transpose(1, 0, 2)
        w @ cols.reshape(16 * 9, -1)

    flops = _rate(conv, seconds) * 2 * 16 * 32 * 32 * 32 * 16 * 9
    image = rng.standard_normal((32, 16, 64, 64), dtype=np.float32)
    window = np.empty((32, 16, 32, 32), dtype=np.float32)
    bandwidth = _rate(lambda: np.copyto(window, image[:, :, ::2, ::2]), seconds) * 2 * window.nbytes
    small = rng.standard_normal((2, 3, 4), dtype=np.float32)
    weight = rng.standard_normal((4, 5), dtype=np.float32)

    def task() -> None:
        buffer = np.zeros((2, 3, 4), dtype=np.float32)
        buffer[:, 1:, :] = small[:, 1:, :]
        out = np.einsum("abc,cd->abd", buffer, weight)
        np.maximum(out, 0, out=out)
        out.sum(axis=0)

    overhead = 1.0 / _rate(task, seconds)
    return flops, bandwidth, overhead


def _one_way(transport, message: np.ndarray, to: int) -> None:
    """One tile as the executor moves it from this rank to ``to``."""
    transport.send(message, to)
    transport.end_step()


def _ping_pong(comm, transport, peer: int, nbytes: int, rounds: int) -> float:
    """Median seconds per one-way message between rank 0 and ``peer`` (a round trip
    over two; the median, as other work on a shared host lands on a few rounds)."""
    out = np.zeros(max(nbytes // 4, 1), dtype=np.float32)
    back = np.empty_like(out)
    rank = comm.Get_rank()
    times = []
    comm.Barrier()
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            _one_way(transport, out, peer)
            transport.wait(transport.recv(back, peer))
        elif rank == peer:
            transport.wait(transport.recv(back, 0))
            _one_way(transport, out, 0)
        times.append((time.perf_counter() - start) / 2)
    return float(np.median(times))


@dataclass(frozen=True)
class LinkFigures:
    latency: float
    bandwidth: float
    busy: float  # of a message's latency, what each end rank spends on it
    # Between hosts, where the ranks span several (``between`` below): a message's
    # latency beyond one inside a host, and the bandwidth. None: one host.
    network: tuple[float, float] | None = None


@dataclass(frozen=True)
class Peer:
    """Rank 0's ping-pong with one peer: a small message's one-way seconds and the
    bandwidth of large ones."""

    small: float
    bandwidth: float
    same_host: bool


def between(peers: list[Peer]) -> tuple[float, float] | None:
    """(latency beyond a host's, bandwidth) of messages between hosts, from rank 0's
    peers on other hosts next to those on its own (none on its own: the other hosts'
    whole latency); None where every peer shares rank 0's host."""
    inside = [p for p in peers if p.same_host]
    outside = [p for p in peers if not p.same_host]
    if not outside:
        return None
    base = float(np.median([p.small for p in inside])) if inside else 0.0
    extra = max(float(np.median([p.small for p in outside])) - base, 0.0)
    return extra, float(np.median([p.bandwidth for p in outside]))


DEFAULT_SECONDS = 0.3


def _rounds(seconds: float) -> int:
    """Rounds of the message and ring figures: ``ROUNDS`` at the default time per
    measurement, fewer for a quick probe (one at 0.05 s: tests), more for a patient one."""
    return max(1, round(ROUNDS * seconds / DEFAULT_SECONDS))


def _links(comm, nap: bool, rounds: int, hosts: tuple[int, ...]) -> LinkFigures:
    """``nap``: ranks share cores, and wait as the executor's then do (on doorbells).
    ``hosts``: each rank's host: the figures inside rank 0's, and between hosts."""
    from executor.device import CpuDevice
    from executor.doorbell import Doorbell
    from executor.transport import MpiTransport

    bell = Doorbell.open(comm) if nap else None
    transport = MpiTransport(comm, CpuDevice(), nap=nap, bell=bell)
    peers = []
    size = 4 << 20
    for peer in range(1, comm.Get_size()):
        _ping_pong(comm, transport, peer, size, 2)  # buffers and MPI's paths warmed
        small = _ping_pong(comm, transport, peer, 8, 200)
        large = _ping_pong(comm, transport, peer, size, 20)
        bandwidth = size / max(large - small, 1e-9)
        peers.append(Peer(small, bandwidth, hosts[peer] == hosts[0]))
    if bell is not None:
        bell.close()
    costs = message_costs(comm, nap, rounds)
    if not costs:
        return LinkFigures(5e-6, 4e9, 5e-6)
    inside = [p.bandwidth for p in peers if p.same_host] or [p.bandwidth for p in peers]
    return LinkFigures(
        float(np.median([c.seconds for c in costs])),
        float(np.median(inside)),
        float(np.median([c.busy for c in costs])),
        between(peers),
    )


def host_layout(hosts: tuple[int, ...]) -> tuple[int, int]:
    """(hosts, ranks a host) of ranks that fill their hosts in order, as many on each
    (mpiexec's default placement); a one-line error otherwise."""
    firsts = sorted(set(hosts))
    per_host = hosts.count(firsts[0])
    if any(h != r - r % per_host for r, h in enumerate(hosts)):
        raise MachineError(
            f"machine probe: the ranks' hosts (by first rank) are {list(hosts)}; the probe "
            "describes ranks that fill their hosts in order, as many on each (mpiexec -ppn N)"
        )
    return len(firsts), per_host


def _shared_cores(comm) -> int:
    """The cores the ranks share where they outnumber their node's (0: a core each)."""
    from executor.transport import oversubscribed

    return (os.cpu_count() or 1) if oversubscribed(comm) else 0


def probe(comm, seconds: float = DEFAULT_SECONDS) -> str:
    """Measure and return the machine file's YAML (on every rank). Where ranks share
    cores, only one rank per core measures the compute rates (the simulator gives a
    shared core's devices their turns, each at a core's own rate)."""
    from executor.transport import SLEEPS_AFTER_S, hosts_of, nap_precisely, wait_patiently

    cores = _shared_cores(comm)
    hosts = hosts_of(comm)
    layout = host_layout(hosts)  # refused before anything is measured
    if cores:  # the ranks wait as the executor's do
        nap_precisely()
    measuring = not cores or comm.Get_rank() < cores
    comm.Barrier()
    mine = _compute_rates(seconds) if measuring else None
    wait_patiently(comm.Ibarrier().Test, nap=bool(cores))
    rates = [r for r in comm.allgather(mine) if r is not None]
    links = _links(comm, nap=bool(cores), rounds=_rounds(seconds), hosts=hosts)
    links = comm.bcast(links, root=0)
    ring = comm.bcast(ring_step_seconds(comm, bool(cores), _rounds(seconds)), root=0)
    curve = comm.bcast(ring_step_curve(comm, bool(cores)), root=0)
    ranks = comm.Get_size()
    # a host's memory over its own ranks (rank 0's host speaks for every host)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // layout[1]
    device = ComputeDevice(
        "cpu-rank",
        peak_flops=float(min(r[0] for r in rates)),
        memory_bandwidth=float(min(r[1] for r in rates)),
        memory=int(memory),
        kernel_overhead=float(max(r[2] for r in rates)),
    )
    # A route is two links (out-port, in-port), and a transfer pays every link's latency;
    # between hosts also the hosts' network links, each half of what the network adds.
    if links.network is None:
        machine = cpu(ranks, device, links.bandwidth, links.latency / 2)
    else:
        extra, bandwidth = links.network
        nic = (bandwidth, extra / 2)
        machine = cpu_hosts(*layout, device, links.bandwidth, links.latency / 2, nic)
    # Ranks that nap while they wait give their core away for part of a message; ranks
    # that spin hold it throughout (the machine's default).
    busy = min(links.busy, links.latency) if cores else None
    machine = replace(machine, cores=cores, message_busy=busy, ring_step_latency=ring)
    machine = replace(machine, ring_step_curve=curve)
    machine = replace(machine, margin=CPU_RANKS_MARGIN)
    # Only ranks that share cores sleep while they wait (the transport's naps, then its
    # doorbell); with a core each they spin and never owe a resume. Probed there too,
    # the handed chain's figure (0.36-0.75 ms on 2 ranks here, where benchmarks/handoff.py
    # times a spinning rank's hand-off at 27-116 us) was everything else the chain's
    # hand-offs cost, and charged after every long wait it made the plans with many
    # (random ones, GPT-2's ILP plan: 15.6 ms predicted, 6.8 measured) 1.2-2.3x too slow.
    if ranks > 1 and cores:
        pairs = max(8, round(PAIRS * seconds / DEFAULT_SECONDS))
        resume = resume_cost(comm, machine, SLEEPS_AFTER_S, pairs)
        machine = replace(machine, resume=comm.bcast(resume, root=0))
    elif ranks > 1:  # they spin, and pay for a silence instead
        machine = replace(machine, cooling=cooling_cost(comm))
    return dump_machine(machine)


def main() -> int:
    from mpi4py import MPI

    parser = argparse.ArgumentParser(prog="python -m onnx2soap.measure.probe")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument(
        "--seconds",
        type=float,
        default=DEFAULT_SECONDS,
        help=f"time per measurement (message figures: {ROUNDS} rounds at the default)",
    )
    args = parser.parse_args()
    text = probe(MPI.COMM_WORLD, args.seconds)
    if MPI.COMM_WORLD.Get_rank() == 0:
        write_atomic(Path(args.output), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
