"""MCMC search over the SOAP space (FlexFlow §6).

A proposal replaces the config of one op, drawn uniformly, by a candidate drawn uniformly;
a share of them (``region_share``) gives the same shape of config to the ops within a
random radius of it as well (``search/regions.py``), since a change to one op alone pays
for resharding to its unchanged neighbours. Metropolis–Hastings accepts it with probability
``min(1, exp(-beta * (cost(new) - cost(current)) / scale))``, so ``beta`` does not
depend on the model's units.

Before the first proposal the search evaluates every strategy built by rule: the
baselines (data parallelism, expert, single device, model parallelism, Megatron-LM's
tensor parallelism, Alpa's intra-operator ILP: ``search/baselines.py``) and data
parallelism over the first k devices for every divisor k of the device count
(``data-parallel:k``; devices are numbered node by node, so these are a node or a few).
A few chains then run interleaved, one proposal each per round, starting from the best of
those strategies (fastest first, ones that do not fit last): one-op proposals cannot walk
from 64-way data parallelism to 4-way, every step between them moves whole activations,
so a model too small for the machine is found by starting near it. ``scale``, the unit of
``beta``, is the best start's cost, so the temperature fits the costs the chains walk
among. A chain whose best has not improved for half of its proposals (after a minimum) is
replaced by one from the best strategy found so far and, every other time, from a random
strategy. The search stops at the time budget or when the best has not improved for half
of it; with ``max_evals`` also after that many proposals (each one an evaluation, a
revisited strategy answered from memory) or when the best has not improved for half of
them. Everything random comes from the seed, so a search that ends on ``max_evals``
(before the budget) is reproducible: same seed, same plan.

Each chain keeps its current strategy's simulation state, and a proposal is simulated by
delta simulation from it (``sim/delta.py``): only the slots of the changed op and its
edges are rebuilt and re-timed from the first of them, with the same timeline, memory
and ``fits`` as a full simulation.

The cost of a strategy is its simulated step time, or infinity when it does not fit in
device memory, so an infeasible plan is never returned.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from onnx2soap.errors import UserError
from onnx2soap.ir import Graph
from onnx2soap.search.baselines import BASELINES, Rule, build, narrow_data_parallel
from onnx2soap.search.ilp import IlpOptions, IlpResult
from onnx2soap.search.regions import RegionMoves
from onnx2soap.sim import Evaluation, Simulator
from onnx2soap.sim.delta import DeltaSimulator, DeltaState
from onnx2soap.soap import ParallelConfig, Partitioner, SoapDim, Strategy, candidates

MAX_BUDGET_S = 7 * 24 * 3600.0  # a week: beyond it a budget is a typo, not a plan
MAX_BETA = 1e6  # exp(-beta * x) with x >= 1e-6 is already 0 for every useful beta
MAX_EVALS = 10**9
MAX_SEED = 2**63 - 1  # numpy seeds are non-negative


@dataclass(frozen=True)
class SearchOptions:
    """Checked on construction: a NaN budget would never stop, a negative beta overflows
    the acceptance test, a negative seed is refused by numpy deep inside the search."""

    budget_s: float = 30.0
    seed: int = 0
    beta: float = 200.0
    max_evals: int | None = None
    chains: int = 3  # chains run side by side; a converged chain is replaced by a random one
    min_chain_proposals: int = 200
    # The share of proposals that give the new config's shape to the op's neighbourhood
    # too (search/regions.py); the others change the one op.
    region_share: float = 0.25
    # The ILP start's solver time limit (search/ilp.py), at most a quarter of the budget
    # (but a second): its time counts in the budget.
    ilp_time_limit_s: float = 10.0

    def __post_init__(self) -> None:
        _check_range("budget", self.budget_s, 0.0, MAX_BUDGET_S, "seconds")
        _check_range("beta", self.beta, 0.0, MAX_BETA, "")
        _check_int("seed", self.seed, 0, MAX_SEED)
        if self.max_evals is not None:
            _check_int("max-evals", self.max_evals, 1, MAX_EVALS)
        _check_int("chains", self.chains, 1, 64)
        _check_int("min_chain_proposals", self.min_chain_proposals, 1, MAX_EVALS)
        _check_range("region_share", self.region_share, 0.0, 1.0, "")
        _check_range("ilp-time-limit", self.ilp_time_limit_s, 1e-3, MAX_BUDGET_S, "seconds")

    @property
    def ilp(self) -> IlpOptions:
        return IlpOptions(min(self.ilp_time_limit_s, max(self.budget_s / 4, 1.0)))


def _check_range(name: str, value: float, low: float, high: float, unit: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not low <= value <= high:
        accepted = f"a finite number in [{low:g}, {high:g}]" + (f" {unit}" if unit else "")
        raise UserError(f"--{name} must be {accepted}, got {value!r}")


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"--{name} must be an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class Progress:
    elapsed_s: float
    budget_s: float
    evaluated: int
    best_step_time_s: float


@dataclass(frozen=True)
class Improvement:
    after_s: float  # seconds after the first proposal (0: the best start)
    proposals: int  # proposals made by then
    step_time_s: float


@dataclass(frozen=True)
class SearchResult:
    best: Strategy
    evaluation: Evaluation
    baselines: Mapping[str, Evaluation]
    evaluated: int
    time_s: float
    # every strategy built by rule and evaluated before the first proposal: the baselines
    # and data-parallel:k
    starts: Mapping[str, Evaluation] = field(default_factory=dict)
    best_from: str = "search"  # the start the best is (its name), or "search"
    setup_s: float = 0.0  # from the call to the first proposal
    proposals: int = 0
    # the best at the first proposal, then at each improvement
    history: tuple[Improvement, ...] = ()
    ilp: IlpResult | None = None  # the ILP start's account of itself


class _Evaluator:
    """Simulates strategies by delta simulation from a base state, remembering the
    evaluation of every one it has seen."""

    def __init__(self, graph: Graph, simulator: Simulator) -> None:
        self.partitioner = Partitioner(graph)
        self.delta = DeltaSimulator(simulator, self.partitioner)
        self.seen: dict[Strategy, Evaluation] = {}

    @property
    def evaluated(self) -> int:
        return len(self.seen)

    def __call__(self, strategy: Strategy) -> Evaluation:
        return self.with_state(strategy)[0]

    def with_state(
        self, strategy: Strategy, base: DeltaState | None = None
    ) -> tuple[Evaluation, DeltaState | None]:
        """The evaluation, and the state when it had to be simulated (else None)."""
        if strategy in self.seen:
            return self.seen[strategy], None
        ev, state = self.delta.evaluate(strategy, base)
        self.seen[strategy] = ev
        return ev, state

    def state(self, strategy: Strategy, base: DeltaState | None) -> DeltaState:
        return self.delta.evaluate(strategy, base)[1]


def cost_of(ev: Evaluation) -> float:
    return ev.step_time_s if ev.fits else math.inf


@dataclass
class _Chain:
    rng: np.random.Generator
    current: Strategy
    cost: float
    best_cost: float
    state: DeltaState
    evals: int = 0
    last_improvement: int = 0
    active: bool = True


class _Search:
    def __init__(self, graph, space, simulator, options: SearchOptions) -> None:
        self.graph, self.space, self.options = graph, space, options
        self.devices = simulator.machine.size
        self.evaluate = _Evaluator(graph, simulator)
        self.ops = [op.name for op in graph.ops]
        self.moves: dict[str, tuple[ParallelConfig, ...]] = {
            name: candidates(space[name], self.devices) for name in self.ops
        }
        for name, moves in self.moves.items():
            if not moves:  # even one task on one device needs every dim of size >= 1
                sizes = {d.name: d.size for d in space[name]}
                raise UserError(f"op '{name}': no config can run it (dim sizes {sizes})")
        self.regions = RegionMoves(graph, space, self.moves)
        self.best: Strategy | None = None
        self.best_cost = math.inf

    def consider(self, strategy: Strategy, cost: float) -> None:
        if cost < self.best_cost:
            self.best, self.best_cost = strategy, cost

    def random(self, rng: np.random.Generator) -> Strategy:
        """A random point of the search space."""
        return Strategy(
            self.devices,
            {n: self.moves[n][int(rng.integers(len(self.moves[n])))] for n in self.ops},
        )

    def start(
        self, strategy: Strategy, rng: np.random.Generator, base: DeltaState | None = None
    ) -> _Chain:
        ev, state = self.evaluate.with_state(strategy, base)
        cost = cost_of(ev)
        self.consider(strategy, cost)
        state = state or self.evaluate.state(strategy, base)
        return _Chain(rng, strategy, cost, cost, state)

    def _accept(self, rng: np.random.Generator, old: float, new: float, scale: float) -> bool:
        if new <= old:
            return True
        if not math.isfinite(new):
            return False
        if not math.isfinite(old):
            return True
        # new > old here and beta >= 0, so the exponent is <= 0: exp() cannot overflow
        # (it underflows to 0.0, a rejection). A degenerate scale falls back to 1.
        scale = scale if math.isfinite(scale) and scale > 0 else 1.0
        exponent = -self.options.beta * ((new - old) / scale)
        return rng.random() < math.exp(max(exponent, -745.0))

    def propose(self, chain: _Chain, scale: float) -> None:
        rng = chain.rng
        chain.evals += 1
        name = self.ops[int(rng.integers(len(self.ops)))]
        moves = self.moves[name]
        config = moves[int(rng.integers(len(moves)))]
        # None: the proposal changes nothing (found without comparing whole strategies).
        if rng.random() < self.options.region_share:
            proposal = self.regions.propose(chain.current, name, config, rng)
        elif config != chain.current[name]:
            proposal = chain.current.replace(name, config)
        else:
            proposal = None
        if proposal is not None:
            ev, state = self.evaluate.with_state(proposal, chain.state)
            cost = cost_of(ev)
            if self._accept(rng, chain.cost, cost, scale):
                chain.current, chain.cost = proposal, cost
                chain.state = state or self.evaluate.state(proposal, chain.state)
            if cost < chain.best_cost:
                chain.best_cost, chain.last_improvement = cost, chain.evals
            self.consider(proposal, cost)
        stalled = chain.evals - chain.last_improvement >= chain.evals / 2
        if chain.evals >= self.options.min_chain_proposals and stalled:
            chain.active = False


def _rule_strategies(
    graph: Graph, space, simulator: Simulator, options: SearchOptions
) -> tuple[dict[str, Strategy], IlpResult | None]:
    """The baselines, then data parallelism over the first k devices; and the ILP's
    account of itself."""
    devices = simulator.machine.size
    built = {
        rule.value: build(rule, graph, space, devices, 0, simulator, options.ilp)
        for rule in BASELINES
    }
    named = {name: b.strategy for name, b in built.items()}
    named.update(narrow_data_parallel(graph, space, devices))
    return named, built[Rule.ILP.value].ilp


def mcmc(
    graph: Graph,
    space: Mapping[str, tuple[SoapDim, ...]],
    simulator: Simulator,
    options: SearchOptions,
    progress: Callable[[Progress], None] | None = None,
) -> SearchResult:
    began = time.perf_counter()
    search = _Search(graph, space, simulator, options)
    seeds = np.random.SeedSequence(options.seed)
    named, ilp = _rule_strategies(graph, space, simulator, options)
    starts, states = {}, {}
    for name, strategy in named.items():
        starts[name], state = search.evaluate.with_state(strategy)
        states[strategy] = state or states[strategy]  # a strategy built twice: one state
        search.consider(strategy, cost_of(starts[name]))
    # The chains start from the fastest distinct strategies built by rule (a stable sort:
    # ties keep the order above); the search never returns a plan slower than any of them.
    ranked, seen = [], set()
    for name in sorted(starts, key=lambda n: cost_of(starts[n])):
        if named[name] not in seen:
            seen.add(named[name])
            ranked.append(named[name])
    chains = []
    for i in range(options.chains):
        strategy = ranked[i % len(ranked)]
        ev = starts[next(n for n, s in named.items() if s == strategy)]
        rng = np.random.default_rng(seeds.spawn(1)[0])
        chains.append(_Chain(rng, strategy, cost_of(ev), cost_of(ev), states[strategy]))
    restarts = 0

    def restart(stalled: _Chain) -> _Chain:
        """From the best so far and, every other time, from a random strategy."""
        nonlocal restarts
        restarts += 1
        rng = np.random.default_rng(seeds.spawn(1)[0])
        if restarts % 2 == 0 or search.best is None:
            return search.start(search.random(rng), rng)
        return search.start(search.best, rng, stalled.state)

    finite = [cost_of(ev) for ev in starts.values() if math.isfinite(cost_of(ev))]
    scale = min(finite, default=1.0)
    best, last_report, proposals = search.best_cost, 0.0, 0
    looped = time.perf_counter()
    setup_s = looped - began
    history = [Improvement(0.0, 0, best)]
    improved_s, improved_at = setup_s, 0
    single = all(len(moves) < 2 for moves in search.moves.values())
    while not single:  # with one strategy in the whole space there is nothing to search
        now = time.perf_counter()
        elapsed = now - began
        # Stop at the budget, or when the best has not improved for half of it.
        if elapsed >= options.budget_s or elapsed - improved_s >= options.budget_s / 2:
            break
        if options.max_evals is not None and (
            proposals >= options.max_evals or proposals - improved_at >= options.max_evals / 2
        ):
            break
        for i, chain in enumerate(chains):
            search.propose(chain, scale)
            proposals += 1
            if not chain.active:
                chains[i] = restart(chain)
        if search.best_cost < best:
            best, improved_s, improved_at = search.best_cost, elapsed, proposals
            history.append(Improvement(time.perf_counter() - looped, proposals, best))
        if progress is not None and elapsed - last_report >= 0.2:
            last_report = elapsed
            progress(Progress(elapsed, options.budget_s, search.evaluate.evaluated, best))
    if search.best is None or not math.isfinite(search.best_cost):
        raise UserError(
            "no strategy found fits in device memory; use a machine with more memory or "
            "more devices, or a smaller batch"
        )
    baselines = {rule.value: starts[rule.value] for rule in BASELINES}
    best_from = next((n for n, s in named.items() if s == search.best), "search")
    return SearchResult(
        best=search.best,
        evaluation=search.evaluate(search.best),
        baselines=baselines,
        evaluated=search.evaluate.evaluated,
        time_s=time.perf_counter() - began,
        starts=starts,
        best_from=best_from,
        setup_s=setup_s,
        proposals=proposals,
        history=tuple(history),
        ilp=ilp,
    )
