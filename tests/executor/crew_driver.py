"""Drive executor/crew.py's protocol on 3 ranks, rank 1 without work, and write what each
rank saw to DIR/rank-R.json: ``mpiexec -n 3 python crew_driver.py DIR`` (run by
tests/executor/test_idle_ranks.py)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from mpi4py import MPI

from executor.crew import Crew, Note
from executor.transport import wait_patiently

world = MPI.COMM_WORLD
rank = world.Get_rank()
crew = Crew.form(world, working=rank != 1)
seen: dict = {"rank": rank, "working": crew.working, "leader": crew.leader, "idle": crew.idle}
if crew.working:
    seen["steppers"] = crew.steppers.Get_size()
    seen["sum"] = crew.steppers.allreduce(rank)  # the working ranks' collective alone
    for step in range(3):
        crew.tell(Note(record={"step": step}))
    if rank == crew.leader:  # the pleas go to the leader alone
        got: list[int] = []
        wait_patiently(lambda: got.append(crew.pleaded()) or got[-1] != 0)
        seen["pleaded"] = got[-1]
    crew.tell(Note(interrupted=seen.get("pleaded", 0)))  # the leader's; others send none
else:
    seen["heard"] = [crew.hear(None).record for _ in range(2)]
    # a signal while waiting for the third note is passed on to the leader
    seen["heard"].append(crew.hear(lambda: signal.SIGTERM).record)
    seen["stopped"] = crew.hear(None).interrupted
crew.close()
(Path(sys.argv[1]) / f"rank-{rank}.json").write_text(json.dumps(seen))
