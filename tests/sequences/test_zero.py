"""GPT-2 (the tests' two-layer GPT: tied embeddings, dropout 0.1, dynamo export) under
ZeRO-1 and ZeRO-2 (``plan --strategy zero``) on 3 ranks trains exactly like one device:
float64, 1e-10, dropout masks included, with Adam at stage 2 and momentum at stage 1
(the other optimizers: the example CNN, tests/executor/test_zero.py), both
runs in one mpiexec (tests/executor/jobs_driver.py). Its weights' rows (the embedding's
64, the projections' 16 or 64) shard unevenly over 3 (issue 32)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.executor.jobs_driver import Job
from tests.executor.test_zero import assert_like, one_device, run_jobs, zero_plan

pytestmark = pytest.mark.mpi
RANKS, BATCH = 3, 3
JOBS = ((2, "adam"), (1, "momentum"))


def test_gpt2_under_zero_trains_like_one_device(sequence_onnx, tmp_path: Path) -> None:
    model = sequence_onnx("gpt2", "dynamo")
    one = tmp_path / "one.json"
    zero_plan(model, one, 1, BATCH, 0)
    plans = {s: zero_plan(model, tmp_path / f"zero{s}.json", RANKS, BATCH, s) for s in (1, 2)}
    jobs = [
        Job(str(plans[stage]), str(tmp_path / f"z{stage}-{name}.npz"), name, steps=2)
        for stage, name in JOBS
    ]
    run_jobs(jobs, RANKS, tmp_path)
    for job in jobs:
        losses, weights = one_device(replace(job, plan=str(one)))
        assert_like(Path(job.out), losses, weights, rtol=1e-10)
