"""``plan MODEL --start ANNOTATED.onnx``: the plan an annotated model states (ours, or
another tool's ONNX multi-device annotations) on MODEL, priced as the plan will be.

With ``--search none`` it is the plan; with the search it is kept unless the search's
plan is faster (the walk itself starts from the rules' plans: search/mcmc.py takes no
outside start yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from onnx2soap.errors import PlanError, UserError
from onnx2soap.importer import load_model
from onnx2soap.ir import Graph, LossKind
from onnx2soap.precision import Precision
from onnx2soap.search.piped import Piped
from onnx2soap.search.plan_request import PlanRequest
from onnx2soap.sim import Evaluation, Machine, make_simulator
from onnx2soap.sim.costs import CostModel
from onnx2soap.sim.planned import read_plan
from onnx2soap.soap import Partitioner, Plan, Strategy, analyze, import_loss
from onnx2soap.soap.annotations import is_annotated_model


@dataclass(frozen=True)
class Start:
    plan: Plan  # as read: its model is the annotated file
    strategy: Strategy  # on MODEL at the plan's graph batch
    evaluation: Evaluation
    piped: Piped | None  # the plan's pipeline on MODEL's microbatch graph


@dataclass(frozen=True)
class StartResult:
    path: str
    evaluation: Evaluation
    kept: bool

    def document(self) -> dict:
        ev = self.evaluation
        return {
            "path": self.path,
            "step_time_s": ev.step_time_s,
            "fits": ev.fits,
            "kept": self.kept,
        }


def read_start(
    request: PlanRequest,
    graph: Graph,
    machine: Machine,
    cost: CostModel,
    slots: int,
    precision: Precision,
    bucket_mb: float,
) -> Start:
    """``request.start`` read as a plan for ``request.model`` (whose graph at the step's batch
    is ``graph``) on ``machine``, and priced as the plan written will be (``precision``,
    ``bucket_mb``; the start's ZeRO stage, pipeline and recomputation)."""
    path = Path(request.start)
    if not is_annotated_model(path):
        raise UserError(f"{path}: --start takes an annotated model (.onnx)")
    plan = read_plan(path, graph.batch)
    if plan.devices != machine.size:
        raise UserError(
            f"{path}: the annotations are for {plan.devices} devices; machine "
            f"'{machine.name}' has {machine.size}"
        )
    if plan.loss is not graph.loss:
        raise UserError(
            f"{path}: its plan trains with loss {plan.loss.value}, not {graph.loss.value}"
        )
    batch = plan.graph_batch
    model = (
        graph
        if batch == graph.batch
        else load_model(
            request.model, batch, LossKind(request.loss) if request.loss else None
        ).graph
    )
    if not _same_graph(load_model(path, batch, import_loss(plan)).graph, model):
        raise UserError(f"{path}: its graph is not {request.model}'s (annotate this model)")
    space = analyze(model)
    try:
        strategy = plan.strategy(model, space)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from e
    simulator = make_simulator(
        machine,
        cost,
        slots,
        precision,
        plan.zero,
        plan.pipeline,
        plan.recompute,
        bucket_mb=bucket_mb,
    )
    evaluation = simulator.evaluate(Partitioner(model).partition(strategy))
    piped = None
    if plan.pipeline:
        piped = Piped(strategy, plan.pipeline, model, space, plan.recompute, evaluation)
    return Start(plan, strategy, evaluation, piped)


def _same_graph(a: Graph, b: Graph) -> bool:
    """The same ops reading and writing the same tensors of the same shapes."""

    def shape(g: Graph) -> tuple:
        ops = tuple((o.name, o.type, o.inputs, o.output) for o in g.ops)
        return ops, {name: t.shape for name, t in g.tensors.items()}

    return shape(a) == shape(b)


def kept_start(start: Start, searched: Evaluation) -> StartResult:
    """The start stands unless the search's plan fits and is faster (or it does not fit)."""
    ev = start.evaluation
    beaten = searched.fits and (not ev.fits or searched.step_time_s < ev.step_time_s)
    return StartResult(str(start.plan.model_path), ev, kept=not beaten)
