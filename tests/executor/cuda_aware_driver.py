"""Run the executor as if the MPI library reported CUDA support: for the cupy stand-in
(tests/standins) only, whose device arrays are host memory that MPI can read through the
CUDA array interface, as a CUDA-aware MPI reads device memory.

PYTHONPATH=tests/standins mpiexec -n 2 python tests/executor/cuda_aware_driver.py run PLAN \
    --device cuda --transport mpi-cuda ...
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import cupy  # noqa: E402

from executor import transport  # noqa: E402
from executor.cli import main  # noqa: E402

if not cupy.__version__.endswith("+standin"):  # a real GPU's memory would crash this MPI
    raise SystemExit("cuda_aware_driver.py runs under the cupy stand-in only")
transport.mpi_cuda_aware = lambda: True

raise SystemExit(main())
