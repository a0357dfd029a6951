"""The committed example plans still fit the committed model, and example.json trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnx2soap.importer import file_sha256, load_model
from onnx2soap.soap import analyze, load_plan
from tests.executor.mpi import mpirun

PLANS = sorted((Path(__file__).resolve().parents[1] / "plans").glob("*.json"))


def test_there_are_example_plans() -> None:
    assert {p.name for p in PLANS} >= {"example.json", "cnn-random-4.json"}


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.name)
def test_plan_matches_the_committed_model(path: Path) -> None:
    plan = load_plan(path)
    assert plan.model_path.resolve().is_file()
    assert file_sha256(plan.model_path) == plan.model_sha256, "re-run `make plans`"
    graph = load_model(plan.model_path, plan.batch).graph
    plan.strategy(graph, analyze(graph))  # validates every op's config
    assert plan.predicted is not None and plan.predicted.step_time_s > 0


@pytest.mark.mpi
def test_example_plan_trains_under_mpiexec(tmp_path: Path) -> None:
    plan = next(p for p in PLANS if p.name == "example.json")
    run = mpirun(plan, 4, tmp_path, "--steps", "2", "--lr", "0.05", "--seed", "0")
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(run.losses) == 2 and all(0 < loss < 10 for loss in run.losses)
