"""The search's outer choice (issue 32): after the walk and its ZeRO stage, pipelines
built by the pipeline rule and full recomputation, priced over a small grid.

- Pipelines: ``S`` stages among 2, 4, 8 and the node count (at most the devices and
  the ops), ``M`` microbatches among the rule's default for ``S`` and the batch's
  divisors next to it, 1F1B, each without and with the rule's full recomputation;
  the shapes the rule refuses (``check_shape``) are never offered. A shape is priced
  recomputing only where it does not fit without: recomputation adds a forward, so it
  only ever wins by fitting. GPipe holds every microbatch's activations at once
  for the same bubble, yet the simulator at times prices it up to about 1 % faster
  (the example CNN on cpu:4): it is priced at the fastest fitting 1F1B shape, one
  more plan, and kept where it is faster there.
- Recomputation of the walk's best: where that plan does not fit, it is priced with
  ``--recompute all``'s list and with ``selective``'s (the products kept: faster than
  all where it fits) under its own ZeRO stage; and of the rules users pair with it,
  FSDP, ZeRO-2 data parallelism and Megatron-LM (``rules_recomputing``), both ways.
- Gradient accumulation (``accumulating``): data parallelism over every device
  accumulating 2 microbatches' gradients (a pipeline of one stage) under ZeRO-3, with
  its first groups of layers at ZeRO-2 where that fits (``zero_layers.py``), or keeping
  the products and recomputing the rest where it does not; FSDP recomputing is among
  the rules' plans. These and the rules' are priced the likeliest first, until the
  grid's time bound and half again.
- The walk inside the best pipeline priced (``pipeline_walk``): stage boundaries, each
  stage's tensor parallelism, microbatches, ZeRO, recomputation per stage and single
  ops' configs, its best among the plans chosen from.

A pipeline or recomputing plan replaces a plain one that fits only where it is
``GAIN`` faster: the simulator is optimistic about overlap in the pipeline's schedule
and about recomputation's second forward as it is about ZeRO's (mcmc.ZERO_GAIN). Where
nothing plain fits, the fastest that fits wins. Each microbatch's model is loaded once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from onnx2soap.errors import UserError
from onnx2soap.ir import Graph
from onnx2soap.search.baselines import data_parallel
from onnx2soap.search.mcmc import ZERO_GAIN, cost_in
from onnx2soap.search.megatron import megatron, node_size
from onnx2soap.search.pipeline_layout import model_source
from onnx2soap.search.pipeline_rule import (
    Space,
    default_microbatches,
    default_shape,
    full_recompute,
    kept_products,
    pipeline_plan,
    shape_accepted,
)
from onnx2soap.search.pipeline_walk import PipelineWalk, walk_pipeline
from onnx2soap.search.priced import Candidate, Pricing, Shape, Simulators
from onnx2soap.search.zero_layers import fastest_layered, layer_groups
from onnx2soap.sim import Evaluation, Machine
from onnx2soap.sim.costs import CostModel
from onnx2soap.soap import Partitioner, Strategy, analyze
from onnx2soap.soap import validate as validate_strategy
from onnx2soap.soap.pipeline import Schedule, check_pipeline_plan
from onnx2soap.soap.zero import Zero, ZeroStage

GAIN = ZERO_GAIN  # the same margin, for the same reason: the simulator's optimism
STAGE_COUNTS = (2, 4, 8)  # and the node count


@dataclass(frozen=True)
class Choice:
    chosen: Candidate | None  # None: the walk's plan stands
    tried: tuple[Candidate, ...]
    time_s: float
    # the by-rule baselines plan compares every plan with: ``pipeline`` (the rule's
    # default shape, 1F1B), ``zero`` (data parallelism under ZeRO-2)
    baselines: dict[str, Candidate]
    skipped: int = 0  # grid shapes left unpriced, past ``max_s``
    walk: PipelineWalk | None = None  # the walk inside the grid's best pipeline


# the model loaded at a batch (the microbatch's)
Loader = Callable[[int], Graph]


def grid(machine: Machine, batch: int, ops: int) -> list[tuple[int, int]]:
    """The (stages, microbatches) the choice prices, each one the rule accepts, the
    rule's default shape among them."""
    devices = machine.size
    top = min(devices, ops)
    # and the rule's default (a stage per node, capped by the ops): its baseline's shape
    default = default_shape(machine, batch, ops)
    named = (*STAGE_COUNTS, devices // node_size(machine), *(default[:1] if default else ()))
    counts = sorted({s for s in named if 2 <= s <= top})
    divisors = [m for m in range(1, batch + 1) if batch % m == 0]
    shapes = []
    for stages in counts:
        usual = default_microbatches(devices, batch, stages)
        if usual is None:
            continue
        i = divisors.index(usual)
        for m in divisors[max(0, i - 1) : i + 2]:
            if shape_accepted(devices, batch, ops, stages, m):
                shapes.append((stages, m))
    return shapes


def price_pipeline(
    micro: Graph,
    space: Space,
    cost: CostModel,
    pricing: Pricing,
    shape: Shape,
    names: tuple[str, ...] | None = None,
    simulators: Simulators | None = None,
    zero: Zero | ZeroStage = ZeroStage.NONE,
) -> Candidate:
    """The rule's pipeline of ``shape`` on ``micro`` (the model at the microbatch's
    batch), checked and priced as ``plan --strategy pipeline`` prices it, under ZeRO
    ``zero``. ``names``: ``full_recompute``'s list for ``micro`` where known (it finds
    the model's blocks); ``simulators``: shared with the other plans priced (a fresh
    one's else)."""
    plain = pricing.simulator(cost)
    if shape.recompute and names is None:
        names = full_recompute(micro, space, plain)
    names = names if shape.recompute else ()
    built = pipeline_plan(
        micro, space, plain, shape.stages, shape.microbatches, shape.schedule, frozenset(names)
    )
    validate_strategy(micro, space, built.strategy)
    check_pipeline_plan(built.pipeline, micro, built.strategy.configs, pricing.machine.size)
    simulators = simulators or Simulators(pricing)
    priced = simulators.get(micro, cost, zero, names, built.pipeline)
    evaluation = priced.evaluate(Partitioner(micro).partition(built.strategy))
    zero = Zero.of(zero)
    return Candidate(
        shape,
        built.strategy,
        micro,
        space,
        built.pipeline,
        names,
        zero.stage,
        evaluation,
        zero_weights=zero.weights,
    )


def price_recompute(
    graph: Graph,
    space: Space,
    cost: CostModel,
    pricing: Pricing,
    strategy: Strategy,
    zero: ZeroStage,
    of: str = "walk",
    names: tuple[str, ...] | None = None,
    simulators: Simulators | None = None,
    selective: bool = False,
) -> Candidate:
    """``strategy`` (the walk's best, or a rule's: ``of``) with ``--recompute all``'s
    list (``names`` where known; ``selective``: ``--recompute selective``'s), under
    ``zero``."""
    if names is None:
        names = full_recompute(graph, space, pricing.simulator(cost))
    priced = (simulators or Simulators(pricing)).get(graph, cost, zero, names)
    evaluation = priced.evaluate(Partitioner(graph).partition(strategy))
    shape = Shape(0, 1, None, True)
    return Candidate(shape, strategy, graph, space, None, names, zero, evaluation, of, selective)


def recomputing(
    graph: Graph,
    space: Space,
    cost: CostModel,
    pricing: Pricing,
    strategy: Strategy,
    zero: ZeroStage,
    of: str,
    lists: tuple[tuple[str, ...], tuple[str, ...]],
    simulators: Simulators | None = None,
) -> list[Candidate]:
    """``strategy`` recomputing all (``lists[0]``) and selectively (``lists[1]``, the
    products kept: less time, more memory; none offered for a model without products)."""
    full, selective = lists
    found = [price_recompute(graph, space, cost, pricing, strategy, zero, of, full, simulators)]
    if selective:
        found.append(
            price_recompute(
                graph, space, cost, pricing, strategy, zero, of, selective, simulators, True
            )
        )
    return found


def rules_recomputing(
    graph: Graph,
    space: Space,
    cost: CostModel,
    pricing: Pricing,
    names: tuple[str, ...],
    simulators: Simulators | None = None,
    selective: tuple[str, ...] = (),
    deadline: float = math.inf,
) -> list[Candidate]:
    """The rules users pair with recomputation, recomputing selectively (``selective``,
    where given: faster where it fits) and all (``names``): data parallelism under ZeRO-3
    (FSDP with activation checkpointing, torchtitan's published Llama runs) and ZeRO-2
    (DeepSpeed's), and Megatron-LM (its activation checkpointing and selective
    recomputation), in that order, the first always and the rest until ``deadline``
    (``time.perf_counter``'s: LLaMA-3-8B on 128 GPUs takes some 15 s a plan). The walk
    prices plans without recomputation, so a rule that fits only recomputing (Megatron
    on GPT-1.3B over 64 H100s: 95 GiB plain, 67 recomputing, the fastest that fits) is
    found here or nowhere."""
    devices = pricing.machine.size
    if devices == 1:
        return []
    plans = [
        ("fsdp", data_parallel(graph, space, devices), ZeroStage.PARAMETERS),
        ("data-parallel", data_parallel(graph, space, devices), ZeroStage.GRADIENTS),
        ("megatron", megatron(graph, space, devices, node_size(pricing.machine)), ZeroStage.NONE),
    ]
    lists = [(selective, True)] if selective else []
    lists.append((names, False))
    found: list[Candidate] = []
    for name, strategy, zero in plans:
        for redo, kept in lists:
            if found and time.perf_counter() > deadline:
                return found
            found.append(
                price_recompute(
                    graph, space, cost, pricing, strategy, zero, name, redo, simulators, kept
                )
            )
    return found


def choose(
    plain: Evaluation,
    tried: Sequence[Candidate],
    baselines: Sequence[Candidate] = (),
    margin: float = 0.0,
) -> Candidate | None:
    """The rule: the fastest candidate that fits replaces a plain plan that fits only
    where it is ``GAIN`` faster, or the machine's ``margin`` where that is more (a
    smaller gain is inside the simulator's error there: ``search/margin.py``); where
    the plain plan does not fit, the fastest that fits wins. A by-rule baseline that
    fits and is faster than that by more than the margin still wins (with no margin,
    at any gain: the plan is never slower than a baseline it is compared with). None:
    the plain plan stands (or nothing fits at all)."""
    fitting = [c for c in tried if c.evaluation.fits]
    chosen = min(fitting, key=lambda c: c.evaluation.step_time_s) if fitting else None
    gain = max(GAIN, margin)
    if chosen and plain.fits and chosen.evaluation.step_time_s >= plain.step_time_s * (1 - gain):
        chosen = None
    floor = chosen.evaluation if chosen else plain
    for b in baselines:
        faster = b.evaluation.step_time_s < floor.step_time_s * (1 - margin)
        if b.evaluation.fits and (faster or not floor.fits):
            chosen, floor = b, b.evaluation
    return chosen


def zero_baseline(
    graph: Graph,
    space: Space,
    cost: CostModel,
    pricing: Pricing,
    simulators: Simulators | None = None,
) -> Candidate:
    """Data parallelism under ZeRO-2: ``plan``'s ``zero`` baseline."""
    strategy = data_parallel(graph, space, pricing.machine.size)
    priced = (simulators or Simulators(pricing)).get(graph, cost, ZeroStage.GRADIENTS)
    evaluation = priced.evaluate(Partitioner(graph).partition(strategy))
    shape = Shape(0, 1, None, False)
    zero = ZeroStage.GRADIENTS
    return Candidate(shape, strategy, graph, space, None, (), zero, evaluation, "zero")


def pipeline_choice(
    graph: Graph,
    space: Space,
    load: Loader,
    cost: CostModel,
    pricing: Pricing,
    best: Strategy,
    best_evaluation: Evaluation,
    zero: ZeroStage,
    max_s: float = math.inf,
    walk_s: float | None = None,
    seed: int = 0,
) -> Choice:
    """Price the grid's pipelines (1F1B; recomputing where one does not fit without),
    GPipe at the fastest fitting one, the walk's best recomputing where it does not
    fit, and the rules recomputing; choose by ``choose``. ``load`` is called once per
    distinct microbatch size. ``cost``: the model's at the step's batch (``for_graph``),
    which prices every microbatch's tasks too: a microbatch is the same model, taken
    into the step as the model is (its calibration is made at the step's batch).
    ``max_s``: no grid shape is begun after it (the rule's default shape, priced first,
    always is): a pipeline of a large model on many devices takes seconds to price.
    Then the walk inside the best pipeline priced (``pipeline_walk``) for ``walk_s``
    (``max_s`` where not given; ``seed``: its random changes'); its best joins the
    plans chosen among."""
    began = time.perf_counter()
    tried: list[Candidate] = []
    simulators = Simulators(pricing)
    models: dict[int, tuple[Graph, Space, CostModel]] = {}
    redo_names: dict[int, tuple[str, ...]] = {}  # full_recompute's, per microbatch size
    default = default_shape(pricing.machine, graph.batch, len(graph.ops))
    shapes = grid(pricing.machine, graph.batch, len(graph.ops))
    shapes.sort(key=lambda sm: sm != default)  # stable: the rest in the grid's order
    skipped = 0
    for stages, microbatches in shapes:
        if tried and time.perf_counter() - began > max_s:
            skipped += 1
            continue
        size = graph.batch // microbatches
        if size not in models:
            try:
                micro = graph if size == graph.batch else load(size)
            except UserError:  # a model whose batch is fixed: no microbatch to load
                break
            models[size] = (micro, analyze(micro), cost)
        micro, micro_space, cost = models[size]
        for redo in (False, True):
            if redo and tried[-1].evaluation.fits:
                break  # recomputing adds a forward: slower wherever the plain one fits
            shape = Shape(stages, microbatches, Schedule.ONE_F_ONE_B, redo)
            if redo and size not in redo_names:
                redo_names[size] = full_recompute(micro, micro_space, pricing.simulator(cost))
            names = redo_names.get(size, ())
            priced = price_pipeline(micro, micro_space, cost, pricing, shape, names, simulators)
            tried.append(priced)
    fitting = [c for c in tried if c.evaluation.fits]
    if fitting:  # GPipe: the same bubble, more memory held, yet at times a little faster
        top = min(fitting, key=lambda c: c.evaluation.step_time_s)
        shape = replace(top.shape, schedule=Schedule.GPIPE)
        size = graph.batch // shape.microbatches
        micro, micro_space, cost = models[size]
        names = redo_names.get(size, ())
        tried.append(price_pipeline(micro, micro_space, cost, pricing, shape, names, simulators))
    # past the grid's bound, half as long again for what follows, the likeliest first
    extras = began + 1.5 * max_s
    # (a plan priced once gets simulators of its own, whose memo no other plan reuses:
    # it goes with them, not kept to the choice's end)
    tried += accumulating(graph, load, models, cost, pricing, extras)
    walk_s = max_s if walk_s is None else walk_s
    walked = _walk_best(tried, models, redo_names, load, cost, simulators, walk_s, seed)
    moved = walked.best if walked is not None and walked.best is not walked.start else None
    if moved is not None:
        tried.append(moved)
    if graph.batch not in redo_names:
        redo_names[graph.batch] = full_recompute(graph, space, pricing.simulator(cost))
    whole, selective = redo_names[graph.batch], kept_products(graph)
    if not best_evaluation.fits and time.perf_counter() <= extras:
        lists = (whole, selective)
        tried += recomputing(graph, space, cost, pricing, best, zero, "walk", lists)
    tried += rules_recomputing(graph, space, cost, pricing, whole, None, selective, extras)
    baselines = {}
    if default is not None:
        rule = Shape(*default, Schedule.ONE_F_ONE_B, False)
        # the rule's own plan, not the walk's of the same shape
        ruled = [c for c in tried if c.shape == rule and c is not moved]
        if ruled:
            baselines["pipeline"] = ruled[0]
    if pricing.machine.size > 1:
        baselines["zero"] = zero_baseline(graph, space, cost, pricing, simulators)
    margin = pricing.machine.margin
    chosen = choose(best_evaluation, tried, list(baselines.values()), margin)
    took = time.perf_counter() - began
    return Choice(chosen, tuple(tried), took, baselines, skipped, walked)


# Gradient accumulation's microbatch counts priced, the fewest first (each microbatch
# a full simulation of the model at its batch)
ACCUMULATIONS = 2


def accumulation_counts(devices: int, batch: int) -> list[int]:
    """Microbatch counts for gradient accumulation over every device (a pipeline of one
    stage): 2 and up, dividing the batch with a sample for every device in each."""
    counts = [m for m in range(2, batch + 1) if batch % m == 0 and batch // m >= devices]
    return counts[:ACCUMULATIONS]


def accumulating(
    graph: Graph,
    load: Loader,
    models: dict[int, tuple[Graph, Space, CostModel]],
    cost: CostModel,
    pricing: Pricing,
    deadline: float = math.inf,
) -> list[Candidate]:
    """Data parallelism over every device accumulating the gradients of ``m``
    microbatches (``accumulation_counts``), under ZeRO-3 (FSDP gathering the weights
    for each microbatch, as torchtitan's gradient accumulation does): a microbatch's
    activations instead of the batch's, for more gathers. Where it fits, also with its
    first groups of layers at ZeRO-2, up to all of them (``_first_layers_kept``, until
    ``deadline``); where it does not, with the products kept and the ops between them
    recomputed. A model whose batch is fixed (its microbatch cannot be loaded) has
    none."""
    devices = pricing.machine.size
    found: list[Candidate] = []
    if devices == 1:
        return found
    for m in accumulation_counts(devices, graph.batch):
        size = graph.batch // m
        if size not in models:
            try:
                micro = load(size)
            except UserError:
                break
            models[size] = (micro, analyze(micro), cost)
        micro, space, cost = models[size]
        plain = Shape(1, m, Schedule.ONE_F_ONE_B, False)
        stage3 = ZeroStage.PARAMETERS
        alone = Simulators(pricing)
        fsdp = price_pipeline(micro, space, cost, pricing, plain, (), alone, stage3)
        found.append(fsdp)
        if fsdp.evaluation.fits:
            found += _first_layers_kept(micro, space, cost, pricing, plain, deadline)
        elif kept := kept_products(micro):
            redo = replace(plain, recompute=True)
            alone = Simulators(pricing)
            redone = price_pipeline(micro, space, cost, pricing, redo, kept, alone, stage3)
            found.append(replace(redone, selective=True))
    return found


def _first_layers_kept(
    graph: Graph, space: Space, cost: CostModel, pricing: Pricing, shape: Shape, deadline: float
) -> list[Candidate]:
    """The fastest that fits of the rule's plan of ``shape`` with its first groups of
    layers at ZeRO-2 and the rest at ZeRO-3 (``zero_layers.py``: the gathers that start
    each microbatch's forward go), if any. Each priced on a simulator of its own, whose
    memo (of a plan priced once) goes with it."""
    priced: dict[Zero, Candidate] = {}

    def evaluation(zero: Zero) -> Evaluation:
        alone = Simulators(pricing)
        priced[zero] = price_pipeline(graph, space, cost, pricing, shape, (), alone, zero)
        return priced[zero].evaluation

    groups = layer_groups(graph, space)
    found = fastest_layered(groups, ZeroStage.PARAMETERS, ZeroStage.GRADIENTS, evaluation, deadline)
    return [] if found is None else [priced[found.zero]]


def _walk_best(
    tried: Sequence[Candidate],
    models: dict[int, tuple[Graph, Space, CostModel]],
    redo_names: dict[int, tuple[str, ...]],
    load: Loader,
    cost: CostModel,
    simulators: Simulators,
    walk_s: float,
    seed: int,
) -> PipelineWalk | None:
    """The walk from the best pipeline priced (fitting by step time, else the least
    overflow), loading the model at other microbatch sizes as it asks (into
    ``models``, and their recompute lists into ``redo_names``, shared with the grid);
    None where no pipeline was priced."""
    piped = [c for c in tried if c.pipeline is not None]
    if not piped:
        return None
    pricing = simulators.pricing
    memory = tuple(d.memory for d in pricing.machine.devices)
    start = min(piped, key=lambda c: cost_in(c.evaluation, memory))
    batch = start.graph.batch * start.shape.microbatches

    def loaded(microbatches: int) -> tuple[Graph, Space, CostModel] | None:
        size = batch // microbatches
        if size not in models:
            try:
                micro = load(size)
            except UserError:  # a model whose batch is fixed
                return None
            models[size] = (micro, analyze(micro), cost)
        return models[size]

    ops = tuple(op.name for op in start.graph.ops)
    source = model_source(loaded, pricing, start.shape, ops, redo_names)
    return walk_pipeline(start, source, pricing, walk_s, seed, simulators=simulators)
