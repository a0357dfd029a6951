"""Drive executor/doorbell.py on 3 ranks and write what each rank saw to DIR/rank-R.json:
``mpiexec -n 3 python doorbell_driver.py DIR`` (run by tests/executor/test_doorbell.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from executor.device import CpuDevice
from executor.doorbell import Doorbell
from executor.transport import MpiTransport

LONG_S = 5.0  # a sleep that only a ring ends early

world = MPI.COMM_WORLD
rank = world.Get_rank()
bell = Doorbell.open(world)
seen: dict = {"rank": rank, "flags": {str(r): int(f[0]) for r, f in bell.asleep.items()}}
world.Barrier()  # every rank has read the flags before any sleeps

# A ring wakes a rank that sleeps on its bell.
if rank == 0:
    while not bell.asleep[1][0]:
        time.sleep(1e-3)
    bell.ring(1)
elif rank == 1:
    start = time.perf_counter()
    seen["rung"] = bell.sleep(LONG_S, lambda: False)
    seen["woke_after_s"] = time.perf_counter() - start
world.Barrier()

# A rank awake is not rung: its next sleep finds no ring waiting.
if rank == 0:
    bell.ring(2)
world.Barrier()
if rank == 2:
    seen["rung_awake"] = bell.sleep(0.05, lambda: False)
    start = time.perf_counter()
    seen["ready_first"] = bell.sleep(LONG_S, lambda: True)  # ready once flagged: no sleep
    seen["ready_first_s"] = time.perf_counter() - start
world.Barrier()

# Messages and a ring all-reduce over ranks 0 and 2 (world rank 2 is the sub-ring's 1),
# every wait on the bell.
transport = MpiTransport(world, CpuDevice(), nap=True, bell=bell)
transport.make_groups([(0, 2)])
if rank == 0:
    time.sleep(0.2)  # rank 1 waits long enough to sleep on its bell
    transport.send(np.arange(6, dtype=np.float32), 1)
elif rank == 1:
    buffer = np.zeros(6, dtype=np.float32)
    transport.wait(transport.recv(buffer, 0))
    seen["received"] = buffer.tolist()
if rank in (0, 2):
    values = np.full(5, rank + 1.0, dtype=np.float32)
    transport.wait(transport.allreduce(values, (0, 2)))
    seen["summed"] = values.tolist()
transport.end_step()
bell.close()
(Path(sys.argv[1]) / f"rank-{rank}.json").write_text(json.dumps(seen))
