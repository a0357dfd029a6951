"""The executor on one device, in this process, on a data file: the reference the N-rank
runs are compared with (``tests/executor/mpi.reference`` trains on synthetic data)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from onnx2soap.ir import DType


def one_device(
    plan: Path, data: Path, steps: int, lr: float
) -> tuple[tuple[float, ...], dict[str, np.ndarray]]:
    """``steps`` float64 SGD steps of ``plan`` (one device) on ``data``: (losses, weights)."""
    from mpi4py import MPI

    from executor.kinds import DeviceKind
    from executor.train import RunOptions, train

    options = RunOptions(
        plan=plan, steps=steps, lr=lr, dtype=DType.FLOAT64, data=data, device=DeviceKind.CPU
    )
    result = train(MPI.COMM_SELF, options, gather=True)
    return tuple(r.loss for r in result.steps), result.weights
