"""``onnx2soap plan MODEL``: find (or build by rule) a plan and write the plan file.

Without ``--strategy`` the plan is found by MCMC search over the simulator of
``--machine``; with ``--strategy`` it is built by that rule and only simulated. With
``--start`` an annotated model's plan (ONNX multi-device annotations: cli/start_plan.py)
is the plan to beat, or with ``--search none`` the plan. ``--annotate`` also writes the
model with the plan as annotations.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from onnx2soap.cli.annotate_cmd import annotated, check_annotated_output
from onnx2soap.cli.common import add_model_options, loss_choice, seconds
from onnx2soap.cli.pipeline_plan import (
    Piped,
    add_pipeline_options,
    check_options,
    more_baselines,
    plan_pipeline,
    recompute_names,
    shape,
)
from onnx2soap.cli.profile_cmd import ChosenCosts, add_costs_option, choose_costs
from onnx2soap.cli.start_plan import Start, StartResult, kept_start, read_start, start_line
from onnx2soap.errors import UserError
from onnx2soap.files import check_output
from onnx2soap.importer import load_model
from onnx2soap.options import float_in, int_in
from onnx2soap.precision import Precision
from onnx2soap.search.baselines import BASELINES, Rule, build
from onnx2soap.search.ilp import IlpOptions, IlpResult
from onnx2soap.search.mcmc import (
    MAX_BETA,
    MAX_BUDGET_S,
    MAX_EVALS,
    MAX_SEED,
    Progress,
    SearchOptions,
    SearchResult,
    closest_words,
    mcmc,
    unfit_message,
)
from onnx2soap.search.pipeline_choice import Candidate, Choice, Pricing, pipeline_choice
from onnx2soap.search.pipeline_rule import Recompute
from onnx2soap.search.pipeline_walk import PipelineWalk
from onnx2soap.sim import Evaluation, Simulator, make_simulator, resolve_machine
from onnx2soap.sim.memory import OPTIMIZER_SLOTS
from onnx2soap.soap import (
    Partitioner,
    Plan,
    Predicted,
    SearchInfo,
    Strategy,
    analyze,
    plan_ops,
    save_plan,
)
from onnx2soap.soap import validate as validate_strategy
from onnx2soap.soap.annotations import write_annotated
from onnx2soap.soap.buckets import DEFAULT_BUCKET_MB, check_bucket_mb
from onnx2soap.soap.plan import MAX_DEVICES
from onnx2soap.soap.zero import ZERO_STAGES, ZeroStage, check_zero


def register(sub) -> None:
    p = sub.add_parser("plan", help="find a plan for a model and write the plan file")
    add_model_options(p)
    p.add_argument("--machine", help="preset (e.g. flexflow-p100:4, cpu:4) or machine file")
    p.add_argument(
        "--devices",
        type=int_in(1, MAX_DEVICES),
        help=f"shorthand for --machine cpu:N (1 to {MAX_DEVICES})",
    )
    p.add_argument(
        "--strategy",
        choices=[r.value for r in Rule],
        help="build the plan by this rule instead of searching",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=[int(z) for z in ZERO_STAGES],
        help="with --strategy zero (or context): 1 shards the optimizer's state across the "
        "replicas, 2 (the default with zero) also the summed gradients, 3 also the weights "
        "(each gathered before the ops that read it, as FSDP)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --strategy megatron: the norms, residual adds and dropouts between the "
        "tensor-parallel blocks split along the sequence inside each node (Megatron-LM's "
        "sequence parallelism); their inputs all-gathered, the row-parallel sums scattered",
    )
    add_pipeline_options(p)
    p.add_argument("--search", choices=["mcmc", "none"], help="default: mcmc unless --strategy")
    p.add_argument(
        "--budget",
        type=float_in(0, MAX_BUDGET_S),
        default=30.0,
        help="search time budget in seconds (with --strategy ilp: the solver's time limit)",
    )
    p.add_argument(
        "--margin",
        type=float_in(0, 0.99),
        help="the simulator's step error on this machine, a fraction (default: the machine "
        "file's margin, 0 for presets): among plans predicted within it of the fastest, "
        "the search keeps the one that moves the fewest bytes",
    )
    p.add_argument(
        "--max-evals",
        type=int_in(1, MAX_EVALS),
        help="stop after this many proposals evaluated (revisits included): reproducible",
    )
    p.add_argument(
        "--beta",
        type=float_in(0, MAX_BETA),
        default=SearchOptions.beta,
        help="MCMC inverse temperature (>= 0)",
    )
    p.add_argument(
        "--seed",
        type=int_in(0, MAX_SEED),
        default=0,
        help="seed of the search / random strategy",
    )
    add_costs_option(p)
    p.add_argument(
        "--optimizer",
        choices=list(OPTIMIZER_SLOTS),
        default="sgd",
        help="the optimizer the plan will train with: its state counts in device memory",
    )
    p.add_argument(
        "--precision",
        choices=[x.value for x in Precision],
        default=Precision.FP32.value,
        help="train in mixed precision (bf16, fp16): the simulator's costs and memory follow "
        "it, and the executor trains in it by default",
    )
    p.add_argument(
        "--start",
        metavar="ANNOTATED.onnx",
        help="this model with ONNX multi-device annotations (onnx2soap's or another "
        "tool's): its plan is kept unless the search finds a faster one; with --search "
        "none it is the plan",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_MB,
        help="MiB of weights whose gradients are summed together, filled in backward order "
        "as PyTorch DDP's buckets (default: %(default)g)",
    )
    p.add_argument("-o", "--output", required=True, help="plan file to write")
    p.add_argument(
        "--annotate",
        metavar="OUT.onnx",
        help="also write the model with the plan as ONNX multi-device annotations (in the "
        "folder of the model's external data, which it refers to)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def machine_spec(machine: str | None, devices: int | None) -> str:
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


def draw_progress(p: Progress) -> None:
    width = 30
    filled = min(width, int(width * p.elapsed_s / p.budget_s)) if p.budget_s > 0 else width
    bar = "#" * filled + "." * (width - filled)
    sys.stderr.write(
        f"\r[{bar}] {p.elapsed_s:5.1f}/{p.budget_s:.0f}s  {p.evaluated} simulated  "
        f"best {seconds(p.best_step_time_s)}   "
    )
    sys.stderr.flush()


def _mode(args) -> tuple[Rule | None, bool]:
    if args.strategy and args.search == "mcmc":
        raise UserError(
            "--strategy builds a plan by rule; it cannot be combined with --search mcmc"
        )
    if args.zero_stage is not None and args.strategy not in (Rule.ZERO.value, Rule.CONTEXT.value):
        raise UserError(
            "--zero-stage goes with --strategy zero (data parallelism with ZeRO) or "
            "--strategy context"
        )
    if args.sequence_parallel and args.strategy != Rule.MEGATRON.value:
        raise UserError("--sequence-parallel goes with --strategy megatron")
    if args.start and args.strategy:
        raise UserError("--start gives the plan to start from; it cannot go with --strategy")
    if args.start and args.recompute != "none":
        raise UserError("--start's plan keeps its own recomputation; drop --recompute")
    check_options(args, searching=not args.strategy and args.search != "none")
    if args.strategy:
        return Rule(args.strategy), False
    if args.search == "none":
        return (None, False) if args.start else (Rule.DATA_PARALLEL, False)
    return None, True


@dataclass(frozen=True)
class _Outcome:
    strategy: Strategy
    chosen: Evaluation
    baselines: dict[str, Evaluation]
    search: SearchInfo | None
    time_s: float = 0.0  # reported, never written: the plan file stays reproducible
    ilp: IlpResult | None = None  # the ILP's build and solve times and gap, reported
    walk: SearchResult | None = None  # the search's starts and walks, reported
    choice: Choice | None = None  # the search's pipelines and recomputation, reported


def _search(args, graph, space, simulator: Simulator) -> _Outcome:
    # a walk whose plans all overflow goes on: a pipeline or recomputation may fit
    options = SearchOptions(args.budget, args.seed, args.beta, args.max_evals, must_fit=False)
    show = None if args.quiet or args.json or not sys.stderr.isatty() else draw_progress
    result = mcmc(graph, space, simulator, options, show)
    if show:
        sys.stderr.write("\n")
    info = SearchInfo("mcmc", args.seed, args.budget, result.evaluated)
    return _Outcome(
        result.best,
        result.evaluation,
        dict(result.baselines),
        info,
        result.time_s,
        result.ilp,
        result,
    )


PIPELINE_MIN_S = 10.0


@dataclass(frozen=True)
class _Searched:
    """The search's plan after its outer choice: a pipeline's on the microbatch's model."""

    outcome: _Outcome
    zero: ZeroStage
    recompute: tuple[str, ...]
    piped: Piped | None


