"""Run the executor CLI and record, per rank, its pid at start and its exit code at the end.

mpiexec -n N python tests/hardening/exit_driver.py DIR run PLAN ...

Writes DIR/rank-R.pid when the rank starts and DIR/rank-R.rc when ``main`` returns, so a
test can signal one rank and check what every rank exited with. ``FAIL_ALL_RANKS=1`` makes
every rank's first training step raise at once (both ranks abort together).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from mpi4py import MPI  # noqa: E402

from executor.cli import main  # noqa: E402


def _fail_every_step() -> None:
    from executor import runtime

    def step(self, *args, **kwargs):
        raise RuntimeError("injected failure on every rank")

    runtime.Runtime.step = step


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    rank = MPI.COMM_WORLD.Get_rank()
    (folder / f"rank-{rank}.pid").write_text(str(os.getpid()))
    if os.environ.get("FAIL_ALL_RANKS") == "1":
        _fail_every_step()
    code = main(sys.argv[2:])
    (folder / f"rank-{rank}.rc").write_text(str(code))
    raise SystemExit(code)
