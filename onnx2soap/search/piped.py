"""The pipeline rule's plan priced (``--strategy pipeline --stages S --microbatches M
[--schedule 1f1b|gpipe]``), and the ``pipeline`` and ``zero`` baselines every plan by
rule is compared with: the planner's (search/planner.py) pipelines built by rule.

A pipeline plan's ops are split on the model loaded at the microbatch's batch
(``Plan.graph_batch``), so the rule loads the model a second time at that batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx2soap.errors import UserError
from onnx2soap.importer import load_model
from onnx2soap.ir import Graph, LossKind
from onnx2soap.precision import Precision
from onnx2soap.search.baselines import data_parallel
from onnx2soap.search.pipeline_rule import (
    Recompute,
    Space,
    check_shape,
    default_microbatches,
    default_shape,
    pipeline_plan,
    recompute_list,
)
from onnx2soap.search.plan_request import PlanRequest
from onnx2soap.sim import Evaluation, Machine, make_simulator
from onnx2soap.sim.chosen_costs import ChosenCosts
from onnx2soap.soap import Partitioner, Strategy, analyze
from onnx2soap.soap import validate as validate_strategy
from onnx2soap.soap.pipeline import Pipeline, Schedule, check_pipeline_plan
from onnx2soap.soap.zero import ZeroStage


def _loss(request: PlanRequest) -> LossKind | None:
    return LossKind(request.loss) if request.loss else None


@dataclass(frozen=True)
class Piped:
    """A pipeline plan built by rule, on the model at the microbatch's batch."""

    strategy: Strategy
    pipeline: Pipeline
    graph: Graph
    space: Space
    recompute: tuple[str, ...]
    evaluation: Evaluation


def shape(request: PlanRequest, machine: Machine, graph: Graph) -> tuple[int, int, Schedule]:
    """``--stages``, ``--microbatches``, ``--schedule`` or their defaults, checked."""
    default = default_shape(machine, graph.batch, len(graph.ops))
    stages = request.stages or (default[0] if default else 1)
    check_shape(machine.size, graph.batch, len(graph.ops), stages, request.microbatches or 1)
    microbatches = request.microbatches or default_microbatches(machine.size, graph.batch, stages)
    check_shape(machine.size, graph.batch, len(graph.ops), stages, microbatches or 1)
    return stages, microbatches or 1, Schedule(request.schedule or Schedule.ONE_F_ONE_B.value)


def plan_pipeline(
    request: PlanRequest,
    graph: Graph,
    machine: Machine,
    costs: ChosenCosts,
    slots: int,
    precision: Precision,
    stages: int,
    microbatches: int,
    schedule: Schedule,
    recompute: Recompute,
    zero: ZeroStage = ZeroStage.NONE,
) -> Piped:
    """The pipeline rule's plan for ``graph`` (the model at the step's batch), priced
    under ZeRO ``zero`` (one stage: data parallelism accumulating the microbatches'
    gradients). ``costs``: taken into the step by ``graph``'s calibration
    (``for_graph``), made at the step's batch, which the microbatch's tasks are taken
    in by too."""
    check_shape(machine.size, graph.batch, len(graph.ops), stages, microbatches)
    micro = load_model(request.model, graph.batch // microbatches, _loss(request)).graph
    space = analyze(micro)
    model = costs.model
    plain = make_simulator(machine, model, slots, precision)
    names = recompute_list(recompute, micro, space, plain)
    built = pipeline_plan(micro, space, plain, stages, microbatches, schedule, frozenset(names))
    validate_strategy(micro, space, built.strategy)
    check_pipeline_plan(built.pipeline, micro, built.strategy.configs, machine.size)
    priced = make_simulator(
        machine, model, slots, precision, zero, pipeline=built.pipeline, recompute=names
    )
    evaluation = priced.evaluate(Partitioner(micro).partition(built.strategy))
    return Piped(built.strategy, built.pipeline, micro, space, names, evaluation)


def more_baselines(
    request: PlanRequest,
    graph: Graph,
    space: Space,
    machine: Machine,
    costs: ChosenCosts,
    slots: int,
    precision: Precision,
) -> dict[str, Evaluation]:
    """``zero``: ZeRO-2 data parallelism (with more than one device); ``pipeline``: the
    rule's default shape (``pipeline_rule.default_shape``), 1F1B, where one exists and
    the model can be loaded at the microbatch's batch (a fixed batch cannot)."""
    out = {}
    if machine.size > 1:
        zero = make_simulator(machine, costs.model, slots, precision, ZeroStage.GRADIENTS)
        strategy = data_parallel(graph, space, machine.size)
        out["zero"] = zero.evaluate(Partitioner(graph).partition(strategy))
    default = default_shape(machine, graph.batch, len(graph.ops))
    if default is not None:
        try:
            piped = plan_pipeline(
                request,
                graph,
                machine,
                costs,
                slots,
                precision,
                *default,
                Schedule.ONE_F_ONE_B,
                Recompute.NONE,
            )
        except UserError:  # e.g. a model whose batch is fixed: no microbatch to load
            return out
        out["pipeline"] = piped.evaluation
    return out
