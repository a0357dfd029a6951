"""cupy.cuda.nccl over mpi4py: communicators of ranks, one GPU each, that send, receive
and all-reduce device memory given by raw pointers on a stream.

As NCCL: a communicator is made by every member at once from one unique id
(``get_unique_id``, 128 bytes, passed around by the program); two members on one GPU of
one host are refused ("Duplicate GPU"); every call is queued on its stream and runs in
the stream's order (``stream.py``); a send does not finish before its receive has
started (MPI's synchronous send), so ranks whose streams wait on each other hang as they
would on NCCL, and the stand-in says so. ``groupStart``/``groupEnd`` start the calls
between them together. Pointers must lie inside live arrays of the communicator's GPU;
an array freed while its call is still queued is refused when the call runs.

The members find each other through files named by the unique id in the temporary
folder (NCCL uses a socket), then make an MPI communicator of their world ranks, ordered
by NCCL rank, with ``MPI_Comm_create_group`` (collective over the members only, as
``ncclCommInitRank`` is).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from pathlib import Path

import numpy as np
from mpi4py import MPI

from cupy import _devices, _memory
from cupy.cuda import stream as _stream

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_UNIQUE_ID_BYTES = 128
available = True

_DTYPES = {
    NCCL_INT8: np.int8,
    NCCL_UINT8: np.uint8,
    NCCL_INT32: np.int32,
    NCCL_UINT32: np.uint32,
    NCCL_INT64: np.int64,
    NCCL_UINT64: np.uint64,
    NCCL_FLOAT16: np.float16,
    NCCL_FLOAT32: np.float32,
    NCCL_FLOAT64: np.float64,
}
_OPS = {NCCL_SUM: MPI.SUM, NCCL_PROD: MPI.PROD, NCCL_MAX: MPI.MAX, NCCL_MIN: MPI.MIN}
# ncclResult_t (NCCL >= 2.?): the codes the stand-in raises
_ERRORS = {
    3: ("NCCL_ERROR_INTERNAL_ERROR", "internal error"),
    4: ("NCCL_ERROR_INVALID_ARGUMENT", "invalid argument"),
    5: ("NCCL_ERROR_INVALID_USAGE", "invalid usage"),
}
INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE = 3, 4, 5


class NcclError(RuntimeError):
    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        name, text = _ERRORS[status]
        super().__init__(f"{name}: {text}" + (f" ({detail})" if detail else ""))


def get_version() -> int:
    return 22300  # NCCL 2.23.0


def get_build_version() -> int:
    return get_version()


def get_unique_id() -> bytes:
    return os.urandom(NCCL_UNIQUE_ID_BYTES)


class _Group(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.calls: list[tuple[_stream._Queue, _Call]] = []


_group = _Group()


def groupStart() -> None:
    _group.depth += 1


def groupEnd() -> None:
    if _group.depth == 0:
        raise NcclError(INVALID_USAGE, "groupEnd without groupStart")
    _group.depth -= 1
    if _group.depth:
        return
    calls, _group.calls = _group.calls, []
    by_queue: dict[int, tuple[_stream._Queue, list[_Call]]] = {}
    for queue, call in calls:
        by_queue.setdefault(id(queue), (queue, []))[1].append(call)
    for queue, members in by_queue.values():
        queue.push(_Together(members))


class _Call:
    """One queued NCCL call on device memory."""

    def __init__(self, what: str, post, buffers: list[tuple[weakref.ref, np.ndarray]]) -> None:
        self.what, self.post, self.buffers = what, post, buffers
        self.request: MPI.Request | None = None

    def _check_alive(self) -> None:
        for alive, _ in self.buffers:
            if alive() is None:
                raise NcclError(
                    INVALID_USAGE,
                    f"{self.what}: its device array was freed while the call was queued; on "
                    "a GPU the pool would have handed its memory to the next kernel",
                )

    def start(self) -> None:
        self._check_alive()
        self.request = self.post()

    def test(self) -> bool:
        assert self.request is not None
        if not self.request.Test():
            return False
        self._check_alive()
        return True

    def describe(self) -> str:
        return self.what


class _Together:
    """The calls of one group on one stream: started at once, done when all are."""

    def __init__(self, calls: list[_Call]) -> None:
        self.calls = calls

    def start(self) -> None:
        for call in self.calls:
            call.start()

    def test(self) -> bool:
        return all([call.test() for call in self.calls])

    def describe(self) -> str:
        return "group(" + ", ".join(c.what for c in self.calls) + ")"


def _rendezvous(uid: bytes, ndev: int, rank: int, device: int) -> MPI.Comm:
    """The members' world ranks in NCCL rank order, as an MPI communicator."""
    world = MPI.COMM_WORLD
    folder = Path(tempfile.gettempdir()) / "cupy-standin-nccl" / uid[:16].hex()
    folder.mkdir(parents=True, exist_ok=True)
    me = {"world": world.Get_rank(), "host": socket.gethostname(), "device": device}
    scratch = folder / f".{rank}.{os.getpid()}"
    scratch.write_text(json.dumps(me))
    scratch.replace(folder / str(rank))
    deadline = time.monotonic() + _stream._stall_s()
    while len([p for p in folder.iterdir() if not p.name.startswith(".")]) < ndev:
        if time.monotonic() > deadline:
            raise NcclError(INTERNAL_ERROR, f"rank {rank} of {ndev}: the others never came")
        time.sleep(1e-3)
    members = [json.loads((folder / str(r)).read_text()) for r in range(ndev)]
    places = [(m["host"], m["device"]) for m in members]
    for r, place in enumerate(places):
        first = places.index(place)
        if first != r:
            raise NcclError(
                INVALID_USAGE,
                f"Duplicate GPU detected : rank {first} and rank {r} both on CUDA device "
                f"{place[1]} of {place[0]}",
            )
    group = world.Get_group().Incl([m["world"] for m in members])
    comm = world.Create_group(group, tag=int.from_bytes(uid[:2], "little") % 30000)
    group.Free()
    comm.Barrier()  # every member has read the folder
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return comm


