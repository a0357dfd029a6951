"""``plan``'s pipelines and recomputation: ``--strategy pipeline --stages S --microbatches M
[--schedule 1f1b|gpipe]``, ``--recompute all|none``, and the ``pipeline`` and ``zero``
baselines every plan is compared with.

A pipeline plan's ops are split on the model loaded at the microbatch's batch
(``Plan.graph_batch``), so the rule loads the model a second time at that batch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from onnx2soap.cli.common import loss_choice
from onnx2soap.cli.profile_cmd import ChosenCosts
from onnx2soap.errors import UserError
from onnx2soap.importer import load_model
from onnx2soap.ir import Graph
from onnx2soap.options import int_in
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
from onnx2soap.sim import Evaluation, Machine, Simulator, make_simulator
from onnx2soap.soap import Partitioner, Strategy, analyze
from onnx2soap.soap import validate as validate_strategy
from onnx2soap.soap.pipeline import SCHEDULES, Pipeline, Schedule, check_pipeline_plan
from onnx2soap.soap.plan import MAX_BATCH, MAX_DEVICES
from onnx2soap.soap.zero import ZeroStage

RECOMPUTE = tuple(m.value for m in Recompute)


def add_pipeline_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stages",
        type=int_in(1, MAX_DEVICES),
        help="with --strategy pipeline: pipeline stages, each on its own contiguous group of "
        "devices (default: one per node, at least 2)",
    )
    p.add_argument(
        "--microbatches",
        type=int_in(1, MAX_BATCH),
        help="with --strategy pipeline: microbatches per step, a divisor of the batch (default: "
        "the most, up to 4 per stage, whose samples fill a stage's devices)",
    )
    p.add_argument(
        "--schedule",
        choices=list(SCHEDULES),
        help="with --strategy pipeline: the order of each stage's passes (default 1f1b)",
    )
    p.add_argument(
        "--recompute",
        choices=list(RECOMPUTE),
        default="none",
        help="all: keep a checkpoint per repeated block (the ops whose outputs cross a "
        "transformer layer's or a ResNet block's boundary, as Megatron-LM's full "
        "recomputation keeps each layer's input), or without repeated blocks about sqrt(n) "
        "ops evenly spaced by simulated time (Chen et al. 2016), and recompute every other "
        "op but the loss: each segment's activations are made again during its backward. "
        "Less memory, one more forward per step. selective: keep the products' outputs "
        "(MatMul, Gemm, Conv) and recompute the cheap ops between them (norms, "
        "activations, dropout, elementwise), as Megatron-LM's selective recomputation. "
        "selective-op: that, and every second MatMul/Gemm of each repeated block too, "
        "as torchtitan's per-op policy (selective_ac_option = 'op') does",
    )


def check_options(args: argparse.Namespace, searching: bool) -> None:
    """Pipeline options only with the pipeline rule; recomputation only with a rule."""
    given = [
        flag
        for flag, value in (
            ("--stages", args.stages),
            ("--microbatches", args.microbatches),
            ("--schedule", args.schedule),
        )
        if value is not None
    ]
    if given and args.strategy != "pipeline":
        raise UserError(f"{given[0]} goes with --strategy pipeline (stages and microbatches)")
    if searching and args.recompute != "none":
        raise UserError(
            "--recompute goes with --strategy (a rule); the search chooses recomputation itself"
        )


def recompute_names(
    args: argparse.Namespace, graph: Graph, space: Space, simulator: Simulator
) -> tuple[str, ...]:
    """The ops the plan recomputes under ``--recompute`` (``pipeline_rule.recompute_list``)."""
    return recompute_list(Recompute(args.recompute), graph, space, simulator)


@dataclass(frozen=True)
class Piped:
    """A pipeline plan built by rule, on the model at the microbatch's batch."""

    strategy: Strategy
    pipeline: Pipeline
    graph: Graph
    space: Space
    recompute: tuple[str, ...]
    evaluation: Evaluation


def shape(args: argparse.Namespace, machine: Machine, graph: Graph) -> tuple[int, int, Schedule]:
    """``--stages``, ``--microbatches``, ``--schedule`` or their defaults, checked."""
    default = default_shape(machine, graph.batch, len(graph.ops))
    stages = args.stages or (default[0] if default else 1)
    check_shape(machine.size, graph.batch, len(graph.ops), stages, args.microbatches or 1)
    microbatches = args.microbatches or default_microbatches(machine.size, graph.batch, stages)
    check_shape(machine.size, graph.batch, len(graph.ops), stages, microbatches or 1)
    return stages, microbatches or 1, Schedule(args.schedule or Schedule.ONE_F_ONE_B.value)


def plan_pipeline(
    args: argparse.Namespace,
    graph: Graph,
    machine: Machine,
    costs: ChosenCosts,
    slots: int,
    precision: Precision,
    stages: int,
    microbatches: int,
    schedule: Schedule,
    recompute: Recompute,
) -> Piped:
    """The pipeline rule's plan for ``graph`` (the model at the step's batch), priced.
    ``costs``: taken into the step by ``graph``'s calibration (``for_graph``), made at
    the step's batch, which the microbatch's tasks are taken in by too."""
    check_shape(machine.size, graph.batch, len(graph.ops), stages, microbatches)
    micro = load_model(args.model, graph.batch // microbatches, loss_choice(args.loss)).graph
    space = analyze(micro)
    model = costs.model
    plain = make_simulator(machine, model, slots, precision)
    names = recompute_list(recompute, micro, space, plain)
    built = pipeline_plan(micro, space, plain, stages, microbatches, schedule, frozenset(names))
    validate_strategy(micro, space, built.strategy)
    check_pipeline_plan(built.pipeline, micro, built.strategy.configs, machine.size)
    priced = make_simulator(
        machine, model, slots, precision, pipeline=built.pipeline, recompute=names
    )
    evaluation = priced.evaluate(Partitioner(micro).partition(built.strategy))
    return Piped(built.strategy, built.pipeline, micro, space, names, evaluation)


def more_baselines(
    args: argparse.Namespace,
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
                args,
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
