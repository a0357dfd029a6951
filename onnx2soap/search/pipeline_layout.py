"""A pipeline plan as the walk inside pipelines moves it (``pipeline_walk.py``): a
``Layout`` (stage boundaries, each stage's tensor-parallel degree, ops' own configs,
ZeRO, recomputation, microbatches), the plan it stands for on the model at the
microbatch's size (``StageSpace``), and its price (``LayoutPricer``)."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from onnx2soap.errors import PlanError
from onnx2soap.ir import Graph
from onnx2soap.search.groups import Groups, find_groups
from onnx2soap.search.mcmc import NOWHERE, Cost, cost_in
from onnx2soap.search.megatron import megatron_at, node_size
from onnx2soap.search.pipeline_rule import (
    Recompute,
    Space,
    full_recompute,
    kept_products,
    stage_groups,
    task_seconds,
)
from onnx2soap.search.pipeline_stages import balanced_stages
from onnx2soap.search.priced import Candidate, Pricing, Shape, Simulators
from onnx2soap.search.replicas import replica_config
from onnx2soap.sim.costs import CostModel
from onnx2soap.soap import Partitioner, Strategy
from onnx2soap.soap import validate as validate_strategy
from onnx2soap.soap.candidates import candidates
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.partition import ParallelConfig
from onnx2soap.soap.pipeline import Pipeline, check_pipeline_plan
from onnx2soap.soap.zero import ZeroStage, check_zero

EVEN_POSITIONS = 32  # boundary positions besides the starts of repeated blocks


@dataclass(frozen=True)
class Layout:
    """A pipeline plan of the walk: each stage's first op (graph order, the same at
    every microbatch size; ``cuts[0]`` is 0), each stage's tensor-parallel degree, the
    ZeRO stage, per stage what its backward recomputes (none, its ops of ``--recompute
    all``'s list, or of ``selective``'s), and the microbatch count."""

    cuts: tuple[int, ...]
    degrees: tuple[int, ...]
    zero: ZeroStage
    recompute: tuple[Recompute, ...]
    microbatches: int
    # ops whose config is their own, not their stage's degree's (name order); one whose
    # devices leave its stage (a boundary moved past it) takes its stage's again
    overrides: tuple[tuple[str, ParallelConfig], ...] = ()


class StageSpace:
    """What a pipeline of ``shape``'s stages and schedule on the model at one
    microbatch size can be: each stage's devices, its allowed tensor-parallel degrees,
    the boundary positions; and the plan (strategy and pipeline) of a ``Layout`` of
    that size, with each Megatron plan built once."""

    def __init__(self, micro: Graph, space: Space, pricing: Pricing, shape: Shape) -> None:
        self.micro, self.space, self.shape = micro, space, shape
        self.ops = len(micro.ops)
        self.groups = stage_groups(pricing.machine.size, shape.stages)
        node = node_size(pricing.machine)
        self.degrees = tuple(_degrees(group, node) for group in self.groups)
        groups = find_groups(micro, space)
        self.copied = weight_only_ops(micro)  # copied on a stage's devices, not split
        self.positions = _positions(micro, groups)
        self.counterparts = groups.counterparts
        self._megatron: dict[tuple[int, int], Strategy] = {}

    def configs(self, stage: int, degree: int) -> Callable[[str], ParallelConfig]:
        """Op name -> its config inside ``stage`` at tensor-parallel ``degree``."""
        group = self.groups[stage]
        if degree == 1:
            return lambda name: replica_config(self.space[name], group, name in self.copied)
        key = (len(group), degree)
        if key not in self._megatron:
            self._megatron[key] = megatron_at(self.micro, self.space, len(group), degree)
        inside = self._megatron[key]

        def config(name: str) -> ParallelConfig:
            c = inside[name]
            return replace(c, devices=tuple(group[d] for d in c.devices))

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
        pipeline = Pipeline(tuple(stages), layout.microbatches, self.shape.schedule)
        return Strategy(sum(len(g) for g in self.groups), configs), pipeline

    def propose(self, at: Layout, rng: np.random.Generator) -> Layout:
        """One op (with its counterparts in the other instances of its repeated block
        inside its stage, half the time, as the main walk changes a block's ops
        together) given one of its candidate configs on its stage's devices
        (``soap.candidates``); an override equal to the stage's own config is dropped."""
        i = int(rng.integers(self.ops))
        s = bisect_right(at.cuts, i) - 1
        group, name = self.groups[s], self.micro.ops[i].name
        choices = candidates(self.space[name], len(group), name in self.copied)
        c = choices[int(rng.integers(len(choices)))]
        chosen = replace(c, devices=tuple(group[d] for d in c.devices))
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

    def recomputed(
        self, layout: Layout, full: tuple[str, ...], selective: tuple[str, ...] = ()
    ) -> tuple[str, ...]:
        """The ops each stage recomputes: of ``full`` (``--recompute all``'s list) those
        in stages that recompute all, of ``selective`` those in stages that recompute
        selectively; in graph order."""
        if len(set(layout.recompute)) == 1:
            mode = layout.recompute[0]
            return {Recompute.NONE: (), Recompute.ALL: full, Recompute.SELECTIVE: selective}[mode]
        lists = {
            Recompute.NONE: frozenset(),
            Recompute.ALL: frozenset(full),
            Recompute.SELECTIVE: frozenset(selective),
        }
        return tuple(
            op.name
            for i, op in enumerate(self.micro.ops)
            if op.name in lists[layout.recompute[bisect_right(layout.cuts, i) - 1]]
        )

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