class NcclCommunicator:
    """A rank's handle of one NCCL communicator, on the GPU current when made."""

    def __init__(self, ndev: int, commId: bytes, rank: int, config=None) -> None:
        if not isinstance(commId, bytes):
            raise TypeError(
                "Argument 'commId' has incorrect type (expected bytes, got "
                f"{type(commId).__name__})"
            )
        if len(commId) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"commId length {len(commId)} != {NCCL_UNIQUE_ID_BYTES}.")
        if not 0 <= rank < ndev:
            raise NcclError(INVALID_ARGUMENT, f"rank {rank} of {ndev}")
        self._device = _devices.get_device()
        self._ndev, self._rank = ndev, rank
        self._comm: MPI.Comm | None = _rendezvous(commId, ndev, rank, self._device)

    def device_id(self) -> int:
        return self._device

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._ndev

    def destroy(self) -> None:
        self._comm = None

    def abort(self) -> None:
        self._comm = None

    def _live(self) -> MPI.Comm:
        if self._comm is None:
            raise NcclError(INVALID_ARGUMENT, "the communicator was destroyed")
        return self._comm

    def _memory(self, ptr: int, count: int, datatype: int) -> tuple[weakref.ref, np.ndarray]:
        """The device bytes at ``ptr`` as a numpy array of ``count`` elements."""
        if datatype not in _DTYPES:
            raise NcclError(INVALID_ARGUMENT, f"datatype {datatype}")
        dtype = np.dtype(_DTYPES[datatype])
        nbytes = count * dtype.itemsize
        found = _memory.registry().containing(ptr, nbytes)
        if found is None:
            raise _devices.CUDARuntimeError(_devices.ILLEGAL_ADDRESS)
        if found.device != self._device:
            raise NcclError(
                INVALID_ARGUMENT,
                f"a pointer into GPU {found.device} for a communicator of GPU {self._device}",
            )
        raw = (ctypes.c_char * max(nbytes, 1)).from_address(ptr)
        view = np.frombuffer(raw, dtype=dtype, count=count)
        return weakref.ref(found), view

    def _queue(self, stream: int, call: _Call) -> None:
        queue = _stream.queue_of(stream, self._device)
        if _group.depth:
            _group.calls.append((queue, call))
        else:
            queue.push(call)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        comm, (alive, view) = self._live(), self._memory(sendbuf, count, datatype)
        self._check_peer(peer)
        what = f"send of {count} to rank {peer}"
        owner = alive().owner  # type: ignore[union-attr]
        self._queue(stream, _Call(what, lambda: comm.Issend(view, dest=peer), [(alive, owner)]))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        comm, (alive, view) = self._live(), self._memory(recvbuf, count, datatype)
        self._check_peer(peer)
        what = f"receive of {count} from rank {peer}"
        owner = alive().owner  # type: ignore[union-attr]
        self._queue(stream, _Call(what, lambda: comm.Irecv(view, source=peer), [(alive, owner)]))

    def allReduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int
    ) -> None:
        comm = self._live()
        if op not in _OPS and op != NCCL_AVG:
            raise NcclError(INVALID_ARGUMENT, f"reduction {op}")
        alive_in, source = self._memory(sendbuf, count, datatype)
        alive_out, target = self._memory(recvbuf, count, datatype)
        buffers = [(alive_in, alive_in().owner), (alive_out, alive_out().owner)]  # type: ignore[union-attr]

        def post() -> MPI.Request:
            payload = MPI.IN_PLACE if sendbuf == recvbuf else source
            return _Averaged(
                comm.Iallreduce(payload, target, op=_OPS.get(op, MPI.SUM)),
                target,
                self._ndev if op == NCCL_AVG else 1,
            )

        self._queue(stream, _Call(f"all-reduce of {count}", post, buffers))

    def reduce(
        self,
        sendbuf: int,
        recvbuf: int,
        count: int,
        datatype: int,
        op: int,
        root: int,
        stream: int,
    ) -> None:
        """ncclReduce: the sum (or ``op``) of every member's ``sendbuf`` lands in the
        root's ``recvbuf`` only (in place where the root passes one pointer twice); the
        other members' ``recvbuf`` is not touched."""
        comm = self._live()
        if op not in _OPS:
            raise NcclError(INVALID_ARGUMENT, f"reduction {op}")
        self._check_peer(root)
        alive_in, source = self._memory(sendbuf, count, datatype)
        buffers = [(alive_in, alive_in().owner)]  # type: ignore[union-attr]
        target = None
        if self._rank == root:
            alive_out, target = self._memory(recvbuf, count, datatype)
            buffers.append((alive_out, alive_out().owner))  # type: ignore[union-attr]

        def post() -> MPI.Request:
            if self._rank != root:
                return comm.Ireduce(source, None, op=_OPS[op], root=root)
            payload = MPI.IN_PLACE if sendbuf == recvbuf else source
            return comm.Ireduce(payload, target, op=_OPS[op], root=root)

        self._queue(stream, _Call(f"reduce of {count} to rank {root}", post, buffers))

    def broadcast(
        self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int
    ) -> None:
        """ncclBroadcast: the root's ``sendbuff`` lands in every member's ``recvbuff``
        (the root's too; in place where it passes one pointer twice)."""
        comm = self._live()
        self._check_peer(root)
        alive_out, target = self._memory(recvbuff, count, datatype)
        buffers = [(alive_out, alive_out().owner)]  # type: ignore[union-attr]
        source = target
        if self._rank == root and sendbuff != recvbuff:
            alive_in, source = self._memory(sendbuff, count, datatype)
            buffers.append((alive_in, alive_in().owner))  # type: ignore[union-attr]

        def post() -> MPI.Request:
            if source is not target:
                target[...] = source
            return comm.Ibcast(target, root=root)

        self._queue(stream, _Call(f"broadcast of {count} from rank {root}", post, buffers))

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self._ndev:
            raise NcclError(INVALID_ARGUMENT, f"peer {peer} of {self._ndev}")


class _Averaged:
    """An all-reduce request; NCCL_AVG divides the sum once it has landed."""

    def __init__(self, request: MPI.Request, target: np.ndarray, divisor: int) -> None:
        self.request, self.target, self.divisor = request, target, divisor

    def Test(self) -> bool:
        if not self.request.Test():
            return False
        if self.divisor != 1:
            self.target /= self.divisor
            self.divisor = 1
        return True
