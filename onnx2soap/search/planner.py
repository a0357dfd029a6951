"""The planner's order: a ``PlanRequest`` in, the ``Plan`` and how it was found out.

By rule (``strategy``): the rule's plan, priced beside the baselines. By search: the
MCMC walk (search/mcmc.py, the margin rule inside it), then ZeRO, pipelines and
recomputation priced after the walk and the walk inside the best pipeline
(search/pipeline_choice.py); where nothing fits, the refusal names the nearest plan.
With a start (an annotated model): its plan stands unless the search beats it.

Nothing here prints or exits: errors are raised (onnx2soap/errors.py), a rule's plan
that does not fit is a warning in ``Planning.warnings``. The command line (cli/
plan_cmd.py) and the Python API (onnx2soap/api.py) both call ``make_plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from onnx2soap.errors import UserError
from onnx2soap.importer import load_model
from onnx2soap.ir import Graph, LossKind
from onnx2soap.precision import Precision
from onnx2soap.search.baselines import BASELINES, Rule, build
from onnx2soap.search.ilp import IlpOptions, IlpResult
from onnx2soap.search.mcmc import (
    Progress,
    SearchOptions,
    SearchResult,
    closest_words,
    mcmc,
    unfit_message,
)
from onnx2soap.search.piped import Piped, more_baselines, plan_pipeline, shape
from onnx2soap.search.pipeline_choice import Candidate, Choice, Pricing, pipeline_choice
from onnx2soap.search.pipeline_rule import Recompute, recompute_list
from onnx2soap.search.plan_request import Mode, PlanRequest, decide, machine_spec, zero_stage
from onnx2soap.search.start import Start, StartResult, kept_start, read_start
from onnx2soap.sim import Evaluation, Machine, Simulator, make_simulator, resolve_machine
from onnx2soap.sim.chosen_costs import ChosenCosts, choose_costs
from onnx2soap.sim.memory import OPTIMIZER_SLOTS
from onnx2soap.soap import Partitioner, Plan, Predicted, SearchInfo, Strategy, analyze, plan_ops
from onnx2soap.soap import validate as validate_strategy
from onnx2soap.soap.zero import Zero, ZeroStage, check_zero

PIPELINE_MIN_S = 10.0


@dataclass(frozen=True)
class Outcome:
    strategy: Strategy
    chosen: Evaluation
    baselines: dict[str, Evaluation]
    search: SearchInfo | None
    time_s: float = 0.0  # reported, never written: the plan file stays reproducible
    ilp: IlpResult | None = None  # the ILP's build and solve times and gap, reported
    walk: SearchResult | None = None  # the search's starts and walks, reported
    choice: Choice | None = None  # the search's pipelines and recomputation, reported


@dataclass(frozen=True)
class Planning:
    """A plan made, with what the command line reports of how."""

    plan: Plan
    graph: Graph  # the graph the plan's ops are on: a pipeline's is a microbatch's
    machine: Machine
    mode: Mode
    costs: ChosenCosts
    outcome: Outcome
    started: StartResult | None
    warnings: tuple[str, ...]  # e.g. a rule's plan that does not fit in device memory


def make_plan(
    request: PlanRequest,
    progress: Callable[[Progress], None] | None = None,
    mode: Mode | None = None,
) -> Planning:
    """The plan ``request`` asks for. ``progress``: called as the search goes on.
    ``mode``: ``decide(request)``, where the caller checked it already."""
    r = request
    mode = mode or decide(r)
    spec = machine_spec(r.machine, r.devices)
    machine = resolve_machine(spec)
    if r.margin is not None:
        machine = replace(machine, margin=r.margin)
    costs = choose_costs(spec, machine, r.costs)  # a foreign cost DB: refused before work
    model = load_model(r.model, r.batch, _loss(r))
    graph = model.graph
    if graph.loss_op is None:
        raise UserError(
            f"{r.model}: the model has no loss to train with (--loss none); "
            "choose --loss cross-entropy or mse"
        )
    space = analyze(graph)
    _check_dims(space)
    costs = costs.for_graph(graph, machine)
    setup = _Setup(r, graph, space, machine, costs, Precision(r.precision), mode)
    made = _made(setup, progress)
    outcome, piped = made.outcome, made.piped
    if made.zero:  # a machine of one device replicates nothing: say so before writing
        # the replica groups alone: a whole partition's edges and sums (a 70B-shaped
        # Llama's Megatron-LM plan on 256 GPUs) took seconds more
        partitioner, configs = Partitioner(graph), outcome.strategy
        groups = (g for op in graph.ops for g in partitioner.groups(op, configs[op.name]))
        how = mode.rule.value if mode.rule is not None else "zero"
        stage = int(made.zero.top)
        check_zero(made.zero, groups, str(r.model), f"--strategy {how} --zero-stage {stage}")
    on = (piped.graph, piped.space) if piped else (graph, space)
    plan = Plan(
        model_path=Path(r.model),
        model_sha256=model.sha256,
        batch=graph.batch,
        loss=graph.loss,
        devices=machine.size,
        ops=plan_ops(outcome.strategy, *on),
        machine=spec,
        predicted=_predicted(outcome),
        search=outcome.search,
        precision=setup.precision,
        zero_stage=made.zero.stage,
        zero_weights=made.zero.weights,
        pipeline=piped.pipeline if piped else None,
        recompute=piped.recompute if piped else made.recompute,
        bucket_mb=mode.bucket_mb,
    )
    return Planning(plan, on[0], machine, mode, costs, outcome, made.started, made.warnings)


@dataclass(frozen=True)
class _Setup:
    """What every way of making the plan reads."""

    request: PlanRequest
    graph: Graph
    space: dict
    machine: Machine
    costs: ChosenCosts
    precision: Precision
    mode: Mode

    @property
    def slots(self) -> int:
        return OPTIMIZER_SLOTS[self.request.optimizer]

    def simulator(self, zero: Zero | ZeroStage = ZeroStage.NONE, recompute=()) -> Simulator:
        return make_simulator(
            self.machine,
            self.costs.model,
            self.slots,
            self.precision,
            zero,
            recompute=recompute,
            bucket_mb=self.mode.bucket_mb,
        )


@dataclass(frozen=True)
class _Made:
    outcome: Outcome
    zero: Zero
    recompute: tuple[str, ...]
    piped: Piped | None
    started: StartResult | None = None
    warnings: tuple[str, ...] = ()


def _made(s: _Setup, progress: Callable[[Progress], None] | None) -> _Made:
    """The plan by search, from the start, or by rule; then the baselines by rule."""
    r, rule = s.request, s.mode.rule
    simulator = s.simulator()
    pipeline_shape = None
    if rule is Rule.PIPELINE:  # refused in one line before any work where it cannot be
        pipeline_shape = shape(r, s.machine, s.graph)
    start = None
    if r.start:
        start = read_start(
            r, s.graph, s.machine, s.costs.model, s.slots, s.precision, s.mode.bucket_mb
        )
    if s.mode.searching:
        made = _searched(s, simulator, start, progress)
    elif start is not None:
        outcome = _from_start(start, s.graph, s.space, simulator)
        plan = start.plan
        started = StartResult(str(r.start), start.evaluation, kept=True)
        made = _Made(outcome, plan.zero, plan.recompute, start.piped, started)
    else:
        made = _ruled(s, simulator, pipeline_shape)
    if s.mode.searching:  # the search's baselines are its starts: a plan beats them all
        return made
    extra = more_baselines(r, s.graph, s.space, s.machine, s.costs, s.slots, s.precision)
    if rule is Rule.ZERO:  # the plan's own stage stands for it
        extra.pop(Rule.ZERO.value, None)
    baselines = {**made.outcome.baselines, **extra}
    return replace(made, outcome=replace(made.outcome, baselines=baselines))


def _searched(
    s: _Setup,
    simulator: Simulator,
    start: Start | None,
    progress: Callable[[Progress], None] | None,
) -> _Made:
    # a plain start (no pipeline: the walk splits one graph) is walked from too
    walked = (("start", start.strategy),) if start and start.plan.pipeline is None else ()
    outcome = _search(s.request, s.graph, s.space, simulator, progress, walked)
    # what follows prices plans on simulators of its own: the walk's memo of durations
    # and per-op memory goes (LLaMA-3-8B on 128 GPUs: 40,000 ops' memory, 0.25 GB)
    simulator.memo.forget()
    pricing = Pricing(s.machine, s.slots, s.precision, s.mode.bucket_mb)
    found = _outer(s.request, outcome, s.graph, s.space, s.costs, pricing)
    if start is None:
        return found
    started = kept_start(start, found.outcome.chosen)
    if not started.kept:
        return replace(found, started=started)
    outcome = replace(found.outcome, strategy=start.strategy, chosen=start.evaluation)
    plan = start.plan
    return _Made(outcome, plan.zero, plan.recompute, start.piped, started)


def _ruled(s: _Setup, simulator: Simulator, pipeline_shape) -> _Made:
    r, rule = s.request, s.mode.rule
    zero = zero_stage(r, rule)
    recompute = recompute_list(Recompute(r.recompute), s.graph, s.space, simulator)
    piped = None
    if pipeline_shape is not None:
        piped = plan_pipeline(
            r,
            s.graph,
            s.machine,
            s.costs,
            s.slots,
            s.precision,
            *pipeline_shape,
            Recompute(r.recompute),
            zero,
        )
    plain = not zero and not recompute
    chosen_by = None if plain else s.simulator(zero, recompute)
    outcome = _by_rule(r, rule, s.graph, s.space, simulator, chosen_by, piped)
    warnings = ()
    if not outcome.chosen.fits:
        warnings = (f"the {rule.value} plan does not fit in device memory",)
    return _Made(outcome, Zero.of(zero), recompute, piped, warnings=warnings)


def _predicted(outcome: Outcome) -> Predicted:
    chosen = outcome.chosen
    return Predicted(
        step_time_s=chosen.step_time_s,
        peak_memory_bytes=chosen.peak_memory_bytes,
        bytes_moved=chosen.bytes_moved,
        baselines=tuple((k, v.step_time_s) for k, v in outcome.baselines.items()),
        infeasible=tuple(k for k, v in outcome.baselines.items() if not v.fits),
    )


def _loss(request: PlanRequest) -> LossKind | None:
    return LossKind(request.loss) if request.loss else None


def _search(
    r: PlanRequest,
    graph: Graph,
    space,
    simulator: Simulator,
    progress: Callable[[Progress], None] | None,
    starts: tuple[tuple[str, Strategy], ...] = (),
) -> Outcome:
    """The walk, from the rules' plans and ``starts`` (``--start``'s)."""
    # a walk whose plans all overflow goes on: a pipeline or recomputation may fit
    options = SearchOptions(r.budget, r.seed, r.beta, r.max_evals, must_fit=False, starts=starts)
    result = mcmc(graph, space, simulator, options, progress)
    info = SearchInfo("mcmc", r.seed, r.budget, result.evaluated)
    return Outcome(
        result.best,
        result.evaluation,
        dict(result.baselines),
        info,
        result.time_s,
        result.ilp,
        result,
    )


def _outer(
    r: PlanRequest, outcome: Outcome, graph: Graph, space, costs: ChosenCosts, pricing: Pricing
) -> _Made:
    """``pipeline_choice`` after the walk and its ZeRO stage: the plan it chooses, if
    any, replaces the walk's; its by-rule ``pipeline`` and ``zero`` join the baselines.
    Nothing that fits at all: the walk's refusal."""
    walk = outcome.walk

    def load(batch: int):
        return load_model(r.model, batch, _loss(r)).graph

    # the pricing's own bound, beside the walk's budget: half of it, 10 s at least
    max_s = max(PIPELINE_MIN_S, choice_bound(r.budget, outcome.time_s))
    # the walk inside the best pipeline gets as long again
    choice = pipeline_choice(
        graph,
        space,
        load,
        costs.model,
        pricing,
        walk.best,
        walk.evaluation,
        walk.zero_stage,
        max_s,
        max_s,
        r.seed,
    )
    c: Candidate | None = choice.chosen
    if c is None and walk.unfit:
        raise UserError(_refusal(walk.unfit, walk, choice, pricing))
    baselines = {**outcome.baselines, **{k: v.evaluation for k, v in choice.baselines.items()}}
    outcome = replace(outcome, baselines=baselines, choice=choice)
    if c is None:
        return _Made(outcome, walk.zero, (), None)
    outcome = replace(outcome, strategy=c.strategy, chosen=c.evaluation)
    if c.pipeline is None:
        return _Made(outcome, c.zero, c.recompute, None)
    piped = Piped(c.strategy, c.pipeline, c.graph, c.space, c.recompute, c.evaluation)
    return _Made(outcome, c.zero, c.recompute, piped)


