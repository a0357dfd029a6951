"""The walk inside a pipeline plan (issue 32): stage boundaries, each stage's inside, the
ZeRO stage and recomputation chosen together, every move priced by the simulator on the
whole pipeline (its schedule, bubble, stage-to-stage moves and per-stage memory).

The pipeline rule cuts ops into stages balanced under data parallelism and runs every
stage data parallel. Alpa chooses stages and what runs inside them jointly (its inter-op
dynamic program over its intra-op pass's costs); here the grid (``pipeline_choice``)
fixes the stage and microbatch counts, and the walk moves from its best plan by
coordinate descent over a ``Layout``:

- a stage's tensor-parallel degree ``t``: 1 is the rule's data parallelism; ``t`` > 1
  is Megatron-LM's plan inside the stage (``megatron.megatron_at``: attention by heads,
  MLPs by columns then rows, ``t`` devices of a node each), data parallel over the rest
  of the stage's devices;
- every stage to one degree at once, its boundaries cut again balanced by the ops'
  times under it (``pipeline_stages.balanced_stages``), as the rule cuts them;
- one boundary's position between its neighbours, among the starts of the model's
  repeated blocks (a transformer layer's first op) and 32 evenly spaced ops: every one
  priced, nearest first, the best kept;
- the ZeRO stage, and recomputation (``--recompute all``'s list) on or off.

A move is kept where it lowers the plan's ``Cost`` (fitting plans by step time, then
plans that overflow by bytes over), so a walk from a plan that does not fit first
looks for one that does. It ends where no move lowers the cost (each coordinate at its
best given the others) or at its time bound.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from onnx2soap.errors import PlanError
from onnx2soap.ir import Graph
from onnx2soap.search.groups import Groups, find_groups
from onnx2soap.search.mcmc import NOWHERE, Cost, cost_in
from onnx2soap.search.megatron import megatron_at, node_size
from onnx2soap.search.pipeline_rule import Space, sample_config, stage_groups, task_seconds
from onnx2soap.search.pipeline_stages import balanced_stages
from onnx2soap.search.priced import Candidate, Pricing, Shape
from onnx2soap.sim import Simulator
from onnx2soap.sim.costs import CostModel
from onnx2soap.soap import Partitioner, Strategy
from onnx2soap.soap import validate as validate_strategy
from onnx2soap.soap.candidates import candidates
from onnx2soap.soap.partition import ParallelConfig
from onnx2soap.soap.pipeline import Pipeline, check_pipeline_plan
from onnx2soap.soap.zero import ZERO_STAGES, ZeroStage, check_zero

EVEN_POSITIONS = 32  # boundary positions besides the starts of repeated blocks


@dataclass(frozen=True)
class Layout:
    """A pipeline plan of the walk: each stage's first op (graph order; ``cuts[0]`` is
    0), each stage's tensor-parallel degree, the ZeRO stage, and whether the backward
    recomputes (``--recompute all``'s list)."""

    cuts: tuple[int, ...]
    degrees: tuple[int, ...]
    zero: ZeroStage
    recompute: bool
    # ops whose config is their own, not their stage's degree's (name order); one whose
    # devices leave its stage (a boundary moved past it) takes its stage's again
    overrides: tuple[tuple[str, ParallelConfig], ...] = ()


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


class StageSpace:
    """What a pipeline of ``shape`` on the microbatch's model can be: each stage's
    devices, its allowed tensor-parallel degrees, the boundary positions; and the plan
    (strategy and pipeline) of a ``Layout``, with each Megatron plan built once."""

    def __init__(self, micro: Graph, space: Space, pricing: Pricing, shape: Shape) -> None:
        self.micro, self.space, self.shape = micro, space, shape
        self.ops = len(micro.ops)
        self.groups = stage_groups(pricing.machine.size, shape.stages)
        node = node_size(pricing.machine)
        self.degrees = tuple(_degrees(group, node) for group in self.groups)
        groups = find_groups(micro, space)
        self.positions = _positions(micro, groups)
        self.counterparts = groups.counterparts
        self._megatron: dict[tuple[int, int], Strategy] = {}

    def configs(self, stage: int, degree: int) -> Callable[[str], ParallelConfig]:
        """Op name -> its config inside ``stage`` at tensor-parallel ``degree``."""
        group = self.groups[stage]
        if degree == 1:
            return lambda name: sample_config(self.space[name], group)
        key = (len(group), degree)
        if key not in self._megatron:
            self._megatron[key] = megatron_at(self.micro, self.space, len(group), degree)
        inside = self._megatron[key]

        def config(name: str) -> ParallelConfig:
            c = inside[name]
            return ParallelConfig(c.degrees, tuple(group[d] for d in c.devices))

        return config

    def build(self, layout: Layout) -> tuple[Strategy, Pipeline]:
        bounds = (*layout.cuts, self.ops)
        configs: dict[str, ParallelConfig] = {}
        stages = []
        own = dict(layout.overrides)
        for s, degree in enumerate(layout.degrees):
            config = self.configs(s, degree)
            names = tuple(op.name for op in self.micro.ops[bounds[s] : bounds[s + 1]])
            for name in names:
                mine = own.get(name)
                inside = mine is not None and set(mine.devices) <= set(self.groups[s])
                configs[name] = mine if inside else config(name)
            stages.append(names)
        pipeline = Pipeline(tuple(stages), self.shape.microbatches, self.shape.schedule)
        return Strategy(sum(len(g) for g in self.groups), configs), pipeline

    def propose(self, at: Layout, rng: np.random.Generator) -> Layout:
        """One op (with its counterparts in the other instances of its repeated block
        inside its stage, half the time, as the main walk changes a block's ops
        together) given one of its candidate configs on its stage's devices
        (``soap.candidates``); an override equal to the stage's own config is dropped."""
        i = int(rng.integers(self.ops))
        s = bisect_right(at.cuts, i) - 1
        group, name = self.groups[s], self.micro.ops[i].name
        choices = candidates(self.space[name], len(group))
        c = choices[int(rng.integers(len(choices)))]
        chosen = ParallelConfig(c.degrees, tuple(group[d] for d in c.devices))
        bounds = (*at.cuts, self.ops)
        stage = {op.name for op in self.micro.ops[bounds[s] : bounds[s + 1]]}
        names = [name]
        if rng.random() < 0.5:
            names += [n for n in self.counterparts.get(name, ()) if n in stage]
        base = self.configs(s, at.degrees[s])
        own = dict(at.overrides)
        for n in names:
            if chosen == base(n):
                own.pop(n, None)
            else:
                own[n] = chosen
        return replace(at, overrides=tuple(sorted(own.items(), key=lambda kv: kv[0])))

    def balanced(self, degree: int, pricing: Pricing, cost: CostModel, redo) -> tuple[int, ...]:
        """The cuts balancing the stages' ops' times with every stage at ``degree``, as
        the pipeline rule balances them under data parallelism (on the narrowest
        stage)."""
        narrowest = min(range(len(self.groups)), key=lambda s: len(self.groups[s]))
        config = self.configs(narrowest, degree)
        configs = {op.name: config(op.name) for op in self.micro.ops}
        seconds = task_seconds(self.micro, configs, pricing.simulator(cost), redo)
        return tuple(r.start for r in balanced_stages(seconds, self.shape.stages))


def _degrees(group: tuple[int, ...], node: int) -> tuple[int, ...]:
    """1, and each ``t`` > 1 dividing the stage's device count and the node size whose
    aligned blocks of ``t`` devices lie in one node (the group starts on a multiple)."""
    width = math.gcd(len(group), node)
    return tuple(t for t in range(1, width + 1) if width % t == 0 and group[0] % t == 0)


def _positions(graph: Graph, groups: Groups) -> tuple[int, ...]:
    """Where a boundary may go: the first op (graph order) of each instance of each
    repeated block (a transformer layer's, where a cut crosses only the residual
    stream), and ``EVEN_POSITIONS`` evenly spaced ops besides (finer where the model
    has few blocks: a cut inside a layer can balance two stages better)."""
    index = {op.name: i for i, op in enumerate(graph.ops)}
    starts = {min(index[n] for n in names) for block in groups.blocks for names in block.instances}
    n = len(graph.ops)
    k = min(EVEN_POSITIONS, n)
    starts |= {round(i * n / k) for i in range(1, k)}
    return tuple(sorted(p for p in starts if 0 < p < n))


@dataclass
class _Pricer:
    """Prices layouts, each once (a walk revisits its neighbours' plans), with one
    simulator per ZeRO stage and recomputation: its memo of durations and per-op memory
    holds under them whatever the stages (``Simulator.memo``), so a move re-prices only
    the ops whose configs it changes."""

    stages: StageSpace
    cost: CostModel
    pricing: Pricing
    redo_names: tuple[str, ...]
    memory: tuple[int, ...]
    partitioner: Partitioner
    seen: dict[Layout, Candidate | None]
    simulators: dict[tuple[ZeroStage, bool], Simulator] = field(default_factory=dict)

    def __call__(self, layout: Layout) -> Candidate | None:
        """The layout's plan priced; None where it is not a plan (a ZeRO stage with no
        weight replicated)."""
        if layout not in self.seen:
            self.seen[layout] = self._price(layout)
        return self.seen[layout]

    def _price(self, layout: Layout) -> Candidate | None:
        micro, space = self.stages.micro, self.stages.space
        strategy, pipeline = self.stages.build(layout)
        validate_strategy(micro, space, strategy)
        check_pipeline_plan(pipeline, micro, strategy.configs, self.pricing.machine.size)
        pg = self.partitioner.partition(strategy)
        try:
            check_zero(layout.zero, (g for gs in pg.groups.values() for g in gs), "walk")
        except PlanError:
            return None
        names = self.redo_names if layout.recompute else ()
        key = (layout.zero, layout.recompute)
        if key not in self.simulators:
            self.simulators[key] = self.pricing.simulator(
                self.cost, zero=layout.zero, recompute=names
            )
        simulator = replace(self.simulators[key], pipeline=pipeline)  # the same memo
        shape = replace(self.stages.shape, recompute=layout.recompute)
        evaluation = simulator.evaluate(pg)
        return Candidate(shape, strategy, micro, space, pipeline, names, layout.zero, evaluation)

    def cost_of(self, candidate: Candidate | None) -> Cost:
        return NOWHERE if candidate is None else cost_in(candidate.evaluation, self.memory)


def layout_of(stages: StageSpace, start: Candidate) -> Layout:
    """The ``Layout`` of a rule-built pipeline (every stage data parallel)."""
    index = {op.name: i for i, op in enumerate(stages.micro.ops)}
    cuts = tuple(min(index[n] for n in ops) for ops in start.pipeline.stages)
    degrees = (1,) * len(cuts)
    return Layout(cuts, degrees, start.zero_stage, start.shape.recompute)


# One coordinate of the walk: its name, and at a layout the layouts that change it alone
# (every one priced; the cheapest kept where it costs less than the layout).
Coordinate = tuple[str, Callable[[Layout], list[Layout]]]


def coordinates(
    stages: StageSpace, balance: Callable[[Layout, int], tuple[int, ...]]
) -> list[Coordinate]:
    """The walk's coordinates, in the order a sweep visits them: each stage's degree;
    every stage at one degree (the cuts balanced again with it); the ZeRO stage;
    recomputation; each boundary, every position between its neighbours, nearest first
    (a step is not unimodal in a boundary's position: a cut inside a layer may send
    more than one at its end, so stepping outward stops short: GPT-2 on cpu:4 stopped
    7 % above its best cut). The few-valued coordinates come first: on a large model
    the time bound may end a sweep among the boundaries."""
    count = len(stages.groups)
    out: list[Coordinate] = []
    for s in range(count):

        def degree(at: Layout, s: int = s) -> list[Layout]:
            others = (d for d in stages.degrees[s] if d != at.degrees[s])
            return [replace(at, degrees=_set(at.degrees, s, d)) for d in others]

        out.append((f"stage {s}'s tensor-parallel degree", degree))
    shared = sorted(set.intersection(*(set(d) for d in stages.degrees)))

    def uniform(at: Layout) -> list[Layout]:
        return [
            replace(at, degrees=(d,) * count, cuts=balance(at, d))
            for d in shared
            if (d,) * count != at.degrees
        ]

    out.append(("every stage at one degree", uniform))

    def zero(at: Layout) -> list[Layout]:
        return [replace(at, zero=z) for z in (ZeroStage.NONE, *ZERO_STAGES) if z != at.zero]

    def recompute(at: Layout) -> list[Layout]:
        return [replace(at, recompute=not at.recompute)]

    out += [("ZeRO stage", zero), ("recomputation", recompute)]
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


def _set(values: tuple[int, ...], i: int, value: int) -> tuple[int, ...]:
    return (*values[:i], value, *values[i + 1 :])


def walk_pipeline(
    start: Candidate,
    cost: CostModel,
    pricing: Pricing,
    redo_names: tuple[str, ...],
    max_s: float = math.inf,
    seed: int = 0,
    proposals: int | None = None,
) -> PipelineWalk:
    """Coordinate descent from ``start`` (a rule-built pipeline: ``pipeline_choice``'s
    best), each coordinate's every value priced and the best kept where it lowers the
    cost; where a sweep keeps nothing, ``proposals`` random changes of one op's config
    (``StageSpace.propose``; twice the ops, at most 256, by default), each kept where it
    lowers the cost, and a sweep again after any was kept. It ends where a round of
    proposals keeps nothing or ``max_s`` has passed (the start is always priced: its
    own evaluation). ``redo_names``: ``--recompute all``'s list for the microbatch's
    model; ``seed``: the proposals'."""
    began = time.perf_counter()
    stages = StageSpace(start.graph, start.space, pricing, start.shape)
    memory = tuple(d.memory for d in pricing.machine.devices)
    pricer = _Pricer(stages, cost, pricing, redo_names, memory, Partitioner(start.graph), {})
    rng = np.random.default_rng(seed)
    rounds = proposals if proposals is not None else min(256, 2 * stages.ops)
    state = _State(start, pricer.cost_of(start), layout_of(stages, start), [])
    pricer.seen[state.layout] = start
    redo = frozenset(redo_names)

    def balance(at: Layout, degree: int) -> tuple[int, ...]:
        return stages.balanced(degree, pricing, cost, redo if at.recompute else frozenset())

    def out_of_time() -> bool:
        return time.perf_counter() - began > max_s

    def sweep() -> bool:
        """One pass over the coordinates; whether it kept a move."""
        changed = False
        for name, neighbours in coordinates(stages, balance):
            # each differs from the layout in this coordinate alone: keeping the better
            # as they come keeps the cheapest of them
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
            changed |= state.consider(pricer, stages.propose(state.layout, rng), "an op's config")
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

    def consider(self, pricer: _Pricer, layout: Layout, move: str) -> bool:
        """Price ``layout``; keep it where it costs less than the best."""
        c = pricer(layout)
        cost = pricer.cost_of(c)
        if not cost < self.cost:
            return False
        self.best, self.cost, self.layout = c, cost, layout
        self.kept.append(WalkStep(move, cost.step_time_s, cost.overflow))
        return True
