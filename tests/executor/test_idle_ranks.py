"""Plans that leave ranks without work: the idle ranks sit the steps out (executor/crew.py)
and still follow the run.

Rank 0 is idle here, so what only rank 0 does (the step lines, the metrics file, the
saved weights, the evaluation's accuracy) is done by a rank that hears of each step from
the leader. Checked against one device: the same training step for step, evaluations and
checkpoints at the same steps, bad data refused in one line by every rank.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from executor.checkpoint import read_manifest
from tests.executor.mpi import (
    assert_same_training,
    cnn_data_folder,
    make_plan,
    mpirun,
    run_driver,
)

pytestmark = pytest.mark.mpi
BATCH, SAMPLES, STEPS = 4, 16, 6


def _data(path: Path, seed: int, samples: int = SAMPLES) -> Path:
    return cnn_data_folder(path, samples, seed)


def _shifted(plan: Path, out: Path, by: int) -> Path:
    """The same plan on devices ``by`` and up: devices below ``by`` get no work."""
    doc = json.loads(plan.read_text())
    doc["devices"] += by
    for op in doc["ops"]:
        op["devices"] = [d + by for d in op["devices"]]
    out.write_text(json.dumps(doc))
    return out


@pytest.fixture(scope="module")
def plans(export_model, tmp_path_factory):
    model = export_model("cnn")
    folder = tmp_path_factory.mktemp("idle")
    one, two = folder / "one.json", folder / "two.json"
    make_plan(model, one, 1, BATCH, "data-parallel")
    make_plan(model, two, 2, BATCH, "random", seed=3)
    return one, _shifted(two, folder / "idle-first.json", 1)


def test_a_plan_with_an_idle_rank_0_trains_evaluates_and_checkpoints_like_one_device(
    plans, tmp_path: Path
) -> None:
    one, idle_first = plans
    train, evaluation = _data(tmp_path / "train", 0), _data(tmp_path / "eval", 1, samples=8)
    runs = {}
    for name, plan, ranks in (("one", one, 1), ("idle", idle_first, 3)):
        metrics, checkpoint = tmp_path / f"{name}.jsonl", tmp_path / f"{name}-ckpt"
        args = ["--steps", str(STEPS), "--dtype", "float64", "--data", str(train)]
        args += ["--eval-data", str(evaluation), "--eval-every", "3"]
        args += ["--metrics", str(metrics), "--checkpoint", str(checkpoint)]
        args += ["--checkpoint-every", "4"]
        runs[name] = mpirun(plan, ranks, tmp_path, *args)
        assert runs[name].returncode == 0, runs[name].stderr[-2000:]
        runs[name + " metrics"] = [json.loads(x) for x in metrics.read_text().splitlines()]
        runs[name + " saved"] = read_manifest(checkpoint)[0].step
    assert len(runs["idle"].losses) == STEPS  # rank 0 printed every step it only heard of
    assert_same_training(runs["idle"], runs["one"].losses, runs["one"].weights, rtol=1e-10)
    evals = [m for m in runs["idle metrics"] if "eval_loss" in m]
    reference = [m for m in runs["one metrics"] if "eval_loss" in m]
    assert [m["step"] for m in evals] == [3, 6] == [m["step"] for m in reference]
    for got, want in zip(evals, reference, strict=True):
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-10)
        assert got["eval_accuracy"] == want["eval_accuracy"]
    assert runs["idle saved"] == runs["one saved"] == STEPS


def test_bad_data_read_by_working_ranks_is_one_line_from_every_rank(plans, tmp_path: Path) -> None:
    _, idle_first = plans
    data = _data(tmp_path / "bad", 0)
    labels = np.load(data / "labels.npy")
    labels[13] = 10  # read in the fourth batch by a working rank; rank 0 reads nothing
    np.save(data / "labels.npy", labels)
    run = mpirun(idle_first, 3, tmp_path, "--steps", "6", "--data", str(data))
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("executor")]
    assert len(lines) == 1 and "'labels' sample 13" in lines[0], run.stderr
    assert len(run.losses) == 3  # the three steps before it, reported by idle rank 0


def test_the_crew_protocol_on_three_ranks_with_one_idle(tmp_path: Path) -> None:
    """Working ranks 0 and 2 sum over themselves alone; idle rank 1 hears the leader's
    notes in order, and a signal it receives while waiting reaches the leader."""
    seen = run_driver(Path(__file__).with_name("crew_driver.py"), 3, tmp_path, timeout=60)
    assert [seen[r]["working"] for r in range(3)] == [True, False, True]
    assert all(seen[r]["leader"] == 0 and seen[r]["idle"] == [1] for r in range(3))
    assert seen[0]["steppers"] == seen[2]["steppers"] == 2
    assert seen[0]["sum"] == seen[2]["sum"] == 0 + 2
    assert seen[1]["heard"] == [{"step": 0}, {"step": 1}, {"step": 2}]
    assert seen[0]["pleaded"] == signal.SIGTERM and seen[1]["stopped"] == signal.SIGTERM