def _outer(args, outcome: _Outcome, graph, space, machine, costs, pricing) -> _Searched:
    """``pipeline_choice`` after the walk and its ZeRO stage: the plan it chooses, if
    any, replaces the walk's; its by-rule ``pipeline`` and ``zero`` join the baselines.
    Nothing that fits at all: the walk's refusal."""
    walk = outcome.walk

    def load(batch: int):
        return load_model(args.model, batch, loss_choice(args.loss)).graph

    # the pricing's own bound, beside the walk's budget: half of it, 10 s at least
    max_s = max(PIPELINE_MIN_S, args.budget / 2)
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
        args.seed,
    )
    c: Candidate | None = choice.chosen
    if c is None and walk.unfit:
        raise UserError(_refusal(walk.unfit, walk, choice, pricing))
    baselines = {**outcome.baselines, **{k: v.evaluation for k, v in choice.baselines.items()}}
    outcome = replace(outcome, baselines=baselines, choice=choice)
    if c is None:
        return _Searched(outcome, walk.zero_stage, (), None)
    outcome = replace(outcome, strategy=c.strategy, chosen=c.evaluation)
    if c.pipeline is None:
        return _Searched(outcome, c.zero_stage, c.recompute, None)
    piped = Piped(c.strategy, c.pipeline, c.graph, c.space, c.recompute, c.evaluation)
    return _Searched(outcome, c.zero_stage, c.recompute, piped)


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
    return unfit_message(closest_words(_candidate_words(near), peak, memory))


