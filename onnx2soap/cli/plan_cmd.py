"""``onnx2soap plan MODEL``: find (or build by rule) a plan and write the plan file.

Without ``--strategy`` the plan is found by MCMC search over the simulator of
``--machine``; with ``--strategy`` it is built by that rule and only simulated. With
``--start`` an annotated model's plan (ONNX multi-device annotations: search/start.py)
is the plan to beat, or with ``--search none`` the plan. ``--annotate`` also writes the
model with the plan as annotations.

The planner's order is search/planner.py's (``make_plan``, which the Python API calls
too): this module parses the options, writes the files and prints what was found.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from pathlib import Path

from onnx2soap.cli.annotate_cmd import annotated, check_annotated_output
from onnx2soap.cli.common import add_model_options, seconds
from onnx2soap.cli.pipeline_plan import add_pipeline_options
from onnx2soap.cli.profile_cmd import ChosenCosts, add_costs_option
from onnx2soap.cli.start_plan import start_line
from onnx2soap.files import check_output
from onnx2soap.options import float_in, int_in
from onnx2soap.precision import Precision
from onnx2soap.search.baselines import Rule
from onnx2soap.search.ilp import IlpResult
from onnx2soap.search.mcmc import (
    MAX_BETA,
    MAX_BUDGET_S,
    MAX_EVALS,
    MAX_SEED,
    Progress,
    SearchOptions,
    SearchResult,
)
from onnx2soap.search.pipeline_choice import Candidate, Choice
from onnx2soap.search.pipeline_walk import PipelineWalk
from onnx2soap.search.plan_request import PlanRequest, decide
from onnx2soap.search.planner import candidate_words, make_plan
from onnx2soap.search.start import StartResult
from onnx2soap.sim import Evaluation
from onnx2soap.sim.memory import OPTIMIZER_SLOTS
from onnx2soap.soap import Plan, save_plan
from onnx2soap.soap.annotations import write_annotated
from onnx2soap.soap.buckets import DEFAULT_BUCKET_MB
from onnx2soap.soap.plan import MAX_DEVICES
from onnx2soap.soap.zero import ZERO_STAGES


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
        help="with --strategy zero (or context, or pipeline): 1 shards the optimizer's state "
        "across the replicas, 2 (the default with zero) also the summed gradients, 3 also "
        "the weights (each gathered before the ops that read it, as FSDP)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --strategy megatron: the norms, residual adds and dropouts between the "
        "tensor-parallel blocks split along the sequence inside each node (Megatron-LM's "
        "sequence parallelism); their inputs all-gathered, the row-parallel sums scattered",
    )
    p.add_argument(
        "--no-head-tail",
        dest="head_tail",
        action="store_false",
        help="with --strategy context: cut the sequence in one contiguous chunk a device; by "
        "default, where the model has causal attention, it is cut in two chunks a device, "
        "one from each end (head-tail), so every device has the same causal work",
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


def draw_progress(p: Progress) -> None:
    width = 30
    filled = min(width, int(width * p.elapsed_s / p.budget_s)) if p.budget_s > 0 else width
    bar = "#" * filled + "." * (width - filled)
    sys.stderr.write(
        f"\r[{bar}] {p.elapsed_s:5.1f}/{p.budget_s:.0f}s  {p.evaluated} simulated  "
        f"best {seconds(p.best_step_time_s)}   "
    )
    sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    request = PlanRequest(**{f.name: getattr(args, f.name) for f in fields(PlanRequest)})
    mode = decide(request)
    check_output(args.output)  # before the search, not after it
    if args.annotate:
        check_annotated_output(args.annotate)
    show = None if args.quiet or args.json or not sys.stderr.isatty() else draw_progress
    try:
        planning = make_plan(request, show if mode.searching else None, mode)
    finally:
        if show and mode.searching:  # the bar's line ends, whatever ended the search
            sys.stderr.write("\n")
    for warning in planning.warnings:
        print(f"onnx2soap: warning: {warning}", file=sys.stderr)
    plan = planning.plan
    # made in full before either file is written: a refusal leaves neither half-written
    made = (
        annotated(plan, Path(args.model), planning.graph, Path(args.annotate))
        if args.annotate
        else None
    )
    save_plan(plan, args.output)
    if made is not None:
        write_annotated(made, Path(args.annotate))
    outcome = planning.outcome
    _report(
        args,
        plan,
        planning.machine.name,
        planning.machine.margin,
        mode.searching,
        outcome.time_s,
        planning.costs,
        outcome.ilp,
        outcome.walk,
        outcome.choice,
        planning.started,
    )
    return 0


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
            "selective": c.selective,  # recomputing all but the products
            "zero_stage": int(c.zero_stage),
            "zero_stages": {w: int(z) for w, z in c.zero_weights},
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
    return f"chosen: {candidate_words(c)}{faster}"


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
            "zero_stages": {w: int(z) for w, z in plan.zero_weights},
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
    if plan.zero:
        print(f"  ZeRO: {plan.zero.label} (replicated weights' state sharded)")
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