@dataclass(frozen=True)
class Microbatched:
    """The model at one microbatch size, and what pricing its plans needs."""

    stages: StageSpace
    partitioner: Partitioner
    cost: CostModel
    redo_names: tuple[str, ...]  # ``--recompute all``'s list
    selective_names: tuple[str, ...] = ()  # ``--recompute selective``'s, () without products


# microbatch count -> the model at its size (None where it cannot be loaded: a batch
# the model fixes)
Models = Callable[[int], "Microbatched | None"]


@dataclass
class LayoutPricer:
    """Prices layouts, each once (a walk revisits its neighbours' plans), with one
    simulator per microbatch count, ZeRO stage and recomputation (``Simulators``): its
    memo of durations and per-op memory holds under them whatever the stages, so a move
    re-prices only the ops whose configs it changes."""

    models: Models
    pricing: Pricing
    memory: tuple[int, ...]
    simulators: Simulators
    seen: dict[Layout, Candidate | None] = field(default_factory=dict)

    def __call__(self, layout: Layout) -> Candidate | None:
        """The layout's plan priced; None where it is not a plan: a ZeRO stage with no
        weight replicated, a microbatch size the model cannot load, or an op's own
        config the microbatch cannot split so."""
        if layout not in self.seen:
            self.seen[layout] = self._price(layout)
        return self.seen[layout]

    def _price(self, layout: Layout) -> Candidate | None:
        at = self.models(layout.microbatches)
        if at is None:
            return None
        micro, space = at.stages.micro, at.stages.space
        strategy, pipeline = at.stages.build(layout)
        try:
            validate_strategy(micro, space, strategy)
            check_pipeline_plan(pipeline, micro, strategy.configs, self.pricing.machine.size)
            pg = at.partitioner.partition(strategy)
            check_zero(layout.zero, (g for gs in pg.groups.values() for g in gs), "walk")
        except PlanError:
            return None
        names = at.stages.recomputed(layout, at.redo_names, at.selective_names)
        # durations and memory depend on what is recomputed, not on where stages end
        simulator = self.simulators.get(micro, at.cost, layout.zero, names, pipeline)
        redo = any(r is not Recompute.NONE for r in layout.recompute)
        shape = replace(at.stages.shape, microbatches=layout.microbatches, recompute=redo)
        evaluation = simulator.evaluate(pg)
        return Candidate(shape, strategy, micro, space, pipeline, names, layout.zero, evaluation)

    def cost_of(self, candidate: Candidate | None) -> Cost:
        return NOWHERE if candidate is None else cost_in(candidate.evaluation, self.memory)


def layout_of(stages: StageSpace, start: Candidate) -> Layout:
    """The ``Layout`` of a rule-built pipeline (every stage data parallel)."""
    index = {op.name: i for i, op in enumerate(stages.micro.ops)}
    cuts = tuple(min(index[n] for n in ops) for ops in start.pipeline.stages)
    degrees = (1,) * len(cuts)
    redo = (Recompute.ALL if start.shape.recompute else Recompute.NONE,) * len(cuts)
    return Layout(cuts, degrees, start.zero_stage, redo, start.shape.microbatches)


# microbatch count -> the model at its size, its analysis and cost model (None where it
# cannot be loaded: a batch the model fixes)
Loaded = Callable[[int], "tuple[Graph, Space, CostModel] | None"]


def model_source(
    load: Loaded,
    pricing: Pricing,
    shape: Shape,
    ops: tuple[str, ...],
    redo: dict[int, tuple[str, ...]] | None = None,
) -> Models:
    """``Models`` over ``load``, each microbatch count's built once: its ``StageSpace``,
    partitioner and ``--recompute all`` list (``redo``: those lists by model batch, read
    and filled: the caller's, where it has found some). A size whose graph has other ops
    than ``ops`` (the start's, in order: a layout's cuts are op indices) is None."""
    cache: dict[int, Microbatched | None] = {}
    redo = {} if redo is None else redo

    def at(microbatches: int) -> Microbatched | None:
        if microbatches not in cache:
            cache[microbatches] = _microbatched(load(microbatches), pricing, shape, ops, redo)
        return cache[microbatches]

    return at


def _microbatched(
    loaded: tuple[Graph, Space, CostModel] | None,
    pricing: Pricing,
    shape: Shape,
    ops: tuple[str, ...],
    redo: dict[int, tuple[str, ...]],
) -> Microbatched | None:
    if loaded is None:
        return None
    graph, space, cost = loaded
    if tuple(op.name for op in graph.ops) != ops:
        return None
    if graph.batch not in redo:
        redo[graph.batch] = full_recompute(graph, space, pricing.simulator(cost))
    stages = StageSpace(graph, space, pricing, shape)
    return Microbatched(stages, Partitioner(graph), cost, redo[graph.batch], kept_products(graph))
