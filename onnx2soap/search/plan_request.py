"""What a ``plan`` is asked for (``PlanRequest``: the command line's options, or the
Python API's arguments) and the checks made on it before any work.

The field names are the command line's option names (``--max-evals``: ``max_evals``),
so the pipeline and start helpers read a request as they read parsed options.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from onnx2soap.errors import UserError
from onnx2soap.precision import Precision
from onnx2soap.search.baselines import Rule
from onnx2soap.search.mcmc import MAX_BETA, MAX_BUDGET_S, MAX_EVALS, MAX_SEED, SearchOptions
from onnx2soap.search.pipeline_rule import Recompute
from onnx2soap.sim import resolve_machine
from onnx2soap.sim.memory import OPTIMIZER_SLOTS
from onnx2soap.soap.buckets import DEFAULT_BUCKET_MB, check_bucket_mb
from onnx2soap.soap.pipeline import SCHEDULES
from onnx2soap.soap.plan import MAX_BATCH, MAX_DEVICES
from onnx2soap.soap.zero import ZERO_STAGES, ZeroStage


@dataclass(frozen=True)
class PlanRequest:
    """A plan asked for: the model, the machine, and how the plan is found or built."""

    model: str | Path
    batch: int | None = None
    loss: str | None = None  # attached where the model has none (default cross-entropy)
    machine: str | None = None  # a preset (dgx-h100:2) or a machine file
    devices: int | None = None  # shorthand for machine cpu:N
    strategy: str | None = None  # a rule (search/baselines.py) instead of the search
    zero_stage: int | None = None
    sequence_parallel: bool = False
    head_tail: bool = True  # context parallelism's causal balancing (--no-head-tail: off)
    stages: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    recompute: str = "none"
    search: str | None = None  # "mcmc" or "none"; default mcmc unless a strategy
    budget: float = 30.0  # seconds of search (the ILP's time limit with strategy ilp)
    margin: float | None = None
    max_evals: int | None = None
    beta: float = SearchOptions.beta
    seed: int = 0
    costs: str = "auto"
    optimizer: str = "sgd"
    precision: str = "fp32"
    start: str | Path | None = None  # an annotated model whose plan is the one to beat
    bucket_mb: float = DEFAULT_BUCKET_MB


@dataclass(frozen=True)
class Mode:
    """How the plan is made: by ``rule`` (None: the search, or the start as it is), by
    the search (``searching``), with gradient buckets of ``bucket_mb``."""

    rule: Rule | None
    searching: bool
    bucket_mb: float


def decide(request: PlanRequest) -> Mode:
    """The request's options checked, alone and against each other, before any work."""
    _check_values(request)
    rule, searching = _rule(request)
    return Mode(rule, searching, _bucket_mb(request.bucket_mb))


def _check_values(r: PlanRequest) -> None:
    """What the command line's parser checks, for callers of the Python API."""
    choices = {
        "strategy": (r.strategy, [x.value for x in Rule], True),
        "zero_stage": (r.zero_stage, [int(z) for z in ZERO_STAGES], True),
        "schedule": (r.schedule, list(SCHEDULES), True),
        "recompute": (r.recompute, [x.value for x in Recompute], False),
        "search": (r.search, ["mcmc", "none"], True),
        "costs": (r.costs, ["auto", "profiled", "achieved", "roofline"], False),
        "optimizer": (r.optimizer, list(OPTIMIZER_SLOTS), False),
        "precision": (r.precision, [x.value for x in Precision], False),
        "loss": (r.loss, ["cross-entropy", "mse", "none"], True),
    }
    for name, (value, allowed, optional) in choices.items():
        if not (optional and value is None) and value not in allowed:
            raise UserError(f"{name} must be one of {allowed}, got {value!r}")
    ranges = {
        "batch": (r.batch, 1, MAX_BATCH),
        "devices": (r.devices, 1, MAX_DEVICES),
        "stages": (r.stages, 1, MAX_DEVICES),
        "microbatches": (r.microbatches, 1, MAX_BATCH),
        "budget": (r.budget, 0, MAX_BUDGET_S),
        "margin": (r.margin, 0, 0.99),
        "max_evals": (r.max_evals, 1, MAX_EVALS),
        "beta": (r.beta, 0, MAX_BETA),
        "seed": (r.seed, 0, MAX_SEED),
    }
    for name, (value, low, high) in ranges.items():
        if value is not None and not (isinstance(value, int | float) and low <= value <= high):
            raise UserError(f"{name} must be a number in [{low}, {high}], got {value!r}")


