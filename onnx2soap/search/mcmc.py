"""MCMC search over the SOAP space (FlexFlow §6).

A proposal replaces the config of one op, drawn uniformly, by a candidate drawn uniformly;
a share of them (``region_share``) gives the same shape of config to the ops within a
random radius of it as well (``search/regions.py``), since a change to one op alone pays
for resharding to its unchanged neighbours; another share (``group_share``) changes a
group of related ops at once (``search/groups.py``): the op's chain of lightweight
followers, its siblings (every op of its signature: the same layer elsewhere), the same
change in every instance of a repeated block, or one instance's configs copied to the
others. Metropolis–Hastings accepts a proposal with probability
``min(1, exp(-beta * (cost(new) - cost(current)) / scale))``, so ``beta`` does not
depend on the model's units.

Before the first proposal the search evaluates every strategy built by rule (the
smallest task graph first, ``data-parallel:k`` after the others, none begun once the
budget has passed or that would hold more than ``MAX_STARTS_SIZE`` tasks with those
before):
the baselines (data parallelism, expert, single device, model parallelism, Megatron-LM's
tensor parallelism, Alpa's intra-operator ILP: ``search/baselines.py``) and data
parallelism over the first k devices for every divisor k of the device count
(``data-parallel:k``; devices are numbered node by node, so these are a node or a few).
One-op proposals cannot walk from 64-way data parallelism to 4-way, every step between
them moves whole activations, so where the walk starts matters. ``Restarts.HALVING``
(the default) walks from every distinct start: the first half of the budget runs in
rounds of successive halving (every start walked by turns, then the half whose walks
reached the lowest cost, and so on down to one), the second half walks on from the
last; a chain that stalls (no improvement for half its proposals, after a minimum)
restarts from the best its start's walk has found. The result reports each start's walk
(``StartWalk``) and the fastest start, so the walk's gain over it is measured.
``Restarts.BEST`` is the walk before that (chains from the fastest starts, a stalled
chain restarted from the best so far or a random strategy), kept to measure against.
``scale``, the unit of ``beta``, is the best start's cost, so the temperature fits the
costs the chains walk among.

The budget begins at the call: the setup (every start built by rule and simulated in
full, the ILP's solve within its own time limit, at most a quarter of the budget) counts
in it and is reported (``setup_s``), and the walk has what is left (none where the
setup took it all: a LLaMA-3-8B shape's on 128 devices takes 25 s). The ZeRO pricing
after the walk is reported apart (``zero_s``). The search stops at the time budget,
with ``max_evals`` also after that many proposals (each one an evaluation, a revisited
strategy answered from memory; the rounds are then counted in proposals, not seconds),
or when the best has not improved for half of the last round (``Restarts.BEST``: for
half the budget). Everything random comes from the seed, so a search that ends on
``max_evals`` (before the budget) is reproducible: same seed, same plan.

Each chain keeps its current strategy's simulation state, and a proposal is simulated by
delta simulation from it (``sim/delta.py``): only the slots of the changed ops and their
edges are rebuilt and re-timed from the first of them, with the same timeline, memory
and ``fits`` as a full simulation, however many ops a proposal changes.

The walk orders strategies by ``Cost``: every plan that fits in device memory before any
that does not, those that fit by their simulated step time, those that do not by how
many bytes they overflow the devices' memory (summed over devices), then by step time.
So a walk whose starts all overflow (every plan costing infinity, it had been blind)
moves toward plans that fit, and once it holds one never accepts one that does not;
an infeasible plan is never returned.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from onnx2soap.errors import UserError
from onnx2soap.ir import Graph
from onnx2soap.search.baselines import BASELINES, Rule, build, narrow_data_parallel
from onnx2soap.search.context import sequence_length
from onnx2soap.search.groups import GroupMove, GroupMoves
from onnx2soap.search.ilp import IlpOptions, IlpResult
from onnx2soap.search.margin import steadiest
from onnx2soap.search.regions import RegionMoves
from onnx2soap.search.zero_layers import fastest_layered, layer_groups
from onnx2soap.sim import Evaluation, Simulator
from onnx2soap.sim.delta import DeltaSimulator, DeltaState
from onnx2soap.sim.heap import collector_paused
from onnx2soap.soap import ParallelConfig, Partitioner, SoapDim, Strategy, candidates
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.partition import rect_volume
from onnx2soap.soap.zero import ZERO_STAGES, Zero, ZeroStage, data_parallel_groups, zero_group

MAX_BUDGET_S = 7 * 24 * 3600.0  # a week: beyond it a budget is a typo, not a plan
MAX_BETA = 1e6  # exp(-beta * x) with x >= 1e-6 is already 0 for every useful beta
MAX_EVALS = 10**9
MAX_SEED = 2**63 - 1  # numpy seeds are non-negative


class Restarts(Enum):
    """How the walk spends its budget over the strategies built by rule."""

    # Every distinct start walked, and the budget's first half spent in rounds that
    # halve them: each round the starts whose walks have reached the lowest cost go on
    # (successive halving); the last one walks the second half.
    HALVING = "halving"
    # The walk before issue 31: ``chains`` chains from the fastest starts, a stalled
    # chain restarted from the best so far or, every other time, a random strategy.
    BEST = "best"


@dataclass(frozen=True)
class SearchOptions:
    """Checked on construction: a NaN budget would never stop, a negative beta overflows
    the acceptance test, a negative seed is refused by numpy deep inside the search."""

    budget_s: float = 30.0
    seed: int = 0
    beta: float = 200.0
    max_evals: int | None = None
    # Restarts.BEST: chains run side by side; a converged chain is replaced by a random one
    chains: int = 3
    min_chain_proposals: int = 200
    # The share of proposals that give the new config's shape to the op's neighbourhood
    # too (search/regions.py); the others change the one op.
    region_share: float = 0.25
    # The share of proposals (after the region moves') that change a group of related
    # ops at once (search/groups.py): siblings, a repeated block, an op's chain.
    group_share: float = 0.25
    restarts: Restarts = Restarts.HALVING
    # The ILP start's solver time limit (search/ilp.py), at most a quarter of the budget
    # (but a second): its time counts in the budget.
    ilp_time_limit_s: float = 10.0
    # The ZeRO stages the search may give its plan (soap/zero.py): after the walk, its
    # best and its leading starts are priced under each (``_with_zero``). () : none.
    zero_stages: tuple[ZeroStage, ...] = ZERO_STAGES
    # False: where no plan found fits, return the one that overflows least (its
    # ``SearchResult.unfit`` says why) instead of refusing: a caller that goes on to
    # pipelines and recomputation (pipeline_choice.py) may still find one that fits.
    must_fit: bool = True
    # Plans given to walk from beside the rules' (``plan --start``'s), by name.
    starts: tuple[tuple[str, Strategy], ...] = ()

    def __post_init__(self) -> None:
        _check_range("budget", self.budget_s, 0.0, MAX_BUDGET_S, "seconds")
        _check_range("beta", self.beta, 0.0, MAX_BETA, "")
        _check_int("seed", self.seed, 0, MAX_SEED)
        if self.max_evals is not None:
            _check_int("max-evals", self.max_evals, 1, MAX_EVALS)
        _check_int("chains", self.chains, 1, 64)
        _check_int("min_chain_proposals", self.min_chain_proposals, 1, MAX_EVALS)
        _check_range("region_share", self.region_share, 0.0, 1.0, "")
        _check_range("group_share", self.group_share, 0.0, 1.0, "")
        if not isinstance(self.restarts, Restarts):
            raise UserError(f"restarts must be one of {[r.value for r in Restarts]}")
        _check_range("ilp-time-limit", self.ilp_time_limit_s, 1e-3, MAX_BUDGET_S, "seconds")
        if any(z not in ZERO_STAGES for z in self.zero_stages):
            raise UserError(f"zero_stages must be among {[int(z) for z in ZERO_STAGES]}")

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
class StartWalk:
    """One distinct strategy built by rule and the walk from it (``Restarts.HALVING``)."""

    names: tuple[str, ...]  # the rules that built it, the first the one it is named by
    start_step_time_s: float
    start_fits: bool
    best_step_time_s: float  # the best its walk reached (inf: nothing that fits)
    proposals: int
    rounds: int  # the rounds of the halving it was walked in


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
    setup_s: float = 0.0  # from the call to the first proposal: inside the budget
    proposals: int = 0
    # the best at the first proposal, then at each improvement
    history: tuple[Improvement, ...] = ()
    ilp: IlpResult | None = None  # the ILP start's account of itself
    # the fastest start that fits (None: none fits): what the walk is measured against
    best_start: str | None = None
    walks: tuple[StartWalk, ...] = ()  # per distinct start, fastest first
    # the plan's ZeRO stage (``evaluation`` is under it), and every plan priced under a
    # stage after the walk: (its name, the stage, its evaluation under it)
    zero_stage: ZeroStage = ZeroStage.NONE
    zero_weights: tuple[tuple[str, ZeroStage], ...] = ()  # weights at another stage
    zero_tried: tuple[tuple[str, ZeroStage, Evaluation], ...] = ()
    zero_s: float = 0.0  # pricing them, after the walk
    # where ``evaluation`` does not fit (``SearchOptions.must_fit`` False): the refusal
    # the search would have raised, for the caller to raise if nothing else fits
    unfit: str | None = None
    # the plan predicted fastest, where the machine's margin kept a start that moves
    # fewer bytes in its place (``search/margin.py``); None: the fastest was kept
    passed_over: Evaluation | None = None
    # the starts built but not simulated: past the budget, or ``MAX_STARTS_SIZE``
    skipped: tuple[str, ...] = ()

    @property
    def zero(self) -> Zero:
        """Every weight's stage (``zero_stage``, but ``zero_weights``'s)."""
        return Zero(self.zero_stage, self.zero_weights)

    @property
    def walk_gain(self) -> float | None:
        """The best start's step time over the search's: what the walk added (1: nothing),
        whether or not the machine's margin kept it."""
        if self.best_start is None:
            return None
        reached = self.passed_over or self.evaluation
        return self.starts[self.best_start].step_time_s / reached.step_time_s


