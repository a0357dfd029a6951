"""Doorbells: where ranks share cores, a waiting rank sleeps until a peer has news for it.

Where ranks outnumber the cores, a rank that waits for a message naps between tests of it
(``transport.wait_patiently``), and every nap costs a core: on a VM a 50 us nap costs
26-34 us of processor time, taken from the rank it waits for. Model parallelism on 4
ranks on 2 cores measured 1.4-1.7x the simulator's prediction, most of it the napping
ranks' processor time.

A doorbell is a datagram socket per rank (Linux's abstract namespace: no file, gone with
the process), named per run, and a flag per rank, in memory the node's ranks share, that
says whether the rank sleeps on its bell. A rank rings a peer on its node when it posts
a message to it, when it has received one from it (the sender may be waiting for its
send to complete) and when it joins the step's sum, if the peer's flag is up: a ring
costs its ringer a system call. A rank that has waited through a few naps
(``transport.NAPS_BEFORE_BELL``) sleeps on its bell (``select``) instead: it wakes a few
microseconds after a ring (a round trip takes 7 us on this VM) and costs nothing while
nothing happens. MPI's own progress (the rounds of a collective) rings no bell, so a
sleep on the bell still times out: after ``NAP_S`` first, twice as long after each
silent one, up to ``LONGEST_NAP_S``, and back to ``NAP_S`` after a ring. The messages
stay MPI's: a ring lost (a full socket buffer, a peer on another node) costs only time.
"""

from __future__ import annotations

import contextlib
import secrets
import select
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

_FLAG_BYTES = 64  # a cache line a rank: no two ranks' flags share one
LONGEST_NAP_S = 1e-3  # a silent wait's longest sleep: ~3 % of a core on a VM
_RING = b"\0"


@dataclass(frozen=True)
class Doorbell:
    """This rank's bell, the names of the bells of the ranks on its node, and whether
    each of them sleeps."""

    sock: socket.socket
    peers: dict[int, str]  # world rank on this node -> its bell's address
    asleep: dict[int, np.ndarray]  # world rank on this node (this one too) -> its flag
    window: MPI.Win
    rank: int

    @classmethod
    def open(cls, comm: MPI.Comm) -> Doorbell | None:
        """Collective over ``comm``: every rank's bell, or None on every rank where a
        platform has no abstract sockets (not Linux: the ranks nap as before)."""
        if not sys.platform.startswith("linux"):
            return None
        rank = comm.Get_rank()
        run = comm.bcast(secrets.token_hex(8) if rank == 0 else None, root=0)
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        try:
            neighbours = node.allgather(rank)
            window = MPI.Win.Allocate_shared(_FLAG_BYTES, 1, comm=node)
            asleep = {}
            for i, r in enumerate(neighbours):
                memory, _ = window.Shared_query(i)
                asleep[r] = np.frombuffer(memory, dtype=np.uint8, count=1)
            asleep[rank][0] = 0
        finally:
            node.Free()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(_address(run, rank))
        sock.setblocking(False)
        comm.Barrier()  # every bell exists before the first ring
        peers = {r: _address(run, r) for r in neighbours if r != rank}
        return cls(sock, peers, asleep, window, rank)

    def ring(self, rank: int) -> None:
        """Tell ``rank`` (world) that something it may wait for has moved, if it sleeps."""
        address = self.peers.get(rank)
        if address is None or not self.asleep[rank][0]:
            return
        # A full buffer (rings wait there already) or a bell closed: nothing to tell.
        with contextlib.suppress(OSError):
            self.sock.sendto(_RING, address)

    def sleep(self, seconds: float, ready: Callable[[], bool]) -> bool:
        """Sleep until a ring or ``seconds``, unless ``ready()`` once this rank says it
        sleeps (a peer that moved before then saw it awake and rang nothing); True if
        rung (every waiting ring is taken)."""
        flag = self.asleep[self.rank]
        flag[0] = 1
        try:
            if ready():
                return True
            readable, _, _ = select.select((self.sock,), (), (), seconds)
        finally:
            flag[0] = 0
        if not readable:
            return False
        with contextlib.suppress(BlockingIOError):  # take rings until none is left
            while True:
                self.sock.recv(64)
        return True

    def close(self) -> None:
        self.sock.close()
        self.window.Free()


@dataclass(frozen=True)
class GroupBell:
    """A doorbell rung at a communicator's members: its rank i is world rank
    ``members[i]``."""

    bell: Doorbell
    members: tuple[int, ...]

    def ring(self, member: int) -> None:
        self.bell.ring(self.members[member])

    def ring_all(self) -> None:
        for rank in self.members:
            self.bell.ring(rank)


def _address(run: str, rank: int) -> str:
    return f"\0onnx2soap-{run}-{rank}"
