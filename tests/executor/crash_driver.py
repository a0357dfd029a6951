"""Run the executor with a kernel that raises on one rank (to test that all ranks abort).

mpiexec -n 2 python tests/executor/crash_driver.py run PLAN ...   (rank 1 fails)
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from mpi4py import MPI  # noqa: E402

from executor import kernels  # noqa: E402
from executor.cli import main  # noqa: E402
from onnx2soap.ir import OpType  # noqa: E402

FAILING_RANK = 1


class _Failing:
    def __init__(self, inner) -> None:
        self.inner = inner

    def forward(self, *args):
        raise RuntimeError("injected kernel failure")

    def backward(self, *args):
        return self.inner.backward(*args)


if __name__ == "__main__":
    if MPI.COMM_WORLD.Get_rank() == FAILING_RANK:
        kernels.KERNELS[OpType.RELU] = _Failing(kernels.KERNELS[OpType.RELU])
    raise SystemExit(main())