class _Evaluator:
    """Simulates strategies by delta simulation from a base state, remembering the
    evaluation of every one it has seen."""

    def __init__(self, graph: Graph, simulator: Simulator) -> None:
        self.partitioner, self.simulator = Partitioner(graph), simulator
        self._delta: DeltaSimulator | None = None
        self.seen: dict[Strategy, Evaluation] = {}
        self._allowance: float = math.inf  # segments the walk may add: ``bound``
        self._since = 0

    @property
    def delta(self) -> DeltaSimulator:
        if self._delta is None:
            self._delta = DeltaSimulator(self.simulator, self.partitioner)
        return self._delta

    def forget(self) -> None:
        """Let go of the memoized segments (every plan simulated keeps its evaluation):
        a plan simulated after this is simulated afresh, or by delta from a state made
        before (a state holds its own segments)."""
        self._delta = None
        self._since = 0

    def memoized(self) -> int:
        """The op and edge slots' segments held for reuse."""
        d = self._delta
        return 0 if d is None else len(d.op_segments) + len(d.edge_segments)

    def bound(self) -> None:
        """From here on (the walk), at most half again as many segments as now (the
        starts') are held for reuse: past that they are let go. A walk's proposals (a
        group move changes every layer) had doubled a LLaMA-3-8B shape's memo on 128
        devices in 40 s, to 2.1 GB; what the chains' states hold stays either way."""
        self._allowance, self._since = max(self.memoized() // 2, 1), self.memoized()

    def trim(self) -> None:
        if self.memoized() - self._since > self._allowance:
            self.forget()

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
    """The step time, or infinity where the plan does not fit in device memory."""
    return ev.step_time_s if ev.fits else math.inf


@dataclass(frozen=True, order=True)
class Cost:
    """A strategy's place in the walk's order: fitting plans (``overflow`` 0) by step time,
    before every plan that does not fit; those by their overflow, then by step time."""

    overflow: float  # bytes past the devices' memory, summed over devices; 0: it fits
    step_time_s: float

    @property
    def fits(self) -> bool:
        return self.overflow == 0

    @property
    def seconds(self) -> float:
        """The step time where it fits, else infinity (``cost_of``)."""
        return self.step_time_s if self.fits else math.inf


NOWHERE = Cost(math.inf, math.inf)  # worse than any strategy: the best before the first


def cost_in(ev: Evaluation, memory: Sequence[int]) -> Cost:
    """``ev``'s cost on devices of ``memory`` bytes each (the simulator's machine)."""
    if ev.fits:
        return Cost(0, ev.step_time_s)
    over = sum(max(p - m, 0) for p, m in zip(ev.peak_memory_bytes, memory, strict=False))
    return Cost(max(over, 1), ev.step_time_s)


@dataclass(frozen=True)
class Scale:
    """The units of ``beta``: seconds between plans that fit, bytes between plans that do
    not (the best start's step time, the least overflow of a start)."""

    seconds: float = 1.0
    bytes: float = 1.0

    @staticmethod
    def of(costs: Iterable[Cost]) -> Scale:
        costs = list(costs)
        times = [c.step_time_s for c in costs if c.fits and c.step_time_s > 0]
        overflows = [c.overflow for c in costs if not c.fits and math.isfinite(c.overflow)]
        return Scale(min(times, default=1.0), min(overflows, default=1.0))


@dataclass
class _Chain:
    rng: np.random.Generator
    current: Strategy
    cost: Cost
    best_cost: Cost
    state: DeltaState | None  # None once the chain walks no more
    best: Strategy
    evals: int = 0
    last_improvement: int = 0
    active: bool = True
    # the ops with a task on the fullest device of ``full_of`` (the current plan, where
    # it overflows): the pivots that can bring it down
    full_of: Strategy | None = None
    full_ops: tuple[str, ...] = ()


# The share of proposals from a plan that overflows whose pivot is drawn among the ops on
# its fullest device: a LLaMA-3-8B shape's model parallelism over 64 H100s overflows one
# device of 64 (its LM head and loss), which a pivot drawn among all 2,225 ops reaches
# once in 2,225 proposals.
FULLEST_SHARE = 0.5


class _Search:
    def __init__(self, graph, space, simulator, options: SearchOptions) -> None:
        self.graph, self.space, self.options = graph, space, options
        self.devices = simulator.machine.size
        self.memory = tuple(d.memory for d in simulator.machine.devices)
        self.evaluate = _Evaluator(graph, simulator)
        self.ops = [op.name for op in graph.ops]
        copied = weight_only_ops(graph)
        self.moves: dict[str, tuple[ParallelConfig, ...]] = {
            name: candidates(space[name], self.devices, name in copied) for name in self.ops
        }
        for name, moves in self.moves.items():
            if not moves:  # even one task on one device needs every dim of size >= 1
                sizes = {d.name: d.size for d in space[name]}
                raise UserError(f"op '{name}': no config can run it (dim sizes {sizes})")
        self.regions = RegionMoves(graph, space, self.moves)
        self.groups = GroupMoves(graph, space, self.regions)
        self.best: Strategy | None = None
        self.best_cost = NOWHERE

    def cost(self, ev: Evaluation) -> Cost:
        return cost_in(ev, self.memory)

    def consider(self, strategy: Strategy, cost: Cost) -> None:
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
        cost = self.cost(ev)
        self.consider(strategy, cost)
        state = state or self.evaluate.state(strategy, base)
        return _Chain(rng, strategy, cost, cost, state, strategy)

    def _accept(self, rng: np.random.Generator, old: Cost, new: Cost, scale: Scale) -> bool:
        """Metropolis-Hastings in the walk's order: on step time between plans that fit,
        on overflow between plans that do not (on step time where they overflow alike);
        a plan that fits is never left for one that does not."""
        if new <= old:
            return True
        if old.fits and not new.fits:
            return False
        if new.fits or new.overflow == old.overflow:
            delta, unit = new.step_time_s - old.step_time_s, scale.seconds
        else:
            delta, unit = new.overflow - old.overflow, scale.bytes
        if not math.isfinite(delta):
            return False
        # new > old here and beta >= 0, so the exponent is <= 0: exp() cannot overflow
        # (it underflows to 0.0, a rejection). A degenerate scale falls back to 1.
        unit = unit if math.isfinite(unit) and unit > 0 else 1.0
        exponent = -self.options.beta * (delta / unit)
        return rng.random() < math.exp(max(exponent, -745.0))

    def fullest_ops(self, chain: _Chain) -> tuple[str, ...]:
        """The ops with a task on the device the chain's current plan overflows most."""
        if chain.full_of is not chain.current:
            peaks = self.evaluate(chain.current).peak_memory_bytes
            over = [p - m for p, m in zip(peaks, self.memory, strict=False)]
            device = max(range(len(over)), key=over.__getitem__)
            chain.full_of = chain.current
            chain.full_ops = tuple(n for n in self.ops if device in chain.current[n].devices)
        return chain.full_ops

    def pivot(self, chain: _Chain) -> str:
        """The op a proposal changes: any, or from a plan that overflows, as often as not
        one on its fullest device (the draw only then: a walk among plans that fit draws
        as before)."""
        rng = chain.rng
        if not chain.cost.fits and rng.random() < FULLEST_SHARE:
            ops = self.fullest_ops(chain)
            if ops:
                return ops[int(rng.integers(len(ops)))]
        return self.ops[int(rng.integers(len(self.ops)))]

    def propose(self, chain: _Chain, scale: Scale) -> None:
        rng = chain.rng
        chain.evals += 1
        name = self.pivot(chain)
        moves = self.moves[name]
        config = moves[int(rng.integers(len(moves)))]
        # None: the proposal changes nothing (found without comparing whole strategies).
        # One draw picks the kind, so a search without group moves draws as before them.
        kind = rng.random()
        regions, groups = self.options.region_share, self.options.group_share
        if kind < regions:
            proposal = self.regions.propose(chain.current, name, config, rng)
        elif kind < regions + groups and self.groups.groups.related(name):
            move = GROUP_MOVES[int(rng.integers(len(GROUP_MOVES)))]
            proposal = self.groups.propose(chain.current, name, config, move, rng)
        elif config != chain.current[name]:
            proposal = chain.current.replace(name, config)
        else:
            proposal = None
        if proposal is not None:
            ev, state = self.evaluate.with_state(proposal, chain.state)
            cost = self.cost(ev)
            if self._accept(rng, chain.cost, cost, scale):
                chain.current, chain.cost = proposal, cost
                chain.state = state or self.evaluate.state(proposal, chain.state)
            if cost < chain.best_cost:
                chain.best_cost, chain.best, chain.last_improvement = cost, proposal, chain.evals
            self.consider(proposal, cost)
        stalled = chain.evals - chain.last_improvement >= chain.evals / 2
        if chain.evals >= self.options.min_chain_proposals and stalled:
            chain.active = False


GROUP_MOVES = tuple(GroupMove)


def _rule_strategies(
    graph: Graph, space, simulator: Simulator, options: SearchOptions
) -> tuple[dict[str, Strategy], IlpResult | None]:
    """The baselines, then data parallelism over the first k devices, and for a model of
    sequences context parallelism and Megatron's with sequence parallelism; and the
    ILP's account of itself."""
    devices = simulator.machine.size
    built = {
        rule.value: build(rule, graph, space, devices, 0, simulator, options.ilp)
        for rule in BASELINES
    }
    named = {name: b.strategy for name, b in built.items()}
    named.update(narrow_data_parallel(graph, space, devices))
    named.update(_sequence_starts(graph, space, simulator))
    named.update(options.starts)
    return named, built[Rule.ILP.value].ilp


def _sequence_starts(graph: Graph, space, simulator: Simulator) -> dict[str, Strategy]:
    """Splits along the sequence, where the model reads one (token ids, or features a
    token) and the machine has more than one device."""
    devices = simulator.machine.size
    try:
        sequence_length(graph)
    except UserError:
        return {}
    if devices == 1:
        return {}
    sp = build(Rule.MEGATRON, graph, space, devices, 0, simulator, sequence_parallel=True)
    context = build(Rule.CONTEXT, graph, space, devices, 0, simulator).strategy
    starts = {Rule.CONTEXT.value: context, "megatron-sequence-parallel": sp.strategy}
    # the rule balances causal work by head and tail chunks, which moves K and V in
    # smaller pieces: contiguous chunks start too, and the walk keeps the faster
    contiguous = build(Rule.CONTEXT, graph, space, devices, 0, simulator, head_tail=False)
    if contiguous.strategy != context:
        starts["context-contiguous"] = contiguous.strategy
    return starts


# The most the starts' simulations may hold together, in tasks plus tile overlaps of
# their partitions: each holds about 340 bytes (LLaMA-3-8B's 13 distinct starts on 128
# H100s are 2.9 M and held 1 GB; a 70B-shaped Llama's on 256 are 22.8 M and held 7.9 GB),
# and the walk's memo may add half as much again. LLaMA-3-8B's all fit on 128 H100s.
MAX_STARTS_SIZE = 3_500_000


def _simulate_starts(
    search: _Search, named: Mapping[str, Strategy], began: float, budget_s: float
) -> tuple[dict[str, Evaluation], dict[Strategy, DeltaState], tuple[str, ...]]:
    """Each start simulated in full (a delta from the nearest start saved nothing: a
    LLaMA-3-8B shape on 64 devices, 25.7 against 26.1 s of CPU, its first changed op near
    the front): the rules' plans before data parallelism over fewer devices, each the
    smallest first (its partition's tasks and tile overlaps: what its simulation builds
    and holds; the partitioner keeps them for the simulation), none begun once the
    budget has passed or that would take the starts past ``MAX_STARTS_SIZE`` (a pace
    measured on the small ones said nothing of the big: a simulation's fixed cost made
    Megatron's on 256 devices look 250 s long). Those are skipped, named in the third
    item: on a big model on many devices one start takes tens of seconds and GBs (a
    70B-shaped Llama on 256 H100s: Krizhevsky's rule 20 M tasks, 28 s, 6 GB). The first
    is always simulated."""
    partitioner = search.evaluate.partitioner

    def size(strategy: Strategy) -> int:
        pg = partitioner.partition(strategy)
        return sum(map(len, pg.tasks.values())) + sum(len(e.overlaps) for e in pg.edges)

    sizes = {name: size(strategy) for name, strategy in named.items()}
    # the rules' plans first, then data parallelism over fewer devices (``data-parallel:k``,
    # stepping stones for the walk), each by size
    narrow = f"{Rule.DATA_PARALLEL.value}:"
    order = sorted(named, key=lambda n: (n.startswith(narrow), sizes[n]))
    simulated: dict[str, Evaluation] = {}
    states: dict[Strategy, DeltaState] = {}
    skipped = []
    held = 0  # the sizes simulated
    for name in order:  # a stable sort: ties in the rules' order
        strategy = named[name]
        late = time.perf_counter() - began > budget_s
        if simulated and strategy not in states and (late or held + sizes[name] > MAX_STARTS_SIZE):
            skipped.append(name)
            continue
        if strategy not in states:  # a strategy built twice is held once
            held += sizes[name]
        simulated[name], state = search.evaluate.with_state(strategy)
        states[strategy] = state or states[strategy]
    return simulated, states, tuple(skipped)


def mcmc(
    graph: Graph,
    space: Mapping[str, tuple[SoapDim, ...]],
    simulator: Simulator,
    options: SearchOptions,
    progress: Callable[[Progress], None] | None = None,
) -> SearchResult:
    # the setup's and the walk's plans and memos are millions of long-lived tuples
    # (sim/heap.py), the ILP's model too
    with collector_paused():
        return _mcmc(graph, space, simulator, options, progress)


def _mcmc(
    graph: Graph,
    space: Mapping[str, tuple[SoapDim, ...]],
    simulator: Simulator,
    options: SearchOptions,
    progress: Callable[[Progress], None] | None,
) -> SearchResult:
    began = time.perf_counter()
    search = _Search(graph, space, simulator, options)
    seeds = np.random.SeedSequence(options.seed)
    named, ilp = _rule_strategies(graph, space, simulator, options)
    simulated, states, skipped = _simulate_starts(search, named, began, options.budget_s)
    starts = {name: simulated[name] for name in named if name in simulated}
    for name, ev in starts.items():  # in the rules' order: the first of equals is kept
        search.consider(named[name], search.cost(ev))
    # The distinct strategies built by rule, fastest first (a stable sort: ties keep the
    # order above), each with the names of the rules that built it; the search never
    # returns a plan slower than any of them.
    ranked: dict[Strategy, list[str]] = {}
    for name in sorted(starts, key=lambda n: search.cost(starts[n])):
        ranked.setdefault(named[name], []).append(name)
    scale = Scale.of(search.cost(ev) for ev in starts.values())
    # The budget begins at the call: the setup (every start built and simulated in full,
    # the ILP's solve) counts in it, and the walk has what is left.
    clock = _Clock(search, options, began, progress, scale=scale)
    walks: list[_Walk] = []
    single = all(len(moves) < 2 for moves in search.moves.values())
    # with one strategy in the whole space there is nothing to walk
    if not single and options.restarts is Restarts.HALVING:
        for strategy, names in ranked.items():
            rng = np.random.default_rng(seeds.spawn(1)[0])
            cost = search.cost(starts[names[0]])
            chain = _Chain(rng, strategy, cost, cost, states[strategy], strategy)
            walks.append(_Walk(tuple(names), chain, strategy, cost))
        states.clear()  # each chain holds its own; a start's goes once its chain moves on
        search.evaluate.bound()
        _walk_halving(search, clock, walks, seeds)
    elif not single:
        search.evaluate.bound()
        _walk_best(search, clock, list(ranked), states, seeds)
        states.clear()
    walked = time.perf_counter()
    # What follows prices plans already evaluated (their evaluations are kept), and
    # ZeRO's on simulators of its own: the walk's states and memoized segments go first
    # (a LLaMA-3-8B shape on 128 devices held 2.9 GB of them, 3.5 with ZeRO's beside).
    for walk in walks:
        walk.chain.state = None
    search.evaluate.forget()
    top = max(options.zero_stages, default=ZeroStage.NONE)
    finalists = _finalists(search, walks, ranked, top, simulator)
    zero = _with_zero(search, simulator, finalists, options.zero_stages)
    fastest = zero.evaluation
    zero = _steadied(zero, named, starts, search, simulator.machine.margin)
    zero_s = time.perf_counter() - walked
    unfit = None
    if zero.strategy is None or not zero.cost.fits:
        unfit = unfit_message(_closest(zero, named, search))
        if options.must_fit or zero.strategy is None:
            raise UserError(unfit)
    baselines = {rule.value: starts[rule.value] for rule in BASELINES if rule.value in starts}
    best_from = next((n for n, s in named.items() if s == zero.strategy), "search")
    fitting = [names[0] for names in ranked.values() if starts[names[0]].fits]
    return SearchResult(
        best=zero.strategy,
        evaluation=zero.evaluation,
        baselines=baselines,
        evaluated=search.evaluate.evaluated,
        time_s=time.perf_counter() - began,
        starts=starts,
        best_from=best_from,
        setup_s=clock.looped - began,
        proposals=clock.proposals,
        history=tuple(clock.history),
        ilp=ilp,
        best_start=fitting[0] if fitting else None,
        walks=tuple(w.result(starts) for w in walks),
        zero_stage=zero.stage,
        zero_weights=zero.weights,
        zero_tried=zero.tried,
        zero_s=zero_s,
        unfit=unfit,
        passed_over=fastest if zero.evaluation is not fastest else None,
        skipped=skipped,
    )


def _steadied(
    zero: _Zeroed,
    named: Mapping[str, Strategy],
    starts: Mapping[str, Evaluation],
    search: _Search,
    margin: float,
) -> _Zeroed:
    """The search's plan, or the start that the machine's margin keeps in its place: one
    predicted within the margin that moves fewer bytes (``search/margin.py``)."""
    if zero.strategy is None or zero.evaluation is None:
        return zero
    found = "the search's plan"  # no start's name: the rules' names are their values
    pick = steadiest(found, {found: zero.evaluation, **starts}, margin)
    if pick == found:
        return zero
    kept = starts[pick]
    return replace(
        zero,
        strategy=named[pick],
        stage=ZeroStage.NONE,
        weights=(),
        cost=search.cost(kept),
        evaluation=kept,
    )


def unfit_message(closest: str) -> str:
    """The refusal where no plan fits, with ``closest_words``' account of the nearest."""
    return (
        f"no strategy found fits in device memory{closest}; use a machine with more "
        "memory or more devices, or a smaller batch"
    )


def closest_words(name: str, peak: int, memory: int) -> str:
    return f" (the closest, {name}, needs {size_words(peak)} of {size_words(memory)} on a device)"


def _closest(zero: _Zeroed, named: Mapping[str, Strategy], search: _Search) -> str:
    """Where the search came nearest: the plan that overflows least, its fullest device."""
    if zero.evaluation is None:
        return ""
    name = next((n for n, s in named.items() if s == zero.strategy), "the walk's")
    zeroed = Zero(zero.stage, zero.weights)
    stage = f" with {zeroed.label}" if zeroed else ""
    peak, memory = max(zero.evaluation.peak_memory_bytes), max(search.memory)
    return closest_words(f"{name}{stage}", peak, memory)


def size_words(n: float) -> str:
    unit = next((u for u in range(4, 0, -1) if n >= 1024**u), 0)
    return f"{n / 1024**unit:.4g} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[unit]}"


# At most this many plans priced under ZeRO after the walk, the fastest first (each a
# full simulation of a big model: a LLaMA-3-8B shape on 64 devices, 3 to 5 s).
ZERO_FINALISTS = 4
# A ZeRO plan that fits replaces one that fits without ZeRO only if it is this much
# faster: its gain is the sharded update, and the simulator does not model the compute
# that a rank's wait for its previous reduce-scatter may hold up (docs/architecture.md).
ZERO_GAIN = 0.01


def _finalists(
    search: _Search,
    walks: Sequence[_Walk],
    ranked: Mapping[Strategy, list[str]],
    stage: ZeroStage,
    simulator: Simulator,
) -> dict[Strategy, str]:
    """The plans worth pricing under ZeRO ``stage``, each with its name: among the
    starts, the walks' bests and the search's best, those that ZeRO could bring within
    memory (``_could_fit``) and, where the search's best fits, that are faster than it
    (data parallelism that just overflows) or are it (ZeRO may speed it up), fastest
    first, ``ZERO_FINALISTS`` of them and the search's best."""
    named = {strategy: names[0] for strategy, names in ranked.items()}
    for walk in walks:
        named.setdefault(walk.best, f"walk from {walk.names[0]}")
    best, cost = search.best, search.best_cost
    if best is not None:
        named.setdefault(best, "search")

    def seconds(strategy: Strategy) -> float:
        return search.evaluate(strategy).step_time_s

    worth = [
        strategy
        for strategy in named
        if (strategy == best or not cost.fits or seconds(strategy) < cost.step_time_s)
        and _could_fit(search, strategy, stage, simulator)
    ]
    chosen = sorted((s for s in worth if s != best), key=seconds)[:ZERO_FINALISTS]
    if best in worth:
        chosen.append(best)
    return {strategy: named[strategy] for strategy in chosen}


@dataclass(frozen=True)
class _Zeroed:
    """The plan the search returns: its strategy, ZeRO stage (``weights`` at another),
    cost and evaluation."""

    strategy: Strategy | None
    stage: ZeroStage
    cost: Cost
    evaluation: Evaluation | None
    tried: tuple[tuple[str, ZeroStage, Evaluation], ...] = ()
    weights: tuple[tuple[str, ZeroStage], ...] = ()


def _could_fit(search: _Search, strategy: Strategy, stage: ZeroStage, simulator: Simulator) -> bool:
    """Whether ``stage`` could bring ``strategy`` within every device's memory: what it
    shards (the optimizer's state, at stage 2 the gradient, at 3 the weight too: the rows
    of every replicated trainable Rect but the device's own) bounds what it saves. False
    where it shards nothing (``check_zero``)."""
    pg = search.evaluate.partitioner.partition(strategy)
    groups = [g for gs in pg.groups.values() for g in gs]
    if stage is ZeroStage.NONE or not data_parallel_groups(groups):
        return False
    arrays = simulator.optimizer_slots + stage.shards_gradients + stage.shards_weights
    saved = [0] * len(search.memory)
    for group in groups:
        sharded = zero_group(group, stage)
        for d in group.devices if sharded is not None else ():
            saved[d] += arrays * simulator.itemsize * (rect_volume(group.rect) - sharded.numel(d))
    peaks = search.evaluate(strategy).peak_memory_bytes
    return all(p - s <= m for p, s, m in zip(peaks, saved, search.memory, strict=False))


def _with_zero(
    search: _Search,
    simulator: Simulator,
    finalists: Mapping[Strategy, str],
    stages: Sequence[ZeroStage],
) -> _Zeroed:
    """The walk's best, or a finalist under a ZeRO stage where that costs less: fits
    where the walk's best does not, or runs faster (ZeRO trades the all-reduce for a
    reduce-scatter and an all-gather of the same bytes, and updates a shard). The walk
    itself prices plans without ZeRO; a stage applies only to plans with a weight
    replicated over devices (``check_zero``). Every finalist (``_finalists``) is priced
    under the highest stage (the least memory; at stage 3 an all-gather more, before
    each use), the one it makes fastest then under the lower ones too, the lowest kept
    that costs no more."""
    best = search.best
    plain = search.evaluate(best) if best is not None else None
    chosen = _Zeroed(best, ZeroStage.NONE, search.best_cost, plain)
    replicated = list(finalists.items())
    if not replicated or not stages:
        return chosen
    tried: list[tuple[str, ZeroStage, Evaluation]] = []

    def price(stage: ZeroStage, plans: Sequence[tuple[Strategy, str]]) -> _Zeroed:
        found = _Zeroed(None, stage, NOWHERE, None)
        for strategy, name in plans:
            ev = _under(simulator, stage, search.evaluate.partitioner, strategy)
            tried.append((name, stage, ev))
            if search.cost(ev) < found.cost:
                found = _Zeroed(strategy, stage, search.cost(ev), ev)
        return found

    top, *lower = sorted(stages, reverse=True)
    zeroed = price(top, replicated)
    if zeroed.strategy is not None:
        pick = (zeroed.strategy, finalists[zeroed.strategy])
        for stage in sorted(lower):
            low = price(stage, [pick])
            if low.cost <= zeroed.cost:
                zeroed = low
                break
        else:
            if zeroed.stage is ZeroStage.PARAMETERS and zeroed.cost.fits and lower:
                layered = _layered(search, simulator, zeroed, max(lower), pick[1], tried)
                zeroed = min(zeroed, layered, key=lambda z: z.cost)
    if chosen.cost.fits and zeroed.cost.fits:
        better = zeroed.cost.step_time_s < chosen.cost.step_time_s * (1 - ZERO_GAIN)
    else:
        better = zeroed.cost < chosen.cost  # one that fits, else the least overflow
    return replace(zeroed if better else chosen, tried=tuple(tried))


def _under(
    simulator: Simulator, zero: Zero | ZeroStage, partitioner: Partitioner, strategy: Strategy
) -> Evaluation:
    """``strategy`` under ``zero``, simulated in full (its flat task graph, as plan and
    simulate price it; a delta simulator's segments and state were a finalist's only
    reuse, and their memos together had LLaMA-3-8B's search on 128 devices at 3.5 GB).
    Its memo shares the walk's durations and collectives' times: none depends on ZeRO."""
    staged = replace(simulator, zero=zero, memo=simulator.memo.sharing())
    return staged.evaluate(partitioner.partition(strategy))


def _layered(
    search: _Search,
    simulator: Simulator,
    zeroed: _Zeroed,
    low: ZeroStage,
    name: str,
    tried: list[tuple[str, ZeroStage, Evaluation]],
) -> _Zeroed:
    """``zeroed`` (a plan that fits under ZeRO-3) with its first groups of layers at
    ``low`` instead, the fastest that fits (``zero_layers.py``); ``zeroed`` where none
    fits so."""
    groups = layer_groups(search.graph, search.space)

    def price(zero: Zero) -> Evaluation:
        ev = _under(simulator, zero, search.evaluate.partitioner, zeroed.strategy)
        tried.append((f"{name}, {zero.label}", ZeroStage.PARAMETERS, ev))
        return ev

    # ``low`` everywhere: priced by ``_with_zero`` already, which kept stage 3
    found = fastest_layered(groups, ZeroStage.PARAMETERS, low, price, every=False)
    if found is None:
        return zeroed
    zero = found.zero
    return _Zeroed(
        zeroed.strategy,
        zero.stage,
        search.cost(found.evaluation),
        found.evaluation,
        weights=zero.weights,
    )


@dataclass
class _Clock:
    """The budget as the walk spends it: proposals, seconds, the best and its history."""

    search: _Search
    options: SearchOptions
    began: float
    progress: Callable[[Progress], None] | None
    scale: Scale  # the units of beta (the starts')
    proposals: int = 0
    looped: float = field(default_factory=time.perf_counter)  # the first proposal's time
    best: Cost = NOWHERE
    improved_s: float = 0.0  # seconds from ``began`` to the last improvement
    improved_at: int = 0  # proposals made by then
    last_report: float = 0.0
    history: list[Improvement] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.best = self.search.best_cost
        self.improved_s = self.looped - self.began
        self.history.append(Improvement(0.0, 0, self.best.seconds))

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def used(self) -> float:
        """The share of the budget spent: of ``max_evals`` where set (so a search that
        ends on it is reproducible), else of the seconds."""
        if self.options.max_evals is not None:
            return self.proposals / self.options.max_evals
        return self.elapsed() / self.options.budget_s if self.options.budget_s > 0 else 1.0

    def over(self) -> bool:
        limit = self.options.max_evals
        return self.elapsed() >= self.options.budget_s or (
            limit is not None and self.proposals >= limit
        )

    def stalled(self) -> bool:
        """The best has not improved for half the budget (seconds, or proposals)."""
        return self.stalled_since(0.0, 0)

    def stalled_since(self, began_s: float, began_at: int) -> bool:
        """The best has not improved for half of what was left of the budget at
        ``began_s`` seconds and ``began_at`` proposals (a round's start)."""
        limit, budget = self.options.max_evals, self.options.budget_s
        since_s, since_at = max(self.improved_s, began_s), max(self.improved_at, began_at)
        return self.elapsed() - since_s >= (budget - began_s) / 2 or (
            limit is not None and self.proposals - since_at >= (limit - began_at) / 2
        )

    def propose(self, chain: _Chain) -> None:
        self.search.propose(chain, self.scale)
        self.proposals += 1

    def note(self) -> None:
        """After a sweep of proposals: the best's history, progress now and then, and
        the memoized segments bounded (``_Evaluator.bound``)."""
        self.search.evaluate.trim()
        elapsed = self.elapsed()
        if self.search.best_cost < self.best:
            self.best, self.improved_s, self.improved_at = (
                self.search.best_cost,
                elapsed,
                self.proposals,
            )
            self.history.append(
                Improvement(time.perf_counter() - self.looped, self.proposals, self.best.seconds)
            )
        if self.progress is not None and elapsed - self.last_report >= 0.2:
            self.last_report = elapsed
            evaluated = self.search.evaluate.evaluated
            best = self.best.seconds
            self.progress(Progress(elapsed, self.options.budget_s, evaluated, best))


@dataclass
class _Walk:
    """The walk from one distinct start: one chain, restarted from the walk's best."""

    names: tuple[str, ...]
    chain: _Chain
    best: Strategy
    best_cost: Cost
    proposals: int = 0
    rounds: int = 0

    def result(self, starts: Mapping[str, Evaluation]) -> StartWalk:
        start = starts[self.names[0]]
        return StartWalk(
            self.names,
            start.step_time_s,
            start.fits,
            self.best_cost.seconds,
            self.proposals,
            self.rounds,
        )


def halving_rounds(starts: int) -> list[int]:
    """How many starts each round walks: all, then half (rounded up) until one."""
    counts = [starts]
    while counts[-1] > 1:
        counts.append(math.ceil(counts[-1] / 2))
    return counts


def _walk_halving(
    search: _Search, clock: _Clock, walks: list[_Walk], seeds: np.random.SeedSequence
) -> None:
    """Successive halving over the starts: the first half of the budget in equal rounds,
    each round's share split among the starts it walks by turns (one proposal each), the
    better half going on to the next (ranked by the best their walks reached); the last
    start walks the second half. A walk's chain that stalls restarts from the walk's best.
    The last round also stops when the best has not improved for half of it (the walk
    before halving stopped after half the budget without one)."""
    counts = halving_rounds(len(walks))
    last = len(counts) - 1
    alive = walks
    for round_, count in enumerate(counts):
        ranked = sorted(alive, key=lambda w: w.best_cost)  # stable: ties by start
        alive = ranked[:count]
        for dropped in ranked[count:]:  # walked no more: its state's memory goes
            dropped.chain.state = None
        end = 1.0 if round_ == last else (round_ + 1) / (2 * last)
        for walk in alive:
            walk.rounds += 1
        began_s, began_at = clock.elapsed(), clock.proposals
        while not clock.over() and clock.used() < end:
            if round_ == last and clock.stalled_since(began_s, began_at):
                return
            for walk in alive:
                if clock.over():  # mid-sweep: max_evals is a bound, not a round number
                    break
                clock.propose(walk.chain)
                walk.proposals += 1
                if walk.chain.best_cost < walk.best_cost:
                    walk.best, walk.best_cost = walk.chain.best, walk.chain.best_cost
                if not walk.chain.active:
                    rng = np.random.default_rng(seeds.spawn(1)[0])
                    walk.chain = search.start(walk.best, rng, walk.chain.state)
            clock.note()
        if clock.over():
            return


def _walk_best(
    search: _Search,
    clock: _Clock,
    ranked: list[Strategy],
    states: Mapping[Strategy, DeltaState],
    seeds: np.random.SeedSequence,
) -> None:
    """``Restarts.BEST``: ``chains`` chains from the fastest starts, interleaved; a chain
    that stalls restarts from the best so far or, every other time, a random strategy;
    the search stops at the budget or when its best has not improved for half of it."""
    chains = []
    for i in range(search.options.chains):
        strategy = ranked[i % len(ranked)]
        cost = search.cost(search.evaluate(strategy))
        rng = np.random.default_rng(seeds.spawn(1)[0])
        chains.append(_Chain(rng, strategy, cost, cost, states[strategy], strategy))
    restarts = 0
    while not clock.over() and not clock.stalled():
        for i, chain in enumerate(chains):
            clock.propose(chain)
            if not chain.active:
                restarts += 1
                rng = np.random.default_rng(seeds.spawn(1)[0])
                if restarts % 2 == 0 or search.best is None:
                    chains[i] = search.start(search.random(rng), rng)
                else:
                    chains[i] = search.start(search.best, rng, chain.state)
        clock.note()
