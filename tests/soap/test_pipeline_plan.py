"""A plan's pipeline and recompute fields: round trip, and one line naming each bad one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from onnx2soap.errors import PlanError
from onnx2soap.ir import LossKind
from onnx2soap.soap.dims import analyze
from onnx2soap.soap.partition import ParallelConfig
from onnx2soap.soap.pipeline import Pipeline, Schedule, stage_devices
from onnx2soap.soap.plan import Plan, load_plan, plan_ops, save_plan
from onnx2soap.soap.strategy import Strategy
from tests.soap.builders import BATCH, small_cnn

GRAPH = small_cnn()  # at the microbatch's batch
SPACE = analyze(GRAPH)
FIRST = ("conv", "pool", "concat", "relu")
SECOND = ("flatten", "gemm", "loss_op")


def _strategy() -> Strategy:
    """Stage 0 data-parallel on devices 0 and 1, stage 1 on devices 2 and 3."""
    configs = {}
    for name, dims in SPACE.items():
        devices = (0, 1) if name in FIRST else (2, 3)
        configs[name] = ParallelConfig((2, *(1,) * (len(dims) - 1)), devices)
    return Strategy(4, configs)


def _plan(tmp_path: Path, **changes) -> Plan:
    plan = Plan(
        model_path=tmp_path / "net.onnx",
        model_sha256="0" * 64,
        batch=2 * BATCH,
        loss=LossKind.CROSS_ENTROPY,
        devices=4,
        ops=plan_ops(_strategy(), GRAPH, SPACE),
        pipeline=Pipeline((FIRST, SECOND), 2, Schedule.GPIPE),
        recompute=("relu", "conv"),
    )
    return replace(plan, **changes)


def test_a_pipeline_plan_round_trips(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    save_plan(plan, tmp_path / "p.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["pipeline"] == {
        "schedule": "gpipe",
        "microbatches": 2,
        "stages": [list(FIRST), list(SECOND)],
    }
    assert doc["recompute"] == ["relu", "conv"]
    got = load_plan(tmp_path / "p.json")
    assert got.pipeline == plan.pipeline and got.recompute == plan.recompute
    assert got.graph_batch == BATCH
    strategy = got.strategy(GRAPH, SPACE)
    assert stage_devices(got.pipeline, strategy.configs) == ((0, 1), (2, 3))


def test_plans_without_them_write_neither_field(tmp_path: Path) -> None:
    save_plan(_plan(tmp_path, pipeline=None, recompute=(), batch=BATCH), tmp_path / "p.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    assert "pipeline" not in doc and "recompute" not in doc
    got = load_plan(tmp_path / "p.json")
    assert got.pipeline is None and got.recompute == () and got.graph_batch == BATCH


def _edited(tmp_path: Path, edit) -> Path:
    save_plan(_plan(tmp_path), tmp_path / "p.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    edit(doc)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    return tmp_path / "p.json"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["pipeline"].update(schedule="zb"), "'pipeline.schedule': must be one of"),
        (lambda d: d["pipeline"].update(microbatches=3), "3 does not divide the batch of"),
        (lambda d: d["pipeline"].update(microbatches=0), "'pipeline.microbatches': must be an"),
        (lambda d: d["pipeline"].update(stages=[]), "has 0 stages; between 1 and 4"),
        (lambda d: d["pipeline"].update(stages=[[]] * 5), "has 5 stages; between 1 and 4"),
        (lambda d: d["pipeline"]["stages"].append([]), "'pipeline.stages[2]': must be a non-empty"),
        (lambda d: d["pipeline"]["stages"][1].append("nope"), "'nope' is not one of the plan's"),
        (lambda d: d["pipeline"]["stages"][0].append(7), "'pipeline.stages[0][4]': must be an op"),
        (lambda d: d.update(recompute=["relu", "relu"]), "'recompute[1]': op 'relu' appears twice"),
        (lambda d: d.update(recompute=["ghost"]), "'recompute[0]': must name one of the plan's"),
        (lambda d: d.update(recompute="relu"), "field 'recompute': must be list"),
    ],
)
def test_a_bad_field_is_named(tmp_path: Path, edit, message: str) -> None:
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_plan(_edited(tmp_path, edit))


def _checked(plan: Plan) -> None:
    plan.strategy(GRAPH, SPACE)


def test_the_strategy_checks_the_stages_against_the_model(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="splits the model at batch 8, got a graph at batch 4"):
        _checked(_plan(tmp_path, batch=4 * BATCH, pipeline=Pipeline((FIRST, SECOND), 2)))
    missing = Pipeline((FIRST, SECOND[:-1]), 2)
    with pytest.raises(PlanError, match=r"ops in no stage: \['loss_op'\]"):
        _checked(_plan(tmp_path, pipeline=missing))
    twice = Pipeline((FIRST, ("relu", *SECOND)), 2)
    with pytest.raises(PlanError, match="op 'relu' is also in stage 0"):
        _checked(_plan(tmp_path, pipeline=twice))
    backwards = Pipeline((("flatten", "gemm", "loss_op"), FIRST), 2)
    with pytest.raises(PlanError, match="reads 'r' from a later stage"):
        _checked(_plan(tmp_path, pipeline=backwards))
    shared = _strategy().replace("gemm", ParallelConfig((2, 1, 1), (1, 2)))
    plan = _plan(tmp_path, ops=plan_ops(shared, GRAPH, SPACE))
    with pytest.raises(PlanError, match="device 1 also runs stage 0"):
        _checked(plan)


def test_more_stages_than_devices_or_ops_is_refused(tmp_path: Path) -> None:
    one_device = {n: ParallelConfig((1,) * len(d), (0,)) for n, d in SPACE.items()}
    plan = _plan(tmp_path, devices=1, ops=plan_ops(Strategy(1, one_device), GRAPH, SPACE))
    with pytest.raises(PlanError, match="2 stages on 1 devices"):
        _checked(plan)


def test_recompute_names_an_op_of_the_model(tmp_path: Path) -> None:
    plan = _plan(tmp_path, recompute=("relu", "ghost"))
    with pytest.raises(PlanError, match="recompute\\[1\\]: 'ghost' is not an op of the model"):
        _checked(plan)


def test_a_microbatch_size_divides_the_batch() -> None:
    assert Pipeline((FIRST,), 4).microbatch_size(12) == 3
    with pytest.raises(PlanError, match="4 microbatches do not divide the batch of 10"):
        Pipeline((FIRST,), 4).microbatch_size(10)