# The choice after the search takes CHOICE_SHARES of its bound in all: the grid one,
# the extras to one and a half, the walk inside the best pipeline one more.
CHOICE_SHARES = 2.5


def choice_bound(budget: float, searched_s: float) -> float:
    """The choice's bound: half the budget, less what the search took past the budget
    (ZeRO's pricing after the walk: a 70B-shaped Llama on 256 GPUs, 75-120 s), spread
    over the choice's shares: planning's whole time counts it once."""
    over = max(0.0, searched_s - budget)
    return budget / 2 - over / CHOICE_SHARES


def _refusal(unfit: str, walk: SearchResult, choice: Choice, pricing: Pricing) -> str:
    """The walk's refusal ``unfit``, naming instead the plan priced after it (a
    pipeline, a plan recomputing) where that one came nearer: the walk's nearest alone
    had GPT-1.3B on 64 V100s needing 125.6 GiB where a pipeline needed 24.6."""
    near = min(choice.tried, key=lambda c: max(c.evaluation.peak_memory_bytes), default=None)
    if near is None:
        return unfit
    peak = max(near.evaluation.peak_memory_bytes)
    if peak >= max(walk.evaluation.peak_memory_bytes):
        return unfit
    memory = max(d.memory for d in pricing.machine.devices)
    return unfit_message(closest_words(candidate_words(near), peak, memory))


