"""Pipeline plans for the tests: ``pipeline_plan`` writes a plan as a pipeline planner
would, the ops cut into stages contiguous in graph order, each stage data parallel over
its own ranks, the model split at the microbatch's batch."""

from __future__ import annotations

from pathlib import Path

from onnx2soap.importer import file_sha256, load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import Plan, analyze, plan_ops, save_plan
from onnx2soap.soap.pipeline import Pipeline, Schedule
from onnx2soap.soap.plan import OpPlan
from onnx2soap.soap.zero import ZeroStage


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
