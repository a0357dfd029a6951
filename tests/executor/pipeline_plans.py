"""Pipeline plans for the tests: ``pipeline_plan`` writes a plan as a pipeline planner
would, the ops cut into stages contiguous in graph order, each stage data parallel over
its own ranks, the model split at the microbatch's batch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from onnx2soap.importer import file_sha256, load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import Plan, analyze, plan_ops, save_plan
from onnx2soap.soap.pipeline import Pipeline, Schedule
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
        ops += [replace(op, devices=tuple(d + s * width for d in op.devices)) for op in part]
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


def walked_plan(
    model: Path,
    path: Path,
    batch: int,
    microbatches: int,
    degrees: tuple[int, ...],
    zero: ZeroStage = ZeroStage.NONE,
    changes: int = 0,
) -> Path:
    """A plan of the walk inside pipelines (``search/pipeline_walk.py``) on cpu:4: one
    stage per entry of ``degrees`` over equal groups of the 4 ranks, the rule's balanced
    cuts, each stage at its tensor-parallel degree (1: data parallel; above: Megatron-LM
    inside the stage), 1F1B; then ``changes`` of the walk's random changes of an op's
    config inside its stage (``StageSpace.propose``, seeded), kept whatever they cost."""
    from onnx2soap.precision import Precision
    from onnx2soap.search.pipeline_rule import Recompute
    from onnx2soap.search.pipeline_walk import Layout, StageSpace
    from onnx2soap.search.priced import Pricing, Shape
    from onnx2soap.sim import RooflineCost, resolve_machine

    graph = load_model(model, batch // microbatches).graph
    space = analyze(graph)
    pricing = Pricing(resolve_machine("cpu:4"), 0, Precision.FP32)
    shape = Shape(len(degrees), microbatches, Schedule.ONE_F_ONE_B, False)
    stages = StageSpace(graph, space, pricing, shape)
    cuts = stages.balanced(1, pricing, RooflineCost(), frozenset())
    layout = Layout(cuts, degrees, zero, (Recompute.NONE,) * len(degrees), microbatches)
    rng = np.random.default_rng(0)
    for _ in range(changes):
        layout = stages.propose(layout, rng)
    strategy, pipeline = stages.build(layout)
    ops = plan_ops(strategy, graph, space)
    doc = Plan(
        model,
        file_sha256(model),
        batch,
        graph.loss,
        4,
        tuple(ops),
        zero_stage=zero,
        pipeline=pipeline,
    )
    save_plan(doc, path)
    return path
