"""The walk inside a pipeline plan (issue 32): stage boundaries, each stage's inside, the
microbatches, the ZeRO stage and recomputation chosen together, every move priced by the
simulator on the whole pipeline (its schedule, bubble, stage-to-stage moves and
per-stage memory).

The pipeline rule cuts ops into stages balanced under data parallelism and runs every
stage data parallel. Alpa chooses stages and what runs inside them jointly (its inter-op
dynamic program over its intra-op pass's costs); here the grid (``pipeline_choice``)
fixes the stage count, and the walk moves from its best plan by coordinate descent over
a ``Layout`` (``pipeline_layout.py``):

- a stage's tensor-parallel degree ``t``: 1 is the rule's data parallelism; ``t`` > 1
  is Megatron-LM's plan inside the stage (``megatron.megatron_at``: attention by heads,
  MLPs by columns then rows, ``t`` devices of a node each), data parallel over the rest
  of the stage's devices;
- every stage to one degree at once, its boundaries cut again balanced by the ops'
  times under it (``pipeline_stages.balanced_stages``), as the rule cuts them;
- the ZeRO stage, and recomputation in each stage, or in all of them: none, all
  (``--recompute all``'s list) or selective (the products kept, the ops between them
  made again: less memory than none for less time than all), as Megatron-LM and
  torchtitan choose per block (1F1B holds more microbatches on early stages:
  recomputing there alone may be enough to fit);
- the microbatch count, among the batch's divisors up to 8 a stage (a stage split by
  tensor parallelism needs fewer samples a microbatch than the rule's data
  parallelism, so more microbatches and a smaller bubble become possible);
- one boundary's position between its neighbours, among the starts of the model's
  repeated blocks (a transformer layer's first op) and 32 evenly spaced ops: every one
  priced, nearest first, the best kept;

and, where a sweep keeps nothing, random changes of one op's config inside its stage
(``StageSpace.propose``: FlexFlow's move, within the stage's devices).

A move is kept where it lowers the plan's ``Cost`` (fitting plans by step time, then
plans that overflow by bytes over), so a walk from a plan that does not fit first
looks for one that does. It ends where a round of random changes keeps nothing after a
sweep that kept nothing, or at its time bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from onnx2soap.search.mcmc import Cost
from onnx2soap.search.pipeline_layout import (
    Layout,
    LayoutPricer,
    Models,
    StageSpace,
    layout_of,
)
from onnx2soap.search.pipeline_rule import SEARCHED, Recompute, kept_products
from onnx2soap.search.priced import Candidate, Pricing, Simulators
from onnx2soap.soap.zero import ZERO_STAGES, ZeroStage

MICROBATCHES_PER_STAGE = 8  # the most microbatches a stage the walk offers


@dataclass(frozen=True)
class WalkStep:
    """A move the walk kept: what it changed, and the plan's step and overflow after."""

    move: str
    step_time_s: float
    overflow: float


@dataclass(frozen=True)
class PipelineWalk:
    start: Candidate
    best: Candidate
    layout: Layout
    kept: tuple[WalkStep, ...]
    priced: int  # plans priced, the start's included
    time_s: float
    converged: bool  # no move lowers the cost (False: stopped by the time bound)


# One coordinate of the walk: its name, and at a layout the layouts that change it alone
# (every one priced; the cheapest kept where it costs less than the layout).
Coordinate = tuple[str, Callable[[Layout], list[Layout]]]
Balance = Callable[[Layout, int], tuple[int, ...]]


def coordinates(stages: StageSpace, balance: Balance, counts: Sequence[int]) -> list[Coordinate]:
    """The walk's coordinates, in the order a sweep visits them: every stage at one
    degree (the cuts balanced again with it: one plan that changes every stage); the
    ZeRO stage; recomputation; the microbatch count among ``counts``, nearest first
    (the levers on memory, first for a start that does not fit); each stage's degree;
    each boundary,
    every position between its neighbours, nearest first (a step is not unimodal in a
    boundary's position: a cut inside a layer may send more than one at its end, so
    stepping outward stops short: GPT-2 on cpu:4 stopped 7 % above its best cut). The
    few-valued coordinates come first: on a large model the time bound may end a sweep
    among the boundaries."""
    count = len(stages.groups)
    shared = sorted(set.intersection(*(set(d) for d in stages.degrees)))

    def uniform(at: Layout) -> list[Layout]:
        return [
            replace(at, degrees=(d,) * count, cuts=balance(at, d))
            for d in shared
            if (d,) * count != at.degrees
        ]

    def zero(at: Layout) -> list[Layout]:
        return [replace(at, zero=z) for z in (ZeroStage.NONE, *ZERO_STAGES) if z != at.zero]

    # selective recomputation keeps the products: none to offer without one
    modes = [m for m in SEARCHED if m is not Recompute.SELECTIVE or kept_products(stages.micro)]

    def recompute(at: Layout) -> list[Layout]:
        every = [(mode,) * count for mode in modes]
        each = [
            _set(at.recompute, s, mode)
            for s in range(count)
            for mode in modes
            if mode is not at.recompute[s]
        ]
        options = dict.fromkeys([*every, *each])  # in order, once each
        return [replace(at, recompute=r) for r in options if r != at.recompute]

    def microbatches(at: Layout) -> list[Layout]:
        near = sorted(
            (m for m in counts if m != at.microbatches),
            key=lambda m: (abs(math.log(m / at.microbatches)), m),
        )
        return [replace(at, microbatches=m) for m in near]

    out: list[Coordinate] = [
        ("every stage at one degree", uniform),
        ("ZeRO stage", zero),
        ("recomputation", recompute),
        ("microbatches", microbatches),
    ]
    for s in range(count):

        def degree(at: Layout, s: int = s) -> list[Layout]:
            others = (d for d in stages.degrees[s] if d != at.degrees[s])
            return [replace(at, degrees=_set(at.degrees, s, d)) for d in others]

        out.append((f"stage {s}'s tensor-parallel degree", degree))
    for b in range(1, count):

        def boundary(at: Layout, b: int = b) -> list[Layout]:
            lo, hi = (*at.cuts, stages.ops)[b - 1], (*at.cuts, stages.ops)[b + 1]
            here = at.cuts[b]
            near = sorted(
                (p for p in stages.positions if lo < p < hi and p != here),
                key=lambda p: (abs(p - here), p),
            )
            return [replace(at, cuts=_set(at.cuts, b, p)) for p in near]

        out.append((f"boundary {b}", boundary))
    return out


