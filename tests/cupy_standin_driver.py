"""NCCL through the cupy stand-in on two ranks, one case per run:

    PYTHONPATH=tests/standins mpiexec -n 2 python tests/cupy_standin_driver.py CASE FOLDER

- ``exchange``: a send/receive each way and an all-reduce; the receive lands only once
  its event is waited for;
- ``crossed``: both ranks send first, then receive: NCCL hangs, the stand-in says so;
- ``same-gpu``: both ranks on one GPU: the communicator is refused;
- ``freed``: a send whose array is dropped before its stream runs it is refused.

Each rank writes what it saw to FOLDER/rank-R.json. A rank that hits the expected error
writes it and leaves at once (``os._exit``): its unmatched calls would hold MPI's
finalization.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import cupy as cp
from cupy.cuda import nccl
from mpi4py import MPI

world = MPI.COMM_WORLD
rank = world.Get_rank()
case, folder = sys.argv[1], Path(sys.argv[2])


def write(doc: dict) -> None:
    (folder / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, **doc}))


def communicator() -> nccl.NcclCommunicator:
    count = cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(rank % count).use()
    uid = world.bcast(nccl.get_unique_id() if rank == 0 else None, root=0)
    return nccl.NcclCommunicator(world.Get_size(), uid, rank)


def leave(error: Exception) -> None:
    write({"error": f"{type(error).__name__}: {error}"})
    os._exit(3)


try:
    comm = communicator()
except Exception as e:  # the case's expected refusal, printed for the test to read
    leave(e)
stream = cp.cuda.Stream(non_blocking=True)
peer = 1 - rank
if case == "exchange":
    mine = cp.arange(4, dtype=cp.float64) + 10 * rank
    theirs = cp.zeros(4, dtype=cp.float64)
    summed = cp.full(3, rank + 1.0)
    for first in (0, 1):  # rank 0 sends first, then rank 1: one order on both ends
        if rank == first:
            comm.send(mine.data.ptr, mine.size, nccl.NCCL_FLOAT64, peer, stream.ptr)
        else:
            comm.recv(theirs.data.ptr, theirs.size, nccl.NCCL_FLOAT64, peer, stream.ptr)
    received = stream.record()
    before = cp.asnumpy(theirs).tolist()  # on the default stream: the receive has not run
    cp.cuda.get_current_stream().wait_event(received)
    after = cp.asnumpy(theirs).tolist()
    comm.allReduce(
        summed.data.ptr, summed.data.ptr, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, stream.ptr
    )
    stream.synchronize()
    write({"before": before, "after": after, "summed": cp.asnumpy(summed).tolist()})
elif case == "crossed":
    mine, theirs = cp.ones(1 << 16), cp.zeros(1 << 16)
    comm.send(mine.data.ptr, mine.size, nccl.NCCL_FLOAT64, peer, stream.ptr)
    comm.recv(theirs.data.ptr, theirs.size, nccl.NCCL_FLOAT64, peer, stream.ptr)
    try:
        stream.synchronize()
    except RuntimeError as e:
        leave(e)
elif case == "freed":
    if rank == 0:
        gone = cp.ones(8)
        comm.send(gone.data.ptr, gone.size, nccl.NCCL_FLOAT64, peer, stream.ptr)
        del gone
        try:
            stream.synchronize()
        except nccl.NcclError as e:
            leave(e)
    else:
        world.Barrier()  # rank 0 leaves before it: nothing to receive
