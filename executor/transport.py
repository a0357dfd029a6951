"""Moving tiles and summing gradients between ranks: one ``Transport`` interface, three ways.

- ``mpi``: MPI on the arrays themselves: numpy arrays on CPU ranks, device arrays when
  the MPI library is CUDA-aware (``mpi-cuda``);
- ``mpi-host``: device arrays staged through page-locked host buffers over MPI; it runs
  anywhere, also with several ranks on one GPU (which NCCL refuses);
- ``nccl``: NCCL on the GPU's communication stream (executor/nccl.py).

Messages carry no tags: the program gives each pair of ranks one order of sends and
receives (see executor/program.py), and MPI delivers messages between a pair on one
communicator in the order they were posted. All-reduces are our own ring (the chunks and
steps the simulator counts), nonblocking: ``allreduce`` starts one and every later call
into the transport moves the rings on, so a weight group's reduction proceeds while the
backward pass computes. Rings on one communicator run one after another, in the order
they were started, which is the program's order on every member.

A sent array lives with the transport until its send completes, not to the step's end:
each call into the transport lets go of the sends found complete (``_Sends``), as
PyTorch's caching allocator frees a send's buffer once its stream is past it. Held to
the step's end, every column-parallel linear's input gradient of a tensor-parallel
LLaMA-3-8B (1.07 GB each, 161 of them) had been alive at once (sim/memory.py prices the
new lifetimes).

``bytes_sent`` counts the payload this rank sends in training steps (tiles, gradient
pieces, all-reduce chunks): the figure the simulator predicts.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from executor.device import Device
from executor.doorbell import LONGEST_NAP_S, Doorbell, GroupBell
from executor.kinds import DeviceKind, TransportKind
from onnx2soap.soap.buckets import shard_major
from onnx2soap.soap.collectives import (
    HostRings,
    RingStep,
    all_gather_steps,
    host_rings,
    reduce_scatter_steps,
    ring_chunks,
    ring_steps,
    takes_two_levels,
)
from onnx2soap.soap.partition import Interval

Array = Any  # numpy or cupy


class Pending(Protocol):
    """A receive or all-reduce in flight; ``Transport.wait`` completes it."""


class Transport(Protocol):
    rank: int
    bytes_sent: int

    def make_groups(self, device_sets: Iterable[tuple[int, ...]]) -> None:
        """One communicator per device set. Collective over the world: every rank
        passes the same sets."""

    def send(self, array: Array, dest: int) -> None:
        """Start sending a contiguous array; it must stay untouched while the send is in
        flight. The transport holds it until the send completes (at the latest,
        ``end_step``): the caller may drop it at once."""

    def recv(self, buffer: Array, source: int) -> Pending:
        """Start receiving into a contiguous buffer."""

    def allreduce(self, array: Array, devices: tuple[int, ...]) -> Pending:
        """Start an in-place sum of a contiguous array over ``devices``."""

    def allreduce_all(self, arrays: Sequence[Array], devices: tuple[int, ...]) -> Pending:
        """Start an in-place sum of several contiguous arrays of one dtype over
        ``devices`` as one collective (a gradient bucket, soap/buckets.py): the ring of
        their concatenation, which is never made."""

    def reduce_scatter(
        self, array: Array, devices: tuple[int, ...], chunks: tuple[Interval, ...]
    ) -> Pending:
        """Start summing a contiguous array over ``devices`` so that member ``i`` (its
        place in ``devices``) ends with the sum of its flat run ``chunks[i]`` (ZeRO; the
        rest of its array is left partly summed)."""

    def reduce_scatter_all(
        self,
        arrays: Sequence[Array],
        devices: tuple[int, ...],
        runs: Sequence[tuple[Interval, ...]],
    ) -> Pending:
        """``reduce_scatter`` of several contiguous arrays of one dtype as one
        collective (a gradient bucket's sharded groups, soap/buckets.py): member ``i``
        ends with the sum of run ``runs[a][i]`` of every array ``a``."""

    def all_gather(
        self, array: Array, devices: tuple[int, ...], chunks: tuple[Interval, ...]
    ) -> Pending:
        """Start giving every member of ``devices`` member ``i``'s run ``chunks[i]`` of
        a contiguous array, in place (ZeRO's updated shards)."""

    def let_go(self) -> None:
        """Let go of the sent arrays whose sends have completed (each call into the
        transport does too): the step calls it before each kernel, so that an array
        is not kept through a kernel for want of a call."""

    def wait(self, pending: Pending) -> None:
        """The receive or all-reduce is complete as far as the computation that follows
        can tell (on a GPU: the compute stream waits for it)."""

    def end_step(self) -> None:
        """Every send and reduction of the step is done; their buffers may be reused."""

    def close(self) -> None:
        """Free the communicators ``make_groups`` made (after the last ``end_step``).
        Collective over each group's members, as their making was."""


SPINS = 64  # tests a waiting rank makes back to back before it starts to nap
NAP_S = 50e-6
# Naps before a rank sleeps on its bell: a short wait (a ring all-reduce's step) naps as
# ever, since rings that wake a rank early also take the core from the rank they wake it
# on (data parallelism on 4 ranks on 2 cores: 15 % slower ringing from the first nap).
NAPS_BEFORE_BELL = 4
# The least wait after which a napping rank sleeps on its bell: its core goes to other
# ranks, and it comes back slowly (``Machine.resume``, ``measure/probe_resume.py``).
SLEEPS_AFTER_S = NAPS_BEFORE_BELL * NAP_S


_PR_SET_TIMERSLACK = 29  # <linux/prctl.h>


def nap_precisely() -> None:
    """Let this thread's naps and bell sleeps end when they are asked to. Linux lets a
    sleep overrun by the thread's timer slack (50 us by default) so that it can wake
    several sleepers at once; a rank that naps waits for the end of its nap to see a
    message that came during it. On an AMD EPYC VM a 50 us nap took 118 us, 67 us with
    1 ns of slack (on an Intel Xeon VM the slack made no difference). For ranks that
    nap (``oversubscribed``); elsewhere there is no timer slack to set. A refusal leaves
    the default: naps only longer."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)


def oversubscribed(comm: MPI.Comm) -> bool:
    """More ranks on this node than it has cores (collective over ``comm``)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        crowded = node.Get_size() > (os.cpu_count() or 1)
    finally:
        node.Free()
    return bool(comm.allreduce(crowded, op=MPI.LOR))


def wait_patiently(
    ready: Callable[[], bool],
    between: Callable[[], None] | None = None,
    nap: bool = False,
    nap_s: float = NAP_S,
    bell: Doorbell | None = None,
) -> None:
    """Wait until ``ready()``, calling ``between()`` after each failed test. With ``nap``
    (ranks outnumber cores), after a few quick tests the rank sleeps ``nap_s`` between
    them: a rank spinning in a wait holds a core its peer needs to finish what it waits
    for (4 ranks on 2 cores: 65 ms a step spinning, 44 ms napping). With a core each,
    spinning is faster (a nap adds up to ~0.1 ms of latency: 5 % on a 2-rank step here).
    With a ``bell``, after ``NAPS_BEFORE_BELL`` naps the rank sleeps on it instead, until
    a peer rings or a timeout that doubles while nothing rings (executor/doorbell.py)."""
    tests, sleep_s, longest = 0, nap_s, max(nap_s, LONGEST_NAP_S)
    while not ready():
        if between is not None:
            between()
        tests += 1
        if not nap or tests <= SPINS:
            continue
        if bell is None or tests <= SPINS + NAPS_BEFORE_BELL:
            time.sleep(nap_s)
        else:
            sleep_s = nap_s if bell.sleep(sleep_s, ready) else min(2 * sleep_s, longest)


class _Ring:
    """One nonblocking ring all-reduce (sum): at each step a rank sends one chunk to its
    right neighbour and receives one from its left, adding it in the reduce-scatter
    half and copying it in the all-gather half. Every rank ends with the same values:
    each chunk is summed once, on one rank, then passed on."""

    def __init__(
        self,
        comm: MPI.Comm,
        flat: _Runs,
        counter: _Counter,
        device: Device,
        bell: GroupBell | None = None,
        chunks: tuple[Interval, ...] | None = None,
        steps: Callable[[int, int], tuple[RingStep, ...]] = ring_steps,
    ) -> None:
        """``flat``: numpy arrays, or device memory under a CUDA-aware MPI (then each
        step waits for the addition before MPI reads the chunk). ``bell``: this
        rank's doorbell and the world ranks of ``comm``'s members, who are rung.
        ``chunks`` and ``steps``: another schedule over given runs (ZeRO's halves);
        by default the all-reduce's over balanced chunks."""
        self.comm, self.flat, self.counter = comm, flat, counter
        self.device = None if flat.xp is np else device
        k, r = comm.Get_size(), comm.Get_rank()
        self.chunks = ring_chunks(flat.size, k) if chunks is None else chunks
        self.steps = list(steps(r, k))
        self.right, self.left = (r + 1) % k, (r - 1) % k
        self.bell = bell
        self.scratch: Array | None = None  # made when the ring's turn comes, dropped after
        self.sending: tuple[Array, ...] = ()  # the pieces this step sends, until sent
        self.next = 0
        # this step's sends and receives, a message a piece of the chunk
        self.requests: tuple[list[MPI.Request], list[MPI.Request]] | None = None
        self.received = False  # this step's chunk
        self.done = k == 1

    def advance(self) -> bool:
        """Move on as far as the messages allow; True once the sum is complete."""
        while not self.done:
            if self.requests is not None:
                sends, receives = self.requests
                if not self.received and MPI.Request.Testall(receives):
                    self.received = True
                    if self.bell is not None:  # the left may wait for its send to complete
                        self.bell.ring(self.left)
                if not (self.received and MPI.Request.Testall(sends)):
                    return False
                self._land(self.steps[self.next - 1])
                self.requests = None
            if self.next == len(self.steps):
                # The step keeps a finished ring (its Pending) to its end; its scratch
                # need not: held by every queued ring, data parallelism had kept a
                # 1/k copy of every gradient through the backward (resnet18: 0.65 MB,
                # 13 % of a rank's peak)
                self.done, self.scratch = True, None
            else:
                if self.scratch is None:
                    widest = max(hi - lo for lo, hi in self.chunks)
                    self.scratch = self.flat.xp.empty(widest, dtype=self.flat.dtype)
                self._post(self.steps[self.next])
                self.next += 1
        return True

    def _post(self, step) -> None:
        slo, shi = self.chunks[step.send_chunk]
        rlo, rhi = self.chunks[step.recv_chunk]
        self.counter.bytes += (shi - slo) * self.flat.itemsize
        self.sending = self.flat.pieces(slo, shi)  # held until the sends complete
        if self.device is not None:
            self.device.synchronize()
        # A message a piece (every member cuts a chunk alike: one bucket, one layout),
        # each received where it lands in the scratch, in the order sent. A derived
        # datatype over the pieces had been one message, but MPICH moves those through
        # its shared-memory cells a piece of progress at a time: ranks that nap took
        # 210 ms to sum 1.2 MB in two pieces on 4 ranks, 3 ms contiguous.
        receives = [
            self.comm.Irecv(_wire(self.scratch[a - rlo : b - rlo]), source=self.left)
            for a, b in self.flat.spans(rlo, rhi)
        ]
        sends = [self.comm.Isend(_wire(piece), dest=self.right) for piece in self.sending]
        self.requests = (sends, receives)
        self.received = False
        if self.bell is not None:
            self.bell.ring(self.right)

    def _land(self, step) -> None:
        rlo, rhi = self.chunks[step.recv_chunk]
        self.flat.land(rlo, rhi, self.scratch[: rhi - rlo], step.reduce)
        self.sending = ()


class _Chain:
    """Rings one after another as one all-reduce (the two-level form over hosts,
    ``soap/collectives.py HostRings``): each starts once the one before is complete on
    this rank. Its rings have communicators of their own, so they match no other
    ring's messages; chains over one device set run in the program's order (one queue)."""

    def __init__(self, rings: Sequence[_Ring], flat: _Runs) -> None:
        self.rings, self.flat, self.current = list(rings), flat, 0

    @property
    def done(self) -> bool:
        return self.current == len(self.rings)

    def advance(self) -> bool:
        while self.current < len(self.rings):
            if not self.rings[self.current].advance():
                return False
            self.current += 1
        return True


@dataclass(frozen=True)
class _HostComms:
    """A device set's two-level all-reduce on this rank: its host's communicator and
    its cross-host ring's, with their doorbells (ranks that nap)."""

    rings: HostRings
    host: MPI.Comm
    across: MPI.Comm
    host_bell: GroupBell | None
    across_bell: GroupBell | None


class _Runs:
    """Contiguous arrays of one dtype seen as one flat run, their concatenation, which
    is never made (a gradient bucket's, soap/buckets.py; one array most often). A ring's
    chunk may span several: it is sent in place, a message a piece (``pieces``), where a
    copy of the chunk had added a bucket's size (on 2 ranks) to the end of the backward,
    when every gradient is held. What lands is added or copied piece by piece."""

    def __init__(self, arrays: Sequence[Array], xp) -> None:
        self.parts = [a.reshape(-1) for a in arrays]
        self.starts = [0]
        for part in self.parts:
            self.starts.append(self.starts[-1] + part.size)
        self.size, self.xp = self.starts[-1], xp
        self.dtype, self.itemsize = self.parts[0].dtype, self.parts[0].itemsize

    def _pieces(self, lo: int, hi: int):
        """(array, its run, the run's offset in [lo, hi)) of every piece of [lo, hi)."""
        k = bisect_right(self.starts, lo) - 1
        at = lo
        while at < hi:
            start, end = self.starts[k], self.starts[k + 1]
            if end > at:
                top = min(hi, end)
                yield self.parts[k], slice(at - start, top - start), at - lo
                at = top
            k += 1

    def pieces(self, lo: int, hi: int) -> tuple[Array, ...]:
        """[lo, hi) as views of the arrays it spans, in order."""
        return tuple(part[run] for part, run, _ in self._pieces(lo, hi))

    def spans(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """[lo, hi) cut where the arrays meet: the flat intervals of ``pieces``."""
        return [(lo + at, lo + at + run.stop - run.start) for _, run, at in self._pieces(lo, hi)]

    def land(self, lo: int, hi: int, data: Array, add: bool) -> None:
        """Add ``data`` into [lo, hi) (a reduce step), or copy it there."""
        for part, run, at in self._pieces(lo, hi):
            if add:
                part[run] += data[at : at + run.stop - run.start]
            else:
                part[run] = data[at : at + run.stop - run.start]


@dataclass
class _Counter:
    bytes: int = 0


@dataclass
class _RingQueues:
    """The rings started on each communicator, oldest first: only the oldest moves, so
    every member exchanges one ring's messages at a time, in the program's order."""

    queues: dict[tuple[int, ...], deque[_Ring | _Chain]] = field(default_factory=dict)

    def start(self, devices: tuple[int, ...], ring: _Ring | _Chain) -> None:
        self.queues.setdefault(devices, deque()).append(ring)
        self.progress()

    def progress(self) -> None:
        for queue in self.queues.values():
            while queue and queue[0].advance():
                queue.popleft()

    def busy(self) -> bool:
        return any(self.queues.values())


def _wire(array: Array) -> Array:
    """What MPI is given of an array: a 2-byte float (mixed precision's stored tiles:
    bfloat16 has no MPI type, float16 not everywhere) as its bits, moved as they are."""
    if array.dtype.itemsize == 2 and array.dtype.kind not in "iu":
        return array.view(np.uint16)
    return array


@dataclass(frozen=True)
class _Sent:
    """A send in flight: its request, the buffer MPI reads, and the array the step gave
    (staged: its device array, held as NCCL holds it, so that a sent tile lives as long
    whatever the transport: sim/memory.py prices one lifetime)."""

    request: MPI.Request
    payload: Array
    array: Array


class _Sends:
    """The sends in flight, per destination, oldest first, each held until it is found
    complete. ``retire`` tests each destination's oldest and stops at its first still in
    flight: work bounded by the destinations and the sends let go, since a pair's sends
    complete about in the order they were posted (MPI matches them so); a complete one
    behind a pending one goes at a later call, or at the step's end."""

    def __init__(self) -> None:
        self.queues: dict[int, deque[_Sent]] = {}

    def add(self, sent: _Sent, dest: int) -> None:
        self.queues.setdefault(dest, deque()).append(sent)

    def retire(self) -> None:
        for queue in self.queues.values():
            while queue and queue[0].request.Test():
                queue.popleft()

    def requests(self) -> list[MPI.Request]:
        return [sent.request for queue in self.queues.values() for sent in queue]

    def clear(self) -> None:
        self.queues.clear()


@dataclass(frozen=True)
class _MpiReceive:
    request: MPI.Request
    source: int
    host: np.ndarray | None = None  # mpi-host: where the message lands before the device
    target: Array = None


@dataclass(frozen=True)
class _MpiReduce:
    ring: _Ring | _Chain
    # mpi-host: the device arrays the host sums (``ring.flat``'s) are copied back to
    targets: tuple[Array, ...] = ()


class MpiTransport:
    """MPI point-to-point on the world communicator and rings on sub-communicators.

    ``staged`` (mpi-host): device arrays are copied to page-locked host buffers, moved
    by MPI and copied back; the host buffers are made in the first step and reused. Not
    staged: MPI reads and writes the arrays directly (numpy, or device memory under a
    CUDA-aware MPI, after the compute stream is synchronized)."""

    def __init__(
        self,
        comm: MPI.Comm,
        device: Device,
        staged: bool = False,
        nap: bool = False,
        bell: Doorbell | None = None,
        hosts: tuple[int, ...] | None = None,
    ) -> None:
        """``nap``: sleep while waiting, on ``bell`` if given (see ``wait_patiently``),
        which is rung for every message posted to a peer and received from one.
        ``hosts``: each rank's host (``hosts_of``); all-reduces over ranks of several
        hosts then take the two-level form (``soap/collectives.py host_rings``)."""
        self.comm, self.device, self.staged, self.nap = comm, device, staged, nap
        self.bell, self.hosts = bell, hosts
        self._host_comms: dict[tuple[int, ...], _HostComms] = {}
        self.rank = comm.Get_rank()
        self._counter = _Counter()
        self._groups: dict[tuple[int, ...], MPI.Comm] = {}
        self._group_bells: dict[tuple[int, ...], GroupBell] = {}
        self._made: set[tuple[int, ...]] = set()
        self._rings = _RingQueues()
        self._sends = _Sends()  # with what they send from, until they complete
        self._pool = _HostPool(device)
        self._direct_device = not staged and device.xp is not np

    @property
    def bytes_sent(self) -> int:
        return self._counter.bytes

    def make_groups(self, device_sets: Iterable[tuple[int, ...]]) -> None:
        # Every rank skips the same sets (made by an earlier call): a skip decided on the
        # rank's own groups alone would leave non-members in a Split the members skip.
        for devices in sorted(set(device_sets) - self._made):
            self._made.add(devices)
            color = 0 if self.rank in devices else MPI.UNDEFINED
            sub = self.comm.Split(color, key=self.rank)
            if sub != MPI.COMM_NULL:
                self._groups[devices] = sub
                if self.bell is not None:  # Split kept the world's order: key=rank
                    self._group_bells[devices] = GroupBell(self.bell, tuple(sorted(devices)))
            rings = host_rings(devices, self.hosts)
            if rings is not None:  # decided alike on every rank: from the set and hosts
                self._make_host_comms(devices, rings)

    def _make_host_comms(self, devices: tuple[int, ...], rings: HostRings) -> None:
        """Two more communicators for the set's two-level all-reduce (every rank takes
        part in both splits): its host's members, and its cross-host ring."""
        place = rings.place(self.rank) if self.rank in devices else None
        host = self.comm.Split(MPI.UNDEFINED if place is None else place[0], key=self.rank)
        across = self.comm.Split(MPI.UNDEFINED if place is None else place[1], key=self.rank)
        if place is None:
            return
        h, j = place
        bells = (None, None)
        if self.bell is not None:
            bells = (GroupBell(self.bell, rings.hosts[h]), GroupBell(self.bell, rings.across()[j]))
        self._host_comms[devices] = _HostComms(rings, host, across, *bells)

    def _host(self, array: Array) -> np.ndarray:
        if self.staged:
            return self.device.to_host(array, out=self._pool.take(array.shape, array.dtype))
        if self._direct_device:
            self.device.synchronize()  # MPI reads device memory the kernels wrote
        return array

    def send(self, array: Array, dest: int) -> None:
        self._sends.retire()  # before this one: it has had no time to complete
        payload = self._host(array)
        self._counter.bytes += array.nbytes
        self._sends.add(_Sent(self.comm.Isend(_wire(payload), dest=dest), payload, array), dest)
        if self.bell is not None:
            self.bell.ring(dest)
        self._rings.progress()

    def recv(self, buffer: Array, source: int) -> _MpiReceive:
        self._sends.retire()
        if self._direct_device:
            # MPI writes device memory out of stream order: the step made the buffer from
            # the compute stream's pool, which kernels queued earlier may still read
            self.device.synchronize()
        if self.staged:
            host = self._pool.take(buffer.shape, buffer.dtype)
            return _MpiReceive(self.comm.Irecv(_wire(host), source=source), source, host, buffer)
        return _MpiReceive(self.comm.Irecv(_wire(buffer), source=source), source)

    def allreduce(self, array: Array, devices: tuple[int, ...]) -> _MpiReduce:
        return self._ring((array,), devices)

    def allreduce_all(self, arrays: Sequence[Array], devices: tuple[int, ...]) -> _MpiReduce:
        return self._ring(arrays, devices)

    def reduce_scatter(
        self, array: Array, devices: tuple[int, ...], chunks: tuple[Interval, ...]
    ) -> _MpiReduce:
        return self._ring((array,), devices, chunks, reduce_scatter_steps)

    def reduce_scatter_all(
        self,
        arrays: Sequence[Array],
        devices: tuple[int, ...],
        runs: Sequence[tuple[Interval, ...]],
    ) -> _MpiReduce:
        """One ring over the arrays' runs laid out shard-major (``shard_major``), so
        that each member's runs of every array are one chunk; the runs are views, so
        the sums land in the arrays (staged: copied back whole by ``wait``)."""
        pieces, chunks = shard_major(runs)
        flats = [a.reshape(-1) for a in arrays]
        views = [flats[a][lo:hi] for a, (lo, hi) in pieces]
        return self._ring(views, devices, chunks, reduce_scatter_steps)

    def all_gather(
        self, array: Array, devices: tuple[int, ...], chunks: tuple[Interval, ...]
    ) -> _MpiReduce:
        return self._ring((array,), devices, chunks, all_gather_steps)

    def _ring(
        self, arrays: Sequence[Array], devices: tuple[int, ...], chunks=None, steps=ring_steps
    ):
        """Start a ring over the arrays' concatenation on ``devices``' communicator
        (staged: on host copies, copied back whole by ``wait``)."""
        xp = self.device.xp if self._direct_device else np
        flat = _Runs([self._host(a) for a in arrays], xp)
        two_level = None
        if steps is ring_steps and takes_two_levels(flat.size * flat.itemsize):
            two_level = self._host_comms.get(devices)
        if two_level is not None:
            ring: _Ring | _Chain = self._two_level(two_level, flat)
        else:
            bell = self._group_bells.get(devices)
            comm = self._groups[devices]
            ring = _Ring(comm, flat, self._counter, self.device, bell, chunks, steps)
        self._rings.start(devices, ring)
        return _MpiReduce(ring, tuple(arrays) if self.staged else ())

    def _two_level(self, c: _HostComms, flat: _Runs) -> _Chain:
        """The all-reduce's three phases on this rank (``soap/collectives.py``)."""
        _, j = c.rings.place(self.rank)
        inside = c.rings.host_chunks(flat.size)
        across = c.rings.cross_chunks(flat.size, j)

        def ring(comm, bell, chunks, steps) -> _Ring:
            return _Ring(comm, flat, self._counter, self.device, bell, chunks, steps)

        return _Chain(
            (
                ring(c.host, c.host_bell, inside, reduce_scatter_steps),
                ring(c.across, c.across_bell, across, ring_steps),
                ring(c.host, c.host_bell, inside, all_gather_steps),
            ),
            flat,
        )

    def let_go(self) -> None:
        self._sends.retire()

    def wait(self, pending: _MpiReceive | _MpiReduce) -> None:
        if isinstance(pending, _MpiReceive):
            self._wait_request(pending.request)
            if self.bell is not None:  # the sender may wait for its send to complete
                self.bell.ring(pending.source)
            if pending.host is not None:
                self.device.to_device(pending.host, out=pending.target)
        else:
            wait_patiently(
                lambda: pending.ring.done, self._rings.progress, self.nap, bell=self.bell
            )
            for host, target in zip(pending.ring.flat.parts, pending.targets, strict=False):
                self.device.to_device(host.reshape(target.shape), target)
        # MPI moved this rank's sends on while it waited: the peer it waited for has
        # most often taken what this rank sent it
        self._sends.retire()

    def _wait_request(self, request: MPI.Request) -> None:
        # Rings move on while this rank waits: a peer may be waiting for our chunk.
        wait_patiently(request.Test, self._rings.progress, self.nap, bell=self.bell)

    def end_step(self) -> None:
        wait_patiently(
            lambda: not self._rings.busy(), self._rings.progress, self.nap, bell=self.bell
        )
        sends = self._sends.requests()
        wait_patiently(lambda: MPI.Request.Testall(sends), nap=self.nap, bell=self.bell)
        self._sends.clear()
        self._pool.release()

    def close(self) -> None:
        # MPI has a few thousand communicator contexts a process: a process that trains
        # plan after plan (benchmarks/interleave.py, the probes) made a set each run.
        for sub in self._groups.values():
            sub.Free()
        for c in self._host_comms.values():
            c.host.Free()
            c.across.Free()
        self._host_comms.clear()
        self._groups.clear()
        self._group_bells.clear()
        self._made.clear()


class _HostPool:
    """Page-locked host buffers by (shape, dtype), taken during a step and all released
    at its end: the first step makes them, later steps reuse them."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.free: dict[tuple, list[np.ndarray]] = {}
        self.used: list[tuple[tuple, np.ndarray]] = []

    def take(self, shape, dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        stack = self.free.get(key)
        buf = stack.pop() if stack else self.device.host_empty(shape, dtype)
        self.used.append((key, buf))
        return buf

    def release(self) -> None:
        for key, buf in self.used:
            self.free.setdefault(key, []).append(buf)
        self.used.clear()

    @property
    def made(self) -> int:
        return sum(len(v) for v in self.free.values()) + len(self.used)


def mpi_cuda_aware() -> bool:
    """Whether the loaded MPI library says it takes CUDA device memory (Open MPI's
    ``MPIX_Query_cuda_support``, MPICH's ``MPIX_GPU_query_support``)."""
    import ctypes

    libraries = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libmpi" in path and ".so" in path:
                libraries.add(path)
    for path in sorted(libraries):
        lib = ctypes.CDLL(path)
        if hasattr(lib, "MPIX_Query_cuda_support"):
            return bool(lib.MPIX_Query_cuda_support())
        if hasattr(lib, "MPIX_GPU_query_support"):
            supported = ctypes.c_int(0)
            cuda = 0  # MPIX_GPU_SUPPORT_CUDA (mpix.h: CUDA 0, ZE 1, HIP 2)
            lib.MPIX_GPU_query_support(cuda, ctypes.byref(supported))
            return bool(supported.value)
    return False


def hosts_of(comm: MPI.Comm, ranks_per_host: int = 0) -> tuple[int, ...]:
    """Each rank's host, numbered by its first rank: the ranks that share memory (MPI's
    ``COMM_TYPE_SHARED``), or, given ``ranks_per_host``, every so many consecutive
    ranks (the two-level all-reduce tried on one host)."""
    if ranks_per_host:
        return tuple(r - r % ranks_per_host for r in range(comm.Get_size()))
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    first = shared.allreduce(comm.Get_rank(), op=MPI.MIN)
    shared.Free()
    return tuple(comm.allgather(first))


def make_transport(
    kind: TransportKind,
    comm: MPI.Comm,
    device: Device,
    nap: bool,
    bell: Doorbell | None,
    ranks_per_host: int = 0,
) -> Transport:
    """``auto``: NCCL when every rank has a GPU of its own, host staging when ranks
    share one, plain MPI on CPU ranks. ``nap``: ranks outnumber the cores
    (``oversubscribed``), and MPI transports' waits nap, or sleep on ``bell``
    (``Doorbell.open``). MPI transports learn the ranks' hosts (``hosts_of``) for the
    two-level all-reduce; NCCL chooses its own forms."""
    from executor.device import gpus_per_rank_ok
    from onnx2soap.errors import UserError

    on_gpu = device.kind is DeviceKind.CUDA
    if kind is TransportKind.AUTO:
        if not on_gpu:
            kind = TransportKind.MPI
        else:
            kind = TransportKind.NCCL if gpus_per_rank_ok(comm, device) else TransportKind.MPI_HOST
    if kind is TransportKind.NCCL:
        if not on_gpu:
            raise UserError("--transport nccl needs --device cuda")
        if not gpus_per_rank_ok(comm, device):
            raise UserError(
                "--transport nccl: two ranks share a GPU, which NCCL refuses; use "
                "--transport mpi-host or one rank per GPU"
            )
        from executor.nccl import NcclTransport

        return NcclTransport(comm, device)
    hosts = hosts_of(comm, ranks_per_host)
    if kind is TransportKind.MPI_CUDA:
        if not on_gpu:
            raise UserError("--transport mpi-cuda needs --device cuda")
        if not mpi_cuda_aware():
            raise UserError(
                f"--transport mpi-cuda: this MPI ({MPI.Get_library_version().split()[0]}) "
                "does not report CUDA support; use --transport mpi-host or nccl"
            )
        return MpiTransport(comm, device, nap=nap, bell=bell, hosts=hosts)
    if kind is TransportKind.MPI and on_gpu:
        raise UserError(
            "--transport mpi moves host arrays; on --device cuda use mpi-host, mpi-cuda or nccl"
        )
    staged = kind is TransportKind.MPI_HOST
    return MpiTransport(comm, device, staged=staged, nap=nap, bell=bell, hosts=hosts)