def _zero_stage(args, rule: Rule | None) -> ZeroStage:
    """``--strategy zero``'s stage (2 unless ``--zero-stage`` says 1 or 3); context
    parallelism's where ``--zero-stage`` gives one (its weights are replicated over the
    sequence's devices, as FSDP with context parallelism shards them); else none."""
    if rule is Rule.CONTEXT and args.zero_stage:
        return ZeroStage(args.zero_stage)
    if rule is not Rule.ZERO:
        return ZeroStage.NONE
    return ZeroStage(args.zero_stage or ZeroStage.GRADIENTS)


def _by_rule(
    args,
    rule: Rule,
    graph,
    space,
    simulator: Simulator,
    chosen_by: Simulator | None = None,
    piped: Piped | None = None,
) -> _Outcome:
    """``chosen_by``: the chosen plan's simulator where it is not plain (its ZeRO stage,
    its recomputation), which prices it (and ``--strategy zero``'s "zero" line among the
    baselines); the baselines are plain. ``piped``: the pipeline rule's plan, built and
    priced already."""
    partitioner, devices = Partitioner(graph), simulator.machine.size

    def evaluate(strategy: Strategy, by: Simulator = simulator) -> Evaluation:
        return by.evaluate(partitioner.partition(strategy))

    # --strategy ilp: the solver's time limit is the budget
    ilp_options = IlpOptions(max(args.budget, 0.1)) if rule is Rule.ILP else None
    built = (
        {}
        if piped
        else {
            rule: build(
                rule,
                graph,
                space,
                devices,
                args.seed,
                simulator,
                ilp_options,
                sequence_parallel=args.sequence_parallel,
            )
        }
    )
    for r in BASELINES:
        if r not in built:
            built[r] = build(r, graph, space, devices, 0, simulator)
    if piped is None:
        strategy = built[rule].strategy
        validate_strategy(graph, space, strategy)
        chosen = evaluate(strategy, chosen_by or simulator)
    else:
        strategy, chosen = piped.strategy, piped.evaluation
    if not chosen.fits:
        print(
            f"onnx2soap: warning: the {rule.value} plan does not fit in device memory",
            file=sys.stderr,
        )
    baselines = {r.value: evaluate(built[r].strategy) for r in BASELINES}
    if rule is Rule.ZERO:
        baselines[Rule.ZERO.value] = chosen
    return _Outcome(strategy, chosen, baselines, None, ilp=built[Rule.ILP].ilp)


def _bucket_mb(value: float) -> float:
    try:
        return check_bucket_mb(value)
    except ValueError as e:
        raise UserError(f"--bucket-mb: {e}") from e


