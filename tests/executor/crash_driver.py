"""Run the executor with a kernel that raises on one rank (to test that all ranks abort).

mpiexec -n 2 python tests/executor/crash_driver.py run PLAN ...   (rank 1 fails)
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import dataclasses  # noqa: E402

from mpi4py import MPI  # noqa: E402

from executor import step  # noqa: E402
from executor.cli import main  # noqa: E402
from onnx2soap.ops import OpDef, definition  # noqa: E402

FAILING_RANK = 1


def _failing_forward(*args):
    raise RuntimeError("injected kernel failure")


def _definition_failing_relu(name: str) -> OpDef:
    """The runtime's lookup, with Relu's forward raising."""
    found = definition(name)
    return dataclasses.replace(found, forward=_failing_forward) if name == "Relu" else found


if __name__ == "__main__":
    if MPI.COMM_WORLD.Get_rank() == FAILING_RANK:
        step.definition = _definition_failing_relu
    raise SystemExit(main())
