import os

# One BLAS thread per rank unless the user says otherwise: ranks already fill the cores,
# and spinning BLAS threads of co-located ranks slow every step down many times over.
# This must happen before numpy is imported.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from executor.cli import main  # noqa: E402

raise SystemExit(main())
