"""Several training runs in one mpiexec: an interpreter's start and its imports are most
of a small run's time, so every job is the executor's ``train`` called again in the same
ranks (as benchmarks/interleave.py does). The ZeRO, pipeline and sequence tests share it.

    mpiexec -n N python tests/executor/jobs_driver.py JOBS.json

JOBS.json is a list of ``Job``s (``write_jobs``; ``run_jobs`` writes it and runs them);
rank 0 writes each job's losses, evaluation losses, the bytes each rank sent, every
rank's peak RSS and the gathered weights to its ``out`` .npz (``read_result``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from executor.kinds import DeviceKind, TransportKind
from onnx2soap.ir import DType
from onnx2soap.precision import Precision
from tests.executor.mpi import MPIEXEC
from tests.executor.optimizer_configs import OPTIMIZERS

DRIVER = Path(__file__)
ROOT = Path(__file__).parents[2]


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
    data: str | None = None  # --data (synthetic when None)
    eval_data: str | None = None  # --eval-data, evaluated at the end
    checkpoint: str | None = None
    resume: str | None = None
    save_weights: str | None = None
    save_model: str | None = None


def options(job: Job):
    """The job's ``RunOptions`` (also what a test's one-device reference runs)."""
    from executor.train import RunOptions

    def path(value: str | None) -> Path | None:
        return None if value is None else Path(value)

    return RunOptions(
        plan=Path(job.plan),
        steps=job.steps,
        lr=job.lr,
        dtype=DType(job.dtype),
        optimizer=OPTIMIZERS[job.optimizer],
        precision=None if job.precision is None else Precision(job.precision),
        device=DeviceKind(job.device),
        transport=TransportKind(job.transport),
        data=path(job.data),
        eval_data=path(job.eval_data),
        checkpoint=path(job.checkpoint),
        resume=path(job.resume),
        save_weights=path(job.save_weights),
        save_model=path(job.save_model),
    )


def write_jobs(path: Path, jobs: list[Job]) -> Path:
    path.write_text(json.dumps([asdict(j) for j in jobs]))
    return path


@dataclass(frozen=True)
class Result:
    losses: np.ndarray
    evaluations: np.ndarray  # evaluation losses, in order
    weights: dict[str, np.ndarray]
    sent: np.ndarray  # bytes, per rank
    peak_rss: np.ndarray  # bytes, per rank


def read_result(path: Path) -> Result:
    with np.load(path) as f:
        weights = {k[2:]: f[k] for k in f.files if k.startswith("w:")}
        return Result(f["losses"], f["evaluations"], weights, f["sent"], f["peak_rss"])


def run(comm, job: Job) -> Result:
    """Train ``job`` on ``comm`` (rank 0's result holds the weights and records)."""
    from executor.train import train

    evaluations: list[float] = []
    result = train(
        comm, options(job), gather=True, on_eval=lambda record: evaluations.append(record.loss)
    )
    return Result(
        np.array([r.loss for r in result.steps]),
        np.array(evaluations),
        result.weights or {},
        np.array(result.bytes_sent),
        np.array(result.peak_rss),
    )


def main(jobs_file: str) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for doc in json.loads(Path(jobs_file).read_text()):
        job = Job(**doc)
        got = run(comm, job)
        if comm.Get_rank() == 0:
            np.savez(
                job.out,
                losses=got.losses,
                evaluations=got.evaluations,
                sent=got.sent,
                peak_rss=got.peak_rss,
                **{f"w:{k}": v for k, v in got.weights.items()},
            )
    return 0


def run_jobs(jobs: list[Job], ranks: int, folder: Path, timeout: float = 300) -> None:
    """All ``jobs`` in one ``mpiexec -n ranks``; the run must succeed. The tests'
    PYTHONPATH is kept (the GPU pass puts the cupy stand-in on it)."""
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    listed = write_jobs(folder / "jobs.json", jobs)
    done = subprocess.run(
        [str(MPIEXEC), "-n", str(ranks), sys.executable, str(DRIVER), str(listed)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
    )
    assert done.returncode == 0, done.stderr[-3000:]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
