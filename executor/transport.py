"""Point-to-point and all-reduce over MPI buffers (never pickles), with byte counters."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from mpi4py import MPI

from onnx2soap.soap.collectives import ring_chunks, ring_steps


class Transport:
    """Wraps the world communicator. ``bytes_sent`` counts the payload this rank sends in
    training steps (tiles, gradient pieces, all-reduce chunks), the figure the simulator
    predicts."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.bytes_sent = 0
        self._tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767
        self._groups: dict[tuple[int, ...], MPI.Comm] = {}

    def make_groups(self, device_sets: Iterable[tuple[int, ...]]) -> None:
        """Create one sub-communicator per device set. Collective over the world: every
        rank must pass the same sets (it is called with sets derived from the plan)."""
        for devices in sorted(set(device_sets)):
            color = 0 if self.rank in devices else MPI.UNDEFINED
            sub = self.comm.Split(color, key=self.rank)
            if sub != MPI.COMM_NULL:
                self._groups[devices] = sub

    def isend(self, array: np.ndarray, dest: int, tag: int) -> MPI.Request:
        self.bytes_sent += array.nbytes
        return self.comm.Isend(array, dest=dest, tag=tag % self._tag_ub)

    def irecv(self, buffer: np.ndarray, source: int, tag: int) -> MPI.Request:
        return self.comm.Irecv(buffer, source=source, tag=tag % self._tag_ub)

    def allreduce_sum(self, array: np.ndarray, devices: tuple[int, ...]) -> None:
        """In-place ring all-reduce (sum) of a contiguous array over ``devices``."""
        sub = self._groups[devices]
        k, r = sub.Get_size(), sub.Get_rank()
        flat = array.reshape(-1)
        chunks = ring_chunks(flat.size, k)
        right, left = (r + 1) % k, (r - 1) % k
        scratch = np.empty(max(hi - lo for lo, hi in chunks), dtype=flat.dtype)
        for step in ring_steps(r, k):
            slo, shi = chunks[step.send_chunk]
            rlo, rhi = chunks[step.recv_chunk]
            incoming = scratch[: rhi - rlo]
            sub.Sendrecv(flat[slo:shi], dest=right, recvbuf=incoming, source=left)
            self.bytes_sent += (shi - slo) * flat.itemsize
            if step.reduce:
                flat[rlo:rhi] += incoming
            else:
                flat[rlo:rhi] = incoming
