"""The Python API: ``plan``, ``simulate`` and ``inspect``, what the ``onnx2soap plan``,
``simulate`` and ``inspect`` commands do, returning typed results (docs/api.md).

Errors are raised as onnx2soap/errors.py's (``UserError`` and its kinds: ``ModelError``,
``PlanError``, ``MachineError``), never printed; nothing here exits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from onnx2soap.files import check_output
from onnx2soap.inspection import Inspected, inspect_model
from onnx2soap.ir import LossKind
from onnx2soap.search.plan_request import PlanRequest
from onnx2soap.search.planner import make_plan
from onnx2soap.sim.planned import place, price, read_plan
from onnx2soap.soap import Plan, save_plan


@dataclass(frozen=True)
class Step:
    """One simulated training step: its time, each device's peak memory, the bytes
    moved between devices, and whether every device's peak fits in its memory."""

    step_time_s: float
    peak_memory_bytes: tuple[int, ...]
    bytes_moved: int
    fits: bool


@dataclass(frozen=True)
class Baseline:
    """A plan by rule the plan is compared with (data-parallel, megatron, zero, ...)."""

    step_time_s: float
    fits: bool


@dataclass(frozen=True)
class Planned:
    """A plan made by ``plan``: the plan file's content, its predicted step, each
    baseline's, and how it was made (``method``: "mcmc", a rule's name, or "start")."""

    plan: Plan
    predicted: Step
    baselines: Mapping[str, Baseline]
    method: str
    machine: str  # the machine's name
    search_time_s: float  # 0 by rule

    def save(self, path: Path | str) -> Path:
        """Write the plan file (``python -m executor run PATH`` trains it)."""
        check_output(path)  # refused in one line, as the command refuses it
        save_plan(self.plan, path)
        return Path(path)


@dataclass(frozen=True)
class Simulated:
    """A plan's training step as ``onnx2soap simulate`` prices it."""

    step: Step
    memory_bytes: tuple[int, ...]  # each device's memory
    machine: str
    costs: str  # profiled, achieved or roofline


def plan(
    model: Path | str,
    machine: str | None = None,
    *,
    batch: int | None = None,
    budget: float = 30.0,
    strategy: str | None = None,
    seed: int = 0,
    max_evals: int | None = None,
    precision: str = "fp32",
    optimizer: str = "sgd",
    zero_stage: int | None = None,
    recompute: str = "none",
    costs: str = "auto",
    **options,
) -> Planned:
    """A plan for ``model`` on ``machine`` (a preset such as ``"dgx-h100:2"`` or a
    machine file): found by MCMC search over the simulator within ``budget`` seconds
    (``max_evals``: stop after that many proposals, reproducible with ``seed``), or
    built by ``strategy`` (a rule: ``"data-parallel"``, ``"megatron"``, ``"zero"``,
    ``"pipeline"``, ...). ``options``: the rest of ``onnx2soap plan``'s options by their
    names (``loss``, ``devices``, ``stages``, ``microbatches``, ``schedule``,
    ``search``, ``margin``, ``beta``, ``sequence_parallel``, ``head_tail``, ``start``,
    ``bucket_mb``); docs/cli.md says what each does. Nothing is written: see
    ``Planned.save``."""
    request = PlanRequest(
        model=model,
        machine=machine,
        batch=batch,
        budget=budget,
        strategy=strategy,
        seed=seed,
        max_evals=max_evals,
        precision=precision,
        optimizer=optimizer,
        zero_stage=zero_stage,
        recompute=recompute,
        costs=costs,
        **options,
    )
    made = make_plan(request)
    p = made.plan
    pred = p.predicted
    infeasible = set(pred.infeasible)
    baselines = {name: Baseline(t, name not in infeasible) for name, t in pred.baselines}
    ev = made.outcome.chosen
    if p.search is not None:
        method = p.search.method
    else:
        method = made.mode.rule.value if made.mode.rule else "start"
    return Planned(
        plan=p,
        predicted=Step(ev.step_time_s, ev.peak_memory_bytes, ev.bytes_moved, ev.fits),
        baselines=MappingProxyType(baselines),
        method=method,
        machine=made.machine.name,
        search_time_s=made.outcome.time_s,
    )


def simulate(
    plan: Planned | Plan | Path | str,
    machine: str | None = None,
    *,
    model: Path | str | None = None,
    optimizer: str = "sgd",
    costs: str = "auto",
) -> Simulated:
    """One training step of ``plan`` (a ``Planned``, a ``Plan``, a plan file or an
    annotated model) on ``machine`` (default: the plan's), its model ``model`` (default:
    the plan's), with ``optimizer``'s state in memory, under ``costs``."""
    if isinstance(plan, Planned):
        plan = plan.plan
    label = "the plan" if isinstance(plan, Plan) else str(plan)
    read = plan if isinstance(plan, Plan) else read_plan(plan)
    planned = place(read, label, model, machine)
    priced = price(planned, optimizer, costs)
    ev = priced.evaluation
    return Simulated(
        step=Step(ev.step_time_s, ev.peak_memory_bytes, ev.bytes_moved, ev.fits),
        memory_bytes=tuple(d.memory for d in planned.machine.devices),
        machine=planned.machine.name,
        costs=priced.costs.name,
    )


def inspect(model: Path | str, batch: int | None = None, loss: str | None = None) -> Inspected:
    """``model``'s ops, output shapes, SOAP dims, FLOPs and parameters at ``batch``
    (binding a symbolic batch dim), as ``onnx2soap inspect`` shows them; ``loss``
    ("cross-entropy", "mse", "none") where the model has none."""
    return inspect_model(model, batch, LossKind(loss) if loss else None)
