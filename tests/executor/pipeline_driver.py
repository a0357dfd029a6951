"""Pipeline plans for the tests, and several training runs in one mpiexec.

``pipeline_plan`` writes a plan as a pipeline planner would: the ops cut into stages
contiguous in graph order, each stage data parallel over its own ranks, the model split
at the microbatch's batch. An interpreter's start and imports are most of a small run's
time, so every job is the executor's ``train`` called again in the same ranks:

    mpiexec -n N python tests/executor/pipeline_driver.py JOBS.json

JOBS.json is a list of ``Job``s (``write_jobs``); rank 0 writes each job's losses,
evaluation losses, the bytes each rank sent, every rank's peak RSS and the gathered
weights to its ``out`` .npz (``read_result``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from executor.kinds import DeviceKind, TransportKind
from onnx2soap.importer import file_sha256, load_model
from onnx2soap.ir import DType
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import Plan, analyze, plan_ops, save_plan
from onnx2soap.soap.pipeline import Pipeline, Schedule
from onnx2soap.soap.plan import OpPlan
from onnx2soap.soap.zero import ZeroStage
from tests.executor.optimizer_configs import OPTIMIZERS


def pipeline_plan(
    model: Path,
    path: Path,
    batch: int,
    stages: int,
    microbatches: int,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    width: int = 1,
    zero: ZeroStage = ZeroStage.NONE,
) -> Path:
    """``stages`` stages of ``width`` ranks each (stage s on ranks s*width ...), the ops
    cut into stages of equal op counts, each stage data parallel over its ranks;
    ``stages=1, microbatches=1`` writes a plan without a pipeline."""
    graph = load_model(model, batch // microbatches).graph
    space = analyze(graph)
    within = plan_ops(data_parallel(graph, space, width), graph, space)
    n = len(graph.ops)
    bounds = [s * n // stages for s in range(stages + 1)]
    ops, names = [], []
    for s in range(stages):
        part = within[bounds[s] : bounds[s + 1]]
        names.append(tuple(op.name for op in part))
        ops += [
            OpPlan(op.name, op.degrees, tuple(d + s * width for d in op.devices)) for op in part
        ]
    pipeline = None
    if stages > 1 or microbatches > 1:
        pipeline = Pipeline(tuple(names), microbatches, schedule)
    doc = Plan(
        model,
        file_sha256(model),
        batch,
        graph.loss,
        stages * width,
        tuple(ops),
        zero_stage=zero,
        pipeline=pipeline,
    )
    save_plan(doc, path)
    return path


@dataclass(frozen=True)
class Job:
    plan: str
    out: str
    optimizer: str = "sgd"
    steps: int = 3
    lr: float = 0.05
    dtype: str = "float64"
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
