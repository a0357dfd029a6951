"""Run the executor, recording per step what MpiTransport still holds of the step's sends
as the step ends (before ``end_step`` waits for them) and what it sent, to
$SENDS_DRIVER_OUT/rank-R.json: ``mpiexec -n N python sends_driver.py run PLAN ...`` (run
by tests/executor/test_sends_let_go.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mpi4py import MPI

from executor.cli import main
from executor.transport import MpiTransport

steps: list[dict[str, int]] = []
_send, _end_step = MpiTransport.send, MpiTransport.end_step


def _step() -> dict[str, int]:
    if not steps or "held" in steps[-1]:
        steps.append({"sent": 0, "largest": 0})
    return steps[-1]


def send(self: MpiTransport, array, dest: int) -> None:
    step = _step()
    step["sent"] += array.nbytes
    step["largest"] = max(step["largest"], array.nbytes)
    _send(self, array, dest)


def held(transport: MpiTransport) -> int:
    """The bytes of the arrays the transport holds for its sends, whole where it holds a
    view (a list of (request, payload, array) before sends were let go as they
    completed)."""
    sends = transport._sends
    if isinstance(sends, list):
        arrays = [array for _, _, array in sends]
    else:
        arrays = [sent.array for queue in sends.queues.values() for sent in queue]
    return sum(_whole(a).nbytes for a in {id(_whole(a)): a for a in arrays}.values())


def _whole(array):
    return array if array.base is None else array.base


def end_step(self: MpiTransport) -> None:
    _step()["held"] = held(self)
    _end_step(self)


MpiTransport.send, MpiTransport.end_step = send, end_step
code = main()
out = Path(os.environ["SENDS_DRIVER_OUT"]) / f"rank-{MPI.COMM_WORLD.Get_rank()}.json"
out.write_text(json.dumps(steps))
raise SystemExit(code)
