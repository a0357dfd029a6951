"""Several training runs in one mpiexec, for the ZeRO tests: an interpreter's start and its
imports are most of a small run's time, so each job is the executor's ``train`` called
again in the same ranks (as benchmarks/interleave.py does).

    mpiexec -n N python tests/executor/zero_driver.py JOBS.json

JOBS.json is a list of ``Job``s (as ``write_jobs`` writes them); rank 0 writes each
job's losses, the bytes each rank sent and the gathered weights to its ``out`` .npz
(``losses``, ``sent``, and ``w:NAME`` per weight).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from executor.kinds import DeviceKind, TransportKind
from onnx2soap.ir import DType
from onnx2soap.precision import Precision
from tests.executor.optimizer_configs import OPTIMIZERS


@dataclass(frozen=True)
class Job:
    plan: str
    out: str
    optimizer: str = "sgd"
    steps: int = 3
    lr: float = 0.05
    dtype: str = "float64"
    precision: str | None = None  # None: the plan's
    device: str = "cpu"
    transport: str = "auto"
    checkpoint: str | None = None
    resume: str | None = None
    save_weights: str | None = None  # --save-weights
    save_model: str | None = None  # --save-model


def options(job: Job):
    """The job's ``RunOptions`` (also what a test's one-device reference runs)."""
    from executor.train import RunOptions

    return RunOptions(
        plan=Path(job.plan),
        steps=job.steps,
        lr=job.lr,
        dtype=DType(job.dtype),
        optimizer=OPTIMIZERS[job.optimizer],
        precision=None if job.precision is None else Precision(job.precision),
        device=DeviceKind(job.device),
        transport=TransportKind(job.transport),
        checkpoint=None if job.checkpoint is None else Path(job.checkpoint),
        resume=None if job.resume is None else Path(job.resume),
        save_weights=None if job.save_weights is None else Path(job.save_weights),
        save_model=None if job.save_model is None else Path(job.save_model),
    )


def write_jobs(path: Path, jobs: list[Job]) -> Path:
    path.write_text(json.dumps([asdict(j) for j in jobs]))
    return path


def read_result(path: Path) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """(losses, weights by name, bytes sent per rank) of a job."""
    with np.load(path) as f:
        weights = {k[2:]: f[k] for k in f.files if k.startswith("w:")}
        return f["losses"], weights, f["sent"]


def main(jobs_file: str) -> int:
    from mpi4py import MPI

    from executor.train import train

    comm = MPI.COMM_WORLD
    for doc in json.loads(Path(jobs_file).read_text()):
        job = Job(**doc)
        result = train(comm, options(job), gather=True)
        if comm.Get_rank() == 0:
            losses = np.array([r.loss for r in result.steps])
            weights = {f"w:{k}": v for k, v in result.weights.items()}
            np.savez(job.out, losses=losses, sent=np.array(result.bytes_sent), **weights)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
