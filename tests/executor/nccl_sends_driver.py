"""NcclTransport on two ranks with a GPU each: each rank sends an array to the other and
receives the other's, and writes to DIR/rank-R.json whether the transport still holds
what it sent once the device is past the send, before the step ends:
``mpiexec -n 2 python nccl_sends_driver.py DIR`` (run by
tests/executor/test_sends_let_go.py)."""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import cupy as cp
from mpi4py import MPI

from executor.device import CudaDevice
from executor.nccl import NcclTransport

world = MPI.COMM_WORLD
rank = world.Get_rank()
device = CudaDevice(cp, rank % cp.cuda.runtime.getDeviceCount())
transport = NcclTransport(world, device)
seen: dict = {}
with device.compute():
    sent = cp.arange(1 << 16, dtype=cp.float32) + rank
    gone = weakref.ref(sent)
    got = cp.empty_like(sent)
    # one order on both ends: rank 0 sends first, rank 1 receives first
    for first in (0, 1):
        if rank == first:
            transport.send(sent, 1 - rank)
        else:
            pending = transport.recv(got, 1 - rank)
    del sent
    transport.wait(pending)
    seen["right"] = bool((got == cp.arange(1 << 16, dtype=cp.float32) + (1 - rank)).all())
    device.synchronize()  # the device is past the send: a call now finds it done
    transport.wait(pending)
    seen["held_in_the_step"] = gone() is not None
    transport.end_step()
transport.close()
(Path(sys.argv[1]) / f"rank-{rank}.json").write_text(json.dumps(seen))