def _set(values: tuple, i: int, value) -> tuple:
    return (*values[:i], value, *values[i + 1 :])


def microbatch_counts(batch: int, stages: int) -> tuple[int, ...]:
    """The batch's divisors from 2 up to ``MICROBATCHES_PER_STAGE`` a stage (one
    microbatch idles every stage but one: never a pipeline's best)."""
    top = MICROBATCHES_PER_STAGE * stages
    return tuple(m for m in range(2, min(batch, top) + 1) if batch % m == 0)


def walk_pipeline(
    start: Candidate,
    models: Models,
    pricing: Pricing,
    max_s: float = math.inf,
    seed: int = 0,
    proposals: int | None = None,
    counts: Sequence[int] | None = None,
    simulators: Simulators | None = None,
) -> PipelineWalk:
    """Coordinate descent from ``start`` (a rule-built pipeline: ``pipeline_choice``'s
    best), each coordinate's every value priced and the best kept where it lowers the
    cost; where a sweep keeps nothing, ``proposals`` random changes of one op's config
    (``StageSpace.propose``; twice the ops, at most 256, by default), each kept where it
    lowers the cost, and a sweep again after any was kept. It ends where a round of
    proposals keeps nothing or ``max_s`` has passed (twice that while nothing it priced
    fits: without a plan that fits, ``plan`` refuses; the start is always priced: its
    own evaluation). ``models``: the model at a microbatch count's size; ``counts``:
    the microbatch counts offered (``microbatch_counts`` of the step's batch by
    default; ``(start's,)`` keeps it); ``seed``: the proposals'; ``simulators``: shared
    with the plans priced before (``pipeline_choice``'s)."""
    began = time.perf_counter()
    first = models(start.shape.microbatches)
    stages = first.stages
    batch = start.graph.batch * start.shape.microbatches
    counts = microbatch_counts(batch, len(stages.groups)) if counts is None else counts
    memory = tuple(d.memory for d in pricing.machine.devices)
    pricer = LayoutPricer(models, pricing, memory, simulators or Simulators(pricing))
    rng = np.random.default_rng(seed)
    rounds = proposals if proposals is not None else min(256, 2 * stages.ops)
    state = _State(start, pricer.cost_of(start), layout_of(stages, start), [])
    pricer.seen[state.layout] = start

    def balance(at: Layout, degree: int) -> tuple[int, ...]:
        m = models(at.microbatches) or first
        redo = frozenset(m.stages.recomputed(at, m.redo_names, m.selective_names))
        return m.stages.balanced(degree, pricing, m.cost, redo)

    def out_of_time() -> bool:
        # a walk that has found nothing that fits goes on twice as long: without it
        # the plan is a refusal
        bound = max_s if state.cost.fits else 2 * max_s
        return time.perf_counter() - began > bound

    def sweep() -> bool:
        """One pass over the coordinates; whether it kept a move."""
        changed = False
        for name, neighbours in coordinates(stages, balance, counts):
            for layout in neighbours(state.layout) if not out_of_time() else ():
                if out_of_time():
                    break
                changed |= state.consider(pricer, layout, name)
        return changed

    def propose() -> bool:
        changed = False
        for _ in range(rounds):
            if out_of_time():
                break
            inside = (models(state.layout.microbatches) or first).stages
            changed |= state.consider(pricer, inside.propose(state.layout, rng), "an op's config")
        return changed

    converged = False
    while not out_of_time():
        if sweep():
            continue
        if not propose():  # every coordinate at its best, and no op's change helps
            converged = not out_of_time()
            break
    took = time.perf_counter() - began
    return PipelineWalk(
        start, state.best, state.layout, tuple(state.kept), len(pricer.seen), took, converged
    )


@dataclass
class _State:
    """The walk's best so far, its cost and layout, and the moves it kept."""

    best: Candidate
    cost: Cost
    layout: Layout
    kept: list[WalkStep]

    def consider(self, pricer: LayoutPricer, layout: Layout, move: str) -> bool:
        """Price ``layout``; keep it where it costs less than the best."""
        c = pricer(layout)
        cost = pricer.cost_of(c)
        if not cost < self.cost:
            return False
        self.best, self.cost, self.layout = c, cost, layout
        self.kept.append(WalkStep(move, cost.step_time_s, cost.overflow))
        return True