# the rules whose plans may be given a ZeRO stage (``--zero-stage``)
ZERO_RULES = (Rule.ZERO.value, Rule.CONTEXT.value, Rule.PIPELINE.value)


def _rule(request: PlanRequest) -> tuple[Rule | None, bool]:
    r = request
    if r.strategy and r.search == "mcmc":
        raise UserError(
            "--strategy builds a plan by rule; it cannot be combined with --search mcmc"
        )
    if r.zero_stage is not None and r.strategy not in ZERO_RULES:
        raise UserError(
            "--zero-stage goes with --strategy zero (data parallelism with ZeRO), "
            "--strategy context or --strategy pipeline"
        )
    if r.sequence_parallel and r.strategy != Rule.MEGATRON.value:
        raise UserError("--sequence-parallel goes with --strategy megatron")
    if not r.head_tail and r.strategy != Rule.CONTEXT.value:
        raise UserError("--no-head-tail goes with --strategy context")
    if r.start and r.strategy:
        raise UserError("--start gives the plan to start from; it cannot go with --strategy")
    if r.start and r.recompute != "none":
        raise UserError("--start's plan keeps its own recomputation; drop --recompute")
    _check_pipeline_options(r, searching=not r.strategy and r.search != "none")
    if r.strategy:
        return Rule(r.strategy), False
    if r.search == "none":
        return (None, False) if r.start else (Rule.DATA_PARALLEL, False)
    return None, True


def _check_pipeline_options(request: PlanRequest, searching: bool) -> None:
    """Pipeline options only with the pipeline rule; recomputation only with a rule."""
    given = [
        flag
        for flag, value in (
            ("--stages", request.stages),
            ("--microbatches", request.microbatches),
            ("--schedule", request.schedule),
        )
        if value is not None
    ]
    if given and request.strategy != "pipeline":
        raise UserError(f"{given[0]} goes with --strategy pipeline (stages and microbatches)")
    if searching and request.recompute != "none":
        raise UserError(
            "--recompute goes with --strategy (a rule); the search chooses recomputation itself"
        )


def machine_spec(machine: str | None, devices: int | None) -> str:
    """The machine as given: ``machine``, or ``cpu:N`` for ``devices``; both must agree."""
    if devices is not None and devices < 1:
        raise UserError(f"--devices must be >= 1, got {devices}")
    if machine and devices is not None:
        m = resolve_machine(machine)
        if m.size != devices:
            raise UserError(
                f"--devices {devices} disagrees with --machine {machine} ({m.size} devices)"
            )
    if machine:
        return machine
    if devices is None:
        raise UserError("give --machine PRESET|FILE (or --devices N for this host's MPI ranks)")
    return f"cpu:{devices}"


def zero_stage(request: PlanRequest, rule: Rule | None) -> ZeroStage:
    """``--strategy zero``'s stage (2 unless ``--zero-stage`` says 1 or 3); context
    parallelism's and a pipeline's where ``--zero-stage`` gives one (their weights are
    replicated over a stage's or the sequence's devices, which ZeRO shards them over);
    else none."""
    if rule in (Rule.CONTEXT, Rule.PIPELINE) and request.zero_stage:
        return ZeroStage(request.zero_stage)
    if rule is not Rule.ZERO:
        return ZeroStage.NONE
    return ZeroStage(request.zero_stage or ZeroStage.GRADIENTS)


def _bucket_mb(value: float) -> float:
    try:
        return check_bucket_mb(value)
    except ValueError as e:
        raise UserError(f"--bucket-mb: {e}") from e
