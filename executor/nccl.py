"""The ``nccl`` transport: tiles and all-reduces on the GPU's communication stream.

Every send, receive and all-reduce of a rank is issued on one communication stream in
program order, so each stream runs a subsequence of the global order; NCCL matches a
pair's point-to-point calls by their order, which the program makes the same on both
ends (a transfer's ``Recv`` sits at its ``Send``'s place). The earliest unfinished call
then always has both ends at the head of their streams, so the streams cannot deadlock.

The host waits for nothing inside a step but the loss at its end: a send waits (on the
GPU) for an event recorded on the compute stream after its producer; a consumer's
kernels wait for the event recorded after its receive; a weight group's all-reduce runs
while the compute stream goes on with the backward pass. cupy's memory pool would hand
a freed array to the next kernel while NCCL still reads it, so the transport keeps what
NCCL reads referenced: a sent array until the event recorded after its send on the
communication stream has completed (found at a later call into the transport, as
PyTorch's caching allocator frees a buffer once the streams that used it are past it);
an all-reduced one until the step after its own has ended.

NCCL refuses two ranks on one GPU: ``--transport auto`` picks ``mpi-host`` there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from mpi4py import MPI

from executor.device import CudaDevice
from onnx2soap.soap.collectives import (
    all_gather_steps,
    chunks_bytes_sent,
    reduce_scatter_steps,
    ring_chunks,
    ring_steps,
)
from onnx2soap.soap.partition import Interval


def ring_bytes(size: int, itemsize: int, members: int, member: int) -> int:
    """What ``member`` sends in a ring all-reduce of ``size`` elements: the figure the
    simulator predicts (NCCL's ring moves chunks of the same sizes)."""
    chunks = ring_chunks(size, members)
    total = 0
    for step in ring_steps(member, members):
        lo, hi = chunks[step.send_chunk]
        total += (hi - lo) * itemsize
    return total


class NcclTransport:
    def __init__(self, comm: MPI.Comm, device: CudaDevice) -> None:
        from cupy.cuda import nccl

        self.nccl, self.comm, self.device = nccl, comm, device
        self.rank = comm.Get_rank()
        self.bytes_sent = 0
        self.world = self._communicator(comm)
        self._groups: dict[tuple[int, ...], Any] = {}
        self._made: set[tuple[int, ...]] = set()
        self._held: list[Any] = []  # arrays of this step's collectives
        self._retired: list[Any] = []  # last step's, freed once that step has synchronized
        # sent arrays, oldest first, with the event recorded after each send on the
        # communication stream: NCCL has read one once its event has completed
        self._sending: deque[tuple[Any, Any]] = deque()
        self._types = {
            "float32": nccl.NCCL_FLOAT32,
            "float64": nccl.NCCL_FLOAT64,
            "int64": nccl.NCCL_INT64,
            # mixed precision's stored tiles and pieces (only sent, never summed): float16,
            # and bfloat16 kept as its bits in uint16 (CuPy has no bfloat16)
            "float16": nccl.NCCL_FLOAT16,
            "uint16": nccl.NCCL_FLOAT16,
        }

    def _communicator(self, comm: MPI.Comm):
        uid = self.nccl.get_unique_id() if comm.Get_rank() == 0 else None
        uid = comm.bcast(uid, root=0)
        return self.nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())

    def make_groups(self, device_sets: Iterable[tuple[int, ...]]) -> None:
        # Sorted on every rank, so the members of each set create it in the same order;
        # every rank skips the same sets (made by an earlier call).
        for devices in sorted(set(device_sets) - self._made):
            self._made.add(devices)
            color = 0 if self.rank in devices else MPI.UNDEFINED
            sub = self.comm.Split(color, key=self.rank)
            if sub != MPI.COMM_NULL:
                self._groups[devices] = self._communicator(sub)
                sub.Free()

    def _type(self, array) -> int:
        return self._types[array.dtype.name]

    def send(self, array, dest: int) -> None:
        self.let_go()
        stream = self.device.comm_stream()
        self.device.wait_event(self.device.record(), stream)
        self.world.send(array.data.ptr, array.size, self._type(array), dest, stream.ptr)
        self._sending.append((self.device.record(stream), array))
        self.bytes_sent += array.nbytes

    def let_go(self) -> None:
        """Let go of the sent arrays NCCL is done with. One stream runs the sends in
        order, so their events complete in order: the first not done ends the search."""
        while self._sending and self._sending[0][0].done:
            self._sending.popleft()

    def recv(self, buffer, source: int):
        self.let_go()
        stream = self.device.comm_stream()
        # The step makes each receive buffer when it posts the receive (executor/step.py),
        # from the compute stream's pool: memory kernels issued before may still read.
        self.device.wait_event(self.device.record(), stream)
        self.world.recv(buffer.data.ptr, buffer.size, self._type(buffer), source, stream.ptr)
        return self.device.record(stream)

    def allreduce(self, array, devices: tuple[int, ...]):
        stream = self.device.comm_stream()
        self.device.wait_event(self.device.record(), stream)
        ptr, count = array.data.ptr, array.size
        self._groups[devices].allReduce(
            ptr, ptr, count, self._type(array), self.nccl.NCCL_SUM, stream.ptr
        )
        self._held.append(array)
        self.bytes_sent += ring_bytes(count, array.itemsize, len(devices), devices.index(self.rank))
        return self.device.record(stream)

    def allreduce_all(self, arrays: Sequence, devices: tuple[int, ...]):
        """A gradient bucket (soap/buckets.py): one ncclAllReduce per array, in place, all
        in one NCCL group, which NCCL launches as one collective; it sends what the ring
        of their concatenation sends (the simulator's count)."""
        stream = self.device.comm_stream()
        self.device.wait_event(self.device.record(), stream)
        comm, kind = self._groups[devices], self._type(arrays[0])
        self.nccl.groupStart()
        for array in arrays:
            ptr = array.data.ptr
            comm.allReduce(ptr, ptr, array.size, kind, self.nccl.NCCL_SUM, stream.ptr)
        self.nccl.groupEnd()
        self._held.extend(arrays)
        count, member = sum(a.size for a in arrays), devices.index(self.rank)
        self.bytes_sent += ring_bytes(count, arrays[0].itemsize, len(devices), member)
        return self.device.record(stream)

    def reduce_scatter(self, array, devices: tuple[int, ...], chunks: tuple[Interval, ...]):
        """ZeRO's uneven reduce-scatter: ncclReduceScatter takes equal counts only, so
        one ncclReduce per shard, rooted at its owner, all in one NCCL group (NCCL runs
        them together; each member sends about what a ring's half sends)."""

        def reduce(comm, ptr, count, kind, root, stream) -> None:
            comm.reduce(ptr, ptr, count, kind, self.nccl.NCCL_SUM, root, stream.ptr)

        stream = self._per_shard(array, devices, chunks, reduce)
        # Not held to the next step: the step keeps the gradient until it has waited for
        # this event and then (ZeRO-2) drops it for a copy of its rows; the compute
        # stream's later kernels, which may reuse its memory, run after the reduces.
        return self._started(array, devices, chunks, reduce_scatter_steps, stream, hold=False)

    def reduce_scatter_all(self, arrays: Sequence, devices: tuple[int, ...], runs):
        """A gradient bucket's sharded groups (soap/buckets.py): every array's reduces
        (one per shard, as ``reduce_scatter``) in one NCCL group, which NCCL launches as
        one collective."""
        stream = self.device.comm_stream()
        self.device.wait_event(self.device.record(), stream)
        comm, kind, total = self._groups[devices], self._type(arrays[0]), self.nccl.NCCL_SUM
        self.nccl.groupStart()
        for array, chunks in zip(arrays, runs, strict=True):
            for root, (lo, hi) in enumerate(chunks):
                ptr = array.data.ptr + lo * array.itemsize
                comm.reduce(ptr, ptr, hi - lo, kind, total, root, stream.ptr)
        self.nccl.groupEnd()
        member = devices.index(self.rank)
        for array, chunks in zip(arrays, runs, strict=True):
            steps = reduce_scatter_steps(member, len(devices))
            self.bytes_sent += chunks_bytes_sent(chunks, steps, array.itemsize)
        # Not held to the next step, as ``reduce_scatter``'s.
        return self.device.record(stream)

    def all_gather(self, array, devices: tuple[int, ...], chunks: tuple[Interval, ...]):
        """ZeRO's uneven all-gather: one ncclBroadcast per shard from its owner, in one
        NCCL group (ncclAllGather takes equal counts only)."""

        def broadcast(comm, ptr, count, kind, root, stream) -> None:
            comm.broadcast(ptr, ptr, count, kind, root, stream.ptr)

        stream = self._per_shard(array, devices, chunks, broadcast)
        # Not held to the next step: the step waits for this event before any kernel
        # reads the array (ZeRO-1/2: the weight, held anyway; ZeRO-3: a gathered weight
        # the step drops after its op's kernels, which the compute stream runs after).
        return self._started(array, devices, chunks, all_gather_steps, stream, hold=False)

    def _per_shard(self, array, devices, chunks, call):
        """``call`` once per shard (its run of ``array``, rooted at its owner), in one
        NCCL group on the communication stream, after the compute stream's work."""
        stream = self.device.comm_stream()
        self.device.wait_event(self.device.record(), stream)
        comm, kind, base = self._groups[devices], self._type(array), array.data.ptr
        self.nccl.groupStart()
        for root, (lo, hi) in enumerate(chunks):
            call(comm, base + lo * array.itemsize, hi - lo, kind, root, stream)
        self.nccl.groupEnd()
        return stream

    def _started(self, array, devices, chunks, steps, stream, hold: bool = True):
        if hold:
            self._held.append(array)
        member = devices.index(self.rank)
        self.bytes_sent += chunks_bytes_sent(chunks, steps(member, len(devices)), array.itemsize)
        return self.device.record(stream)

    def wait(self, event) -> None:
        self.device.wait_event(event)
        self.let_go()

    def end_step(self) -> None:
        """The compute stream waits for the step's communication (the update follows
        it); the host does not. The collectives' arrays stay referenced until the next
        step's end, after this step's closing synchronization; sends still in flight
        until a later call finds them done."""
        self.device.wait_event(self.device.record(self.device.comm_stream()))
        self._retired, self._held = self._held, []
        self.let_go()

    def close(self) -> None:
        """Destroy the NCCL communicators once the communication in flight is done."""
        self.device.synchronize()
        for comm in (*self._groups.values(), self.world):
            comm.destroy()
        self._groups.clear()
        self._made.clear()
        self._held, self._retired = [], []
        self._sending.clear()