def _check_dims(space) -> None:
    """Every dim must have a size: a zero-sized one leaves no config to run the op on."""
    for name, dims in space.items():
        empty = [d.name for d in dims if d.size < 1]
        if empty:
            raise UserError(f"op '{name}': dims {empty} have size 0; nothing to compute")


def run(args: argparse.Namespace) -> int:
    rule, searching = _mode(args)
    bucket_mb = _bucket_mb(args.bucket_mb)
    check_output(args.output)  # before the search, not after it
    if args.annotate:
        check_annotated_output(args.annotate)
    spec = machine_spec(args.machine, args.devices)
    machine = resolve_machine(spec)
    if args.margin is not None:
        machine = replace(machine, margin=args.margin)
    costs = choose_costs(spec, machine, args.costs)  # a foreign cost DB: refused before work
    model = load_model(args.model, args.batch, loss_choice(args.loss))
    graph = model.graph
    if graph.loss_op is None:
        raise UserError(
            f"{args.model}: the model has no loss to train with (--loss none); "
            "choose --loss cross-entropy or mse"
        )
    space = analyze(graph)
    _check_dims(space)
    costs = costs.for_graph(graph, machine)
    precision = Precision(args.precision)
    slots = OPTIMIZER_SLOTS[args.optimizer]
    simulator = make_simulator(machine, costs.model, slots, precision, bucket_mb=bucket_mb)
    zero = _zero_stage(args, rule)
    recompute, piped = recompute_names(args, graph, space, simulator), None
    if rule is Rule.PIPELINE:  # refused in one line before any work where it cannot be
        stages, microbatches, schedule = shape(args, machine, graph)
    start = None
    if args.start:
        start = read_start(args, graph, machine, costs.model, slots, precision, bucket_mb)
    started: StartResult | None = None
    if searching:
        outcome = _search(args, graph, space, simulator)
        pricing = Pricing(machine, slots, precision, bucket_mb)
        found = _outer(args, outcome, graph, space, machine, costs, pricing)
        # the search's choices: its plan is priced under them
        outcome, zero, recompute, piped = found.outcome, found.zero, found.recompute, found.piped
        if start is not None:
            started = kept_start(start, outcome.chosen)
            if started.kept:
                outcome = replace(outcome, strategy=start.strategy, chosen=start.evaluation)
                zero, recompute, piped = start.plan.zero_stage, start.plan.recompute, start.piped
    elif start is not None:
        outcome = _from_start(start, graph, space, simulator)
        zero, recompute, piped = start.plan.zero_stage, start.plan.recompute, start.piped
        started = StartResult(str(args.start), start.evaluation, kept=True)
    else:
        if rule is Rule.PIPELINE:
            piped = plan_pipeline(
                args,
                graph,
                machine,
                costs,
                slots,
                precision,
                stages,
                microbatches,
                schedule,
                Recompute(args.recompute),
            )
        chosen_by = make_simulator(
            machine, costs.model, slots, precision, zero, recompute=recompute, bucket_mb=bucket_mb
        )
        plain = not zero and not recompute
        outcome = _by_rule(args, rule, graph, space, simulator, None if plain else chosen_by, piped)
    if not searching:  # the search's baselines are its starts: a plan beats them all
        extra = more_baselines(args, graph, space, machine, costs, slots, precision)
        if rule is Rule.ZERO:  # the plan's own stage stands for it
            extra.pop(Rule.ZERO.value, None)
        outcome = replace(outcome, baselines={**outcome.baselines, **extra})
    if zero:  # a machine of one device replicates nothing: say so before writing
        pg = Partitioner(graph).partition(outcome.strategy)
        groups = (g for gs in pg.groups.values() for g in gs)
        strategy = rule.value if rule is not None else "zero"
        check_zero(zero, groups, str(args.model), f"--strategy {strategy} --zero-stage {int(zero)}")
    chosen = outcome.chosen
    predicted = Predicted(
        step_time_s=chosen.step_time_s,
        peak_memory_bytes=chosen.peak_memory_bytes,
        bytes_moved=chosen.bytes_moved,
        baselines=tuple((k, v.step_time_s) for k, v in outcome.baselines.items()),
        infeasible=tuple(k for k, v in outcome.baselines.items() if not v.fits),
    )
    plan = Plan(
        model_path=Path(args.model),
        model_sha256=model.sha256,
        batch=graph.batch,
        loss=graph.loss,
        devices=machine.size,
        ops=plan_ops(outcome.strategy, *((piped.graph, piped.space) if piped else (graph, space))),
        machine=spec,
        predicted=predicted,
        search=outcome.search,
        precision=precision,
        zero_stage=zero,
        pipeline=piped.pipeline if piped else None,
        recompute=piped.recompute if piped else recompute,
        bucket_mb=bucket_mb,
    )
    # made in full before either file is written: a refusal leaves neither half-written
    made = (
        annotated(plan, Path(args.model), piped.graph if piped else graph, Path(args.annotate))
        if args.annotate
        else None
    )
    save_plan(plan, args.output)
    if made is not None:
        write_annotated(made, Path(args.annotate))
    _report(
        args,
        plan,
        machine.name,
        machine.margin,
        searching,
        outcome.time_s,
        costs,
        outcome.ilp,
        outcome.walk,
        outcome.choice,
        started,
    )
    return 0