def candidate_words(c: Candidate) -> str:
    """A plan priced after the walk, in words: its pipeline's shape, or whose plan it
    recomputes, or ZeRO's data parallelism."""
    if c.pipeline is not None:
        redo = f", recomputing {len(c.recompute)} ops" if c.recompute else ""
        zero = f", {c.zero.label}" if c.zero else ""
        if len(c.pipeline.stages) == 1:
            return f"data parallel accumulating {c.pipeline.microbatches} microbatches{zero}{redo}"
        return (
            f"{len(c.pipeline.stages)} stages x {c.pipeline.microbatches} microbatches, "
            f"{c.pipeline.schedule.value}{zero}{redo}"
        )
    if c.recompute:
        whose = "the walk's plan" if c.of == "walk" else c.of
        how = " selectively (the products kept)" if c.selective else ""
        return f"{whose} recomputing {len(c.recompute)} ops{how}"
    return f"data parallel under ZeRO-{int(c.zero_stage)}"


def _by_rule(
    r: PlanRequest,
    rule: Rule,
    graph: Graph,
    space,
    simulator: Simulator,
    chosen_by: Simulator | None = None,
    piped: Piped | None = None,
) -> Outcome:
    """``chosen_by``: the chosen plan's simulator where it is not plain (its ZeRO stage,
    its recomputation), which prices it (and ``--strategy zero``'s "zero" line among the
    baselines); the baselines are plain. ``piped``: the pipeline rule's plan, built and
    priced already."""
    partitioner, devices = Partitioner(graph), simulator.machine.size

    def evaluate(strategy: Strategy, by: Simulator = simulator) -> Evaluation:
        return by.evaluate(partitioner.partition(strategy))

    # --strategy ilp: the solver's time limit is the budget
    ilp_options = IlpOptions(max(r.budget, 0.1)) if rule is Rule.ILP else None
    built = {}
    if not piped:
        built[rule] = build(
            rule,
            graph,
            space,
            devices,
            r.seed,
            simulator,
            ilp_options,
            sequence_parallel=r.sequence_parallel,
            head_tail=r.head_tail,
        )
    for b in BASELINES:
        if b not in built:
            built[b] = build(b, graph, space, devices, 0, simulator)
    if piped is None:
        strategy = built[rule].strategy
        validate_strategy(graph, space, strategy)
        chosen = evaluate(strategy, chosen_by or simulator)
    else:
        strategy, chosen = piped.strategy, piped.evaluation
    baselines = {b.value: evaluate(built[b].strategy) for b in BASELINES}
    if rule is Rule.ZERO:
        baselines[Rule.ZERO.value] = chosen
    return Outcome(strategy, chosen, baselines, None, ilp=built[Rule.ILP].ilp)


def _from_start(start: Start, graph: Graph, space, simulator: Simulator) -> Outcome:
    """``--start`` with ``--search none``: the start is the plan, beside the baselines."""
    partitioner, devices = Partitioner(graph), simulator.machine.size
    built = {r: build(r, graph, space, devices, 0, simulator) for r in BASELINES}
    baselines = {
        r.value: simulator.evaluate(partitioner.partition(b.strategy)) for r, b in built.items()
    }
    return Outcome(start.strategy, start.evaluation, baselines, None, ilp=built[Rule.ILP].ilp)


def _check_dims(space) -> None:
    """Every dim must have a size: a zero-sized one leaves no config to run the op on."""
    for name, dims in space.items():
        empty = [d.name for d in dims if d.size < 1]
        if empty:
            raise UserError(f"op '{name}': dims {empty} have size 0; nothing to compute")
