"""benchmarks/handoff.py: what a hand-off between ranks costs, three ways.

What it rests on: every setting asked for is measured and reported with positive times;
the executor's waits are put back as shipped after the plan variants; and the chain's
block plans put op i on rank (i // block) mod ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.handoff import _apply, _block_plan, _quantiles
from tests.executor.mpi import make_plan

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "benchmarks.handoff", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def test_quantiles() -> None:
    q = _quantiles([float(x) for x in range(1, 11)])
    assert (q["p10"], q["median"], q["p90"], q["n"]) == (2.0, 5.5, 10.0, 10)
    assert _quantiles([]) == {}


def test_variants_put_the_waits_back() -> None:
    import executor.train as train_module
    import executor.transport as tr

    before = (tr.NAPS_BEFORE_BELL, tr.wait_patiently.__defaults__, train_module.oversubscribed)
    _apply("spin")
    assert train_module.oversubscribed(None) is False
    _apply("short-naps")
    assert tr.wait_patiently.__defaults__[2] == 10e-6 and tr.NAPS_BEFORE_BELL > 10**6
    _apply("shipped")
    after = (tr.NAPS_BEFORE_BELL, tr.wait_patiently.__defaults__, train_module.oversubscribed)
    assert after == before


def test_block_plan_passes_every_block(tmp_path: Path) -> None:
    import onnx2soap.measure.probe_messages as pm

    model = pm.chain_model(tmp_path)  # the probe's 16 Relus
    pg = _block_plan(model.graph, 2, 4)
    devices = [pg.tasks[op.name][0].device for op in model.graph.ops]
    assert devices == [(i // 4) % 2 for i in range(len(model.graph.ops))]
    alone = _block_plan(model.graph, 2, 0)
    assert {alone.tasks[op.name][0].device for op in model.graph.ops} == {0}


@pytest.mark.mpi
def test_hops_are_measured_in_every_setting(tmp_path: Path) -> None:
    out = tmp_path / "hops.json"
    done = _run(
        "--ranks", "2", "--modes", "nap", "bell", "--work-us", "0", "50",
        "--hops", "8", "--repeats", "1", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {(r["mode"], r["work_us"]) for r in rows} == {
        (m, w) for m in ("nap", "bell") for w in (0.0, 50.0)
    }
    for r in rows:
        assert r["ranks"] == 2 and r["latency_s"]["n"] >= 8
        assert 0 < r["latency_s"]["median"] < 1.0 and r["hop_s"] > 0
        assert r["work_after_handoff_s"]["n"] > 0


@pytest.mark.mpi
def test_plans_under_each_variant(example_onnx: Path, tmp_path: Path) -> None:
    plan, out = tmp_path / "mp.json", tmp_path / "plans.json"
    make_plan(example_onnx, plan, 2, 8, "model-parallel")
    done = _run(
        "--ranks", "2", "--plans", str(plan), "--variants", "shipped", "no-bell",
        "--steps", "3", "--repeats", "1", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["shipped", "no-bell"]
    for r in rows:
        assert r["step_s"]["n"] == 1 and r["step_s"]["median"] > 0
        assert (
            r["per_step"]["waits_ready"]
            + r["per_step"]["waits_napping"]
            + r["per_step"]["waits_long"]
            > 0
        )  # a model-parallel step waits for tiles