def _from_start(start: Start, graph, space, simulator: Simulator) -> _Outcome:
    """``--start`` with ``--search none``: the start is the plan, beside the baselines."""
    partitioner, devices = Partitioner(graph), simulator.machine.size
    built = {r: build(r, graph, space, devices, 0, simulator) for r in BASELINES}
    baselines = {
        r.value: simulator.evaluate(partitioner.partition(b.strategy)) for r, b in built.items()
    }
    return _Outcome(start.strategy, start.evaluation, baselines, None, ilp=built[Rule.ILP].ilp)


def _ilp_doc(ilp: IlpResult) -> dict:
    return {
        "status": ilp.status,
        "objective_s": ilp.objective_s,
        "bound_s": ilp.bound_s,
        "gap": ilp.gap,
        "build_s": ilp.build_s,
        "solve_s": ilp.solve_s,
        "decisions": ilp.decisions,
        "variables": ilp.variables,
        "constraints": ilp.constraints,
    }


def _finite(seconds: float) -> float | None:
    """JSON has no infinity: a walk that found nothing that fits is null."""
    return seconds if math.isfinite(seconds) else None


def _walk_doc(result: SearchResult | None) -> dict:
    """Where the search started and what its walk added: the fastest start that fits
    (``best_start``), the walk's gain over it (its step time over the plan's: 1.0 when
    the walk found nothing better), and each distinct start's walk; null by rule."""
    if result is None:
        return {"best_start": None, "walk_gain": None, "walks": None}
    best = result.best_start
    return {
        "best_start": None
        if best is None
        else {"name": best, "step_time_s": result.starts[best].step_time_s},
        "walk_gain": result.walk_gain,
        "walks": [
            {
                "start": w.names[0],
                "also": list(w.names[1:]),
                "start_step_time_s": w.start_step_time_s,
                "start_fits": w.start_fits,
                "best_step_time_s": _finite(w.best_step_time_s),
                "proposals": w.proposals,
                "rounds": w.rounds,
            }
            for w in result.walks
        ],
    }


def _choice_doc(choice: Choice | None) -> dict:
    """Every pipeline and recomputing plan the search priced after its walk (``stages``
    0: a plain plan, ``of`` whose: the walk's or a rule's recomputing), the one chosen
    (null: the walk's plan stands; ``stages`` 0 without recomputation: the ``zero``
    baseline, faster than the walk's),
    the seconds it took and the grid shapes its time bound left, and the walk inside
    the best pipeline priced (``walked``: its plan, not the rule's); null by rule."""
    if choice is None:
        return {
            "pipeline_tried": None,
            "pipeline_chosen": None,
            "pipeline_s": None,
            "pipeline_skipped": None,
            "pipeline_walk": None,
        }
    walk = choice.walk
    walked = walk.best if walk and walk.best is not walk.start else None

    def shape(c: Candidate) -> dict:
        return {
            "stages": c.shape.stages,
            "microbatches": c.shape.microbatches,
            "schedule": c.shape.schedule.value if c.shape.schedule else None,
            "recompute": c.shape.recompute,
            "selective": c.selective,  # a plain plan recomputing all but the products
            "zero_stage": int(c.zero_stage),
            "of": c.of or None,  # a plain plan's: "walk", a rule's name, or "zero"
            "walked": c is walked,  # the walk inside a pipeline's best, not a rule's plan
        }

    tried = [
        {
            **shape(c),
            "step_time_s": c.evaluation.step_time_s,
            "peak_memory_bytes": max(c.evaluation.peak_memory_bytes),
            "fits": c.evaluation.fits,
        }
        for c in choice.tried
    ]
    chosen = shape(choice.chosen) if choice.chosen else None
    return {
        "pipeline_tried": tried,
        "pipeline_chosen": chosen,
        "pipeline_s": choice.time_s,
        "pipeline_skipped": choice.skipped,
        "pipeline_walk": _pipeline_walk_doc(choice.walk),
    }


