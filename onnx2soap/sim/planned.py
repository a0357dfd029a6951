"""A plan priced on a machine, as ``simulate`` (and ``compare``, ``show``) price it:
the plan checked against its model file and the machine, partitioned on its model, and
simulated under its own precision, ZeRO stage, pipeline, recomputation and buckets.

The command line (cli/simulate_cmd.py) and the Python API (onnx2soap/api.py) share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from onnx2soap.errors import UserError
from onnx2soap.files import check_input
from onnx2soap.importer import file_sha256, load_model
from onnx2soap.sim import Evaluation, Machine, Simulator, make_simulator, resolve_machine
from onnx2soap.sim.chosen_costs import ChosenCosts, choose_costs
from onnx2soap.sim.memory import OPTIMIZER_SLOTS
from onnx2soap.soap import PartitionedGraph, Partitioner, Plan, analyze, import_loss, load_plan
from onnx2soap.soap.annotations import is_annotated_model, read_annotated
from onnx2soap.soap.zero import check_zero


@dataclass(frozen=True)
class PlanOnMachine:
    """A plan checked against its model file and the machine it is simulated on."""

    plan: Plan
    model: Path
    spec: str  # the machine as given: a preset or a machine file
    machine: Machine
    label: str  # the plan as the user named it, for messages


def place(plan: Plan, label: str, model: Path | str | None, machine: str | None) -> PlanOnMachine:
    """``plan`` (named ``label``) on ``model`` (default: the plan's) and ``machine``
    (default: the plan's, else ``cpu:N``): the model must be the plan's and the machine
    its size."""
    path = Path(model or plan.model_path)
    if model_sha256(path) != plan.model_sha256:
        raise UserError(f"{path}: not the model the plan was made for (sha256 differs)")
    spec = machine or plan.machine or f"cpu:{plan.devices}"
    resolved = resolve_machine(spec)
    if resolved.size != plan.devices:
        raise UserError(
            f"{label}: the plan is for {plan.devices} devices but machine "
            f"'{resolved.name}' has {resolved.size}"
        )
    return PlanOnMachine(plan, path, spec, resolved, label)


def partition(planned: PlanOnMachine) -> PartitionedGraph:
    """The plan's strategy on its model (a ZeRO stage only where something is replicated)."""
    plan = planned.plan
    graph = load_model(planned.model, plan.graph_batch, import_loss(plan)).graph
    pg = Partitioner(graph).partition(plan.strategy(graph, analyze(graph)))
    check_zero(plan.zero, (g for gs in pg.groups.values() for g in gs), planned.label)
    return pg


def step_costs(costs: ChosenCosts, planned: PlanOnMachine, pg: PartitionedGraph) -> ChosenCosts:
    """``costs`` taken into the step by the model's calibration (``for_graph``), which
    is made at the step's batch: a pipeline plan's graph is a microbatch's, so the model
    is loaded a second time at the step's batch for it. With the microbatch's own graph
    the calibration fell back to every model's (GPT-2's 2-stage, 2-microbatch plan:
    predicted 5.3 ms against one device's 6.4, measured 1.0-1.4x one device's step)."""
    plan = planned.plan
    if plan.pipeline is None or not costs.calibrates:  # only profiled costs calibrate
        return costs.for_graph(pg.graph, planned.machine)
    step = load_model(planned.model, plan.batch, import_loss(plan)).graph
    return costs.for_graph(step, planned.machine)


def plan_simulator(planned: PlanOnMachine, cost, slots: int) -> Simulator:
    """The plan's simulator: its precision, ZeRO stage, pipeline, recomputation and
    gradient buckets."""
    plan = planned.plan
    return make_simulator(
        planned.machine,
        cost,
        slots,
        plan.precision,
        plan.zero,
        plan.pipeline,
        plan.recompute,
        plan.bucket_mb,
    )


@dataclass(frozen=True)
class Priced:
    """One training step of a plan, simulated."""

    evaluation: Evaluation
    costs: ChosenCosts
    simulator: Simulator
    graph: PartitionedGraph


def price(planned: PlanOnMachine, optimizer: str, costs: str) -> Priced:
    """``planned``'s step with ``optimizer``'s state in memory, under ``costs``
    (auto, profiled, achieved, roofline: cli/profile_cmd.py)."""
    if optimizer not in OPTIMIZER_SLOTS:
        raise UserError(f"optimizer must be one of {', '.join(OPTIMIZER_SLOTS)}, got {optimizer!r}")
    chosen = choose_costs(planned.spec, planned.machine, costs)  # before loading the model
    pg = partition(planned)
    chosen = step_costs(chosen, planned, pg)
    simulator = plan_simulator(planned, chosen.model, OPTIMIZER_SLOTS[optimizer])
    return Priced(simulator.evaluate(pg), chosen, simulator, pg)


def read_plan(path: Path | str, batch: int | None = None) -> Plan:
    """A JSON plan file, or an annotated model read as a plan (``batch`` binds a
    symbolic batch where the model has no onnx2soap metadata)."""
    if not is_annotated_model(path):
        if batch is not None:
            raise UserError(f"{path}: --batch is for annotated models; a plan file has its batch")
        return load_plan(path)
    return read_annotated(path, lambda b, loss: load_model(path, b, loss), batch)


def model_sha256(path) -> str:
    """Only a regular file is hashed: /dev/zero or a FIFO would be read for ever."""
    path = check_input(path, "model file")
    try:
        return file_sha256(path)
    except OSError as e:
        raise UserError(f"{path}: cannot read the model file ({e.strerror or e})") from e