def _pipeline_walk_doc(walk: PipelineWalk | None) -> dict | None:
    """The walk inside the best pipeline priced: the plan it started from and the one it
    ended at (per stage: its first op's index, its ops, its tensor-parallel degree), the
    moves it kept, the plans priced, seconds, and whether it ended at a local optimum
    (false: at its time bound). Null where no pipeline was priced."""
    if walk is None:
        return None
    layout = walk.layout
    bounds = (*layout.cuts, len(walk.best.graph.ops))
    return {
        "start_step_time_s": walk.start.evaluation.step_time_s,
        "start_fits": walk.start.evaluation.fits,
        "step_time_s": walk.best.evaluation.step_time_s,
        "fits": walk.best.evaluation.fits,
        "stages": [
            {"first_op": lo, "ops": hi - lo, "tensor_parallel": degree}
            for lo, hi, degree in zip(bounds, bounds[1:], layout.degrees, strict=False)
        ],
        "microbatches": layout.microbatches,
        "zero_stage": int(layout.zero),
        "recompute": [mode.value for mode in layout.recompute],  # per stage
        "kept": [
            {"move": k.move, "step_time_s": k.step_time_s, "overflow_bytes": k.overflow}
            for k in walk.kept
        ],
        "priced": walk.priced,
        "time_s": walk.time_s,
        "converged": walk.converged,
    }


def _pipeline_walk_line(walk: PipelineWalk) -> str:
    """The walk's start and end, each marked where it does not fit: a walk from a start
    that does not fit may end slower, at a plan that does."""
    degrees = "/".join(str(d) for d in walk.layout.degrees)
    ended = "a local optimum" if walk.converged else "its time bound"
    start, best = walk.start.evaluation, walk.best.evaluation
    return (
        f"  walk inside the pipeline: {_step_and_fit(start)} -> {_step_and_fit(best)} "
        f"({len(walk.kept)} moves kept, "
        f"{walk.priced} plans priced in {walk.time_s:.1f}s, ended at {ended}); "
        f"tensor parallel per stage {degrees}, {walk.layout.microbatches} microbatches, "
        f"ZeRO-{int(walk.layout.zero)}"
    )


def _step_and_fit(evaluation: Evaluation) -> str:
    step = seconds(evaluation.step_time_s)
    return step if evaluation.fits else f"{step} (does not fit)"


def _chosen_words(c: Candidate | None) -> str:
    if c is None:
        return "the walk's plan stands (none fits and is 1 % faster)"
    faster = " (a baseline, faster)" if c.pipeline is None and not c.recompute else ""
    return f"chosen: {_candidate_words(c)}{faster}"


def _candidate_words(c: Candidate) -> str:
    """A plan priced after the walk, in words: its pipeline's shape, or whose plan it
    recomputes, or ZeRO's data parallelism."""
    if c.pipeline is not None:
        redo = f", recomputing {len(c.recompute)} ops" if c.recompute else ""
        return (
            f"{c.shape.stages} stages x {c.shape.microbatches} microbatches, "
            f"{c.pipeline.schedule.value}{redo}"
        )
    if c.recompute:
        whose = "the walk's plan" if c.of == "walk" else c.of
        how = " selectively (the products kept)" if c.selective else ""
        return f"{whose} recomputing {len(c.recompute)} ops{how}"
    return f"data parallel under ZeRO-{int(c.zero_stage)}"


def _walk_line(result: SearchResult) -> str:
    best = result.best_start
    if result.unfit:
        return "  walk: nothing it found fits in device memory"
    if best is None:
        return "  walk: no start fits in device memory; the plan is the walk's own"
    start = result.starts[best].step_time_s
    gain = result.walk_gain or 1.0
    if gain <= 1.0:
        return f"  walk: {best} ({seconds(start)}) is the best start; the walk found nothing faster"
    reached = result.passed_over or result.evaluation
    return (
        f"  walk: from {best} ({seconds(start)}) to {seconds(reached.step_time_s)}, "
        f"{gain:.2f}x in {result.proposals} proposals"
    )


def _margin_doc(walk: SearchResult | None, margin: float) -> dict:
    """The machine's margin and, where it kept a start in place of the plan predicted
    fastest (``search/margin.py``), that plan's step and bytes."""
    over = walk.passed_over if walk else None
    fastest = None
    if over is not None:
        fastest = {"step_time_s": over.step_time_s, "bytes_moved": over.bytes_moved}
    return {"fraction": margin, "kept": walk.best_from if over else None, "passed_over": fastest}


def _margin_line(walk: SearchResult, margin: float) -> str:
    over, kept = walk.passed_over, walk.evaluation
    slower = kept.step_time_s / over.step_time_s - 1
    return (
        f"  margin: kept {walk.best_from} ({kept.bytes_moved / 2**20:.2f} MiB moved a step), "
        f"predicted {slower:.0%} slower than the fastest plan found "
        f"({seconds(over.step_time_s)}, {over.bytes_moved / 2**20:.2f} MiB): inside this "
        f"machine's {margin:.0%} margin"
    )


def _report(
    args,
    plan: Plan,
    machine: str,
    margin: float,
    searching: bool,
    time_s: float,
    costs: ChosenCosts,
    ilp: IlpResult | None,
    walk: SearchResult | None = None,
    choice: Choice | None = None,
    started: StartResult | None = None,
) -> None:
    p, s = plan.predicted, plan.search
    baselines = dict(p.baselines)
    if args.json:
        doc = {
            "plan": str(args.output),
            "predicted_step_time_s": p.step_time_s,
            "baselines": baselines,
            "infeasible_baselines": list(p.infeasible),
            "evaluated": s.evaluated if s else 1,
            "search_time_s": time_s,
            "costs": costs.name,
            "precision": plan.precision.value,
            "zero_stage": int(plan.zero_stage),
            "ilp": _ilp_doc(ilp) if ilp else None,
            **_walk_doc(walk),
            **_choice_doc(choice),
            "margin": _margin_doc(walk, margin),
            "start": started.document() if started else None,
        }
        print(json.dumps(doc))
        return
    how = args.strategy or ("the start" if args.start else "data-parallel")
    if searching:
        noun = "strategy" if s.evaluated == 1 else "strategies"
        how = f"MCMC ({s.evaluated} {noun} simulated in {time_s:.1f}s)"
    print(f"wrote {args.output}: {how} on {machine}")
    print(f"  costs: {costs.description}")
    if started:
        print(start_line(started, searching))
    if args.annotate:
        print(f"  annotated model: {args.annotate}")
    if plan.zero_stage:
        print(f"  ZeRO: stage {int(plan.zero_stage)} (replicated weights' state sharded)")
    if plan.pipeline:
        pipe = plan.pipeline
        sizes = ", ".join(str(len(ops)) for ops in pipe.stages)
        print(
            f"  pipeline: {len(pipe.stages)} stages ({sizes} ops), {pipe.microbatches} "
            f"microbatches of {plan.graph_batch}, {pipe.schedule.value}"
        )
    if plan.recompute:
        print(f"  recompute: {len(plan.recompute)} ops' activations, in the backward")
    print(f"  {'predicted step time':<22}{seconds(p.step_time_s):>12}   plan's speed-up")
    for name, t in baselines.items():
        if name in p.infeasible:
            print(f"  {name:<22}{seconds(t):>12}   does not fit in device memory")
            continue
        speedup = t / p.step_time_s if p.step_time_s > 0 else float("inf")
        print(f"  {name:<22}{seconds(t):>12}   {speedup:.2f}x")
    if ilp:
        print(
            f"  ilp: {ilp.decisions} ops decide, {ilp.variables} variables; built in "
            f"{ilp.build_s:.1f}s, solved in {ilp.solve_s:.1f}s ({ilp.status}, gap {ilp.gap:.2%})"
        )
    if walk:
        print(_walk_line(walk))
        if walk.passed_over is not None:
            print(_margin_line(walk, margin))
    if choice:
        print(
            f"  pipelines and recomputation: {len(choice.tried)} plans priced in "
            f"{choice.time_s:.1f}s; {_chosen_words(choice.chosen)}"
        )
        if choice.skipped:
            print(f"  ({choice.skipped} pipeline shapes left unpriced: time bound)")
        if choice.walk:
            print(_pipeline_walk_line(choice.walk))
