"""Alpa's intra-operator pass: one binary choice per op among its configs on the device
mesh, solved as an integer program (scipy.optimize.milp, HiGHS) under a time limit.

    minimize   sum_v  c_v . x_v   +   sum_(u,v)  R_uv . y_uv
    subject to sum_i x_v,i = 1                       (one config per deciding op)
               sum_j y_uv,ij = x_u,i,  sum_i y_uv,ij = x_v,j   (y = x_u x_v^T)
               sum_v held_v,d . x_v <= memory_d      (per device)
               x binary, 0 <= y <= 1

``c_v``: the group's additive cost per config (its ops' compute and collectives, its
internal edges; ``search/additive.py``), ``R_uv``: the resharding between two groups per
pair of configs. With ``x`` integral the constraints leave ``y`` one point, the product,
so ``y`` need not be integer (Alpa's linearization). A partial sum read by several ops
whose groups differ (``additive.Joint``: its readers together decide whether it
reduce-scatters) is a table over three or more groups' configs, linearized alike: a
``y`` per combination, its marginal over every group's axis that group's ``x``. The
memory rows count what the ops
hold to the end of the step, not kernels' workspace nor receive buffers, and are added
only where the plan found without them overfills a device (pricing every config's
memory costs as much as the rest); the plan is then simulated, and may still be found
not to fit. The time limit bounds building and solving together.

A pure function, (graph, space, simulator, options) -> ``IlpResult``: the strategy, the
objective (its additive cost), HiGHS's bound and gap, and where the time went.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from onnx2soap.errors import UserError
from onnx2soap.ir import Graph
from onnx2soap.search.additive import AdditiveCost, Decisions
from onnx2soap.sim import Simulator
from onnx2soap.soap import SoapDim, Strategy

Space = Mapping[str, tuple[SoapDim, ...]]
MAX_TIME_LIMIT_S = 7 * 24 * 3600.0
SCALE = 1e6  # the objective in microseconds: HiGHS's tolerances are absolute


@dataclass(frozen=True)
class IlpOptions:
    time_limit_s: float = 10.0
    mesh_only: bool = True  # configs on every device of the mesh, and on device 0 alone
    merge: bool = True  # lightweight ops follow their producer (Alpa's graph shrinking)

    def __post_init__(self) -> None:
        t = self.time_limit_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= MAX_TIME_LIMIT_S:
            raise UserError(
                f"the ILP's time limit must be in (0, {MAX_TIME_LIMIT_S:g}] s, got {t!r}"
            )


@dataclass(frozen=True)
class IlpResult:
    strategy: Strategy | None  # None: not built within the time limit
    objective_s: float  # the strategy's additive cost
    bound_s: float  # HiGHS's lower bound on the optimum (the objective when optimal)
    gap: float  # HiGHS's relative gap between them (0: proven optimal)
    status: str  # "optimal", "time limit", or why no solution came
    build_s: float  # pricing every config and edge, building the matrices
    solve_s: float
    decisions: int  # ops that choose (the others follow)
    variables: int
    constraints: int


class _OutOfTime(Exception):
    """The time limit passed while the problem was being built."""


def ilp(graph: Graph, space: Space, simulator: Simulator, options: IlpOptions) -> IlpResult:
    """The time limit bounds building and solving together. Memory rows are added only
    where the plan found without them holds more than a device has (pricing every
    config's memory costs as much as the rest of the build), and it is solved again."""
    began = time.perf_counter()
    deadline = began + options.time_limit_s
    model = AdditiveCost(graph, simulator)
    decisions = Decisions(graph, space, model, options.mesh_only, options.merge)
    solve_s = 0.0
    try:
        problem = _build(decisions, deadline)
    except _OutOfTime:
        spent = time.perf_counter() - began
        status = f"not built within the time limit ({options.time_limit_s:g} s)"
        return IlpResult(None, math.inf, math.inf, math.inf, status, spent, 0.0, 0, 0, 0)
    memory = tuple(d.memory for d in model.machine.devices)
    for rows in (False, True):
        if rows:
            try:
                problem = _with_memory(problem, decisions, memory, deadline)
            except _OutOfTime:
                status = "over memory: its rows not built within the time limit"
                break
        started = time.perf_counter()
        remaining = max(deadline - started, 0.1)
        choice, status, bound, gap = _solve(problem, decisions, remaining)
        solve_s += time.perf_counter() - started
        strategy = decisions.strategy(choice)
        over = any(h > m for h, m in zip(model.held(strategy), memory, strict=True))
        if not over or problem.memory_rows:
            break
    objective = model.strategy(strategy)
    return IlpResult(
        strategy,
        objective,
        bound if math.isfinite(bound) else objective,
        gap,
        status,
        time.perf_counter() - began - solve_s,
        solve_s,
        len(decisions.deciders),
        problem.variables,
        problem.constraints,
    )


@dataclass(frozen=True)
class _Problem:
    cost: np.ndarray  # per variable, microseconds
    integral: np.ndarray
    rows: np.ndarray  # constraint matrix in coordinates
    cols: np.ndarray
    values: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    offsets: tuple[int, ...]  # per decider, its first x variable
    counts: tuple[int, ...]
    memory_rows: bool = False

    @property
    def variables(self) -> int:
        return len(self.cost)

    @property
    def constraints(self) -> int:
        return len(self.lower)


def _check(deadline: float) -> None:
    if time.perf_counter() > deadline:
        raise _OutOfTime


def _build(decisions: Decisions, deadline: float) -> _Problem:
    deciders = decisions.deciders
    cost: list[float] = []
    offsets, counts = [], []
    for n in deciders:
        offsets.append(len(cost))
        counts.append(len(decisions.configs[n]))
        for c in decisions.configs[n]:  # one group's configs can take seconds on 2 k ops
            _check(deadline)
            cost.append(decisions.group(n, c) * SCALE)
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    lower: list[float] = []
    upper: list[float] = []
    integral = [1] * len(cost)

    def row(variables, coefficients, lo: float, hi: float) -> None:
        r = len(lower)
        rows.append(np.full(len(variables), r))
        cols.append(np.asarray(variables))
        vals.append(np.asarray(coefficients, dtype=float))
        lower.append(lo)
        upper.append(hi)

    for off, n in zip(offsets, counts, strict=True):  # one config each
        row(np.arange(off, off + n), np.ones(n), 1.0, 1.0)
    for leaders, table in _links(decisions, deadline).items():
        # a decider with one config fixes its axis: the table shrinks to the others'
        free = [u for u in leaders if counts[u] > 1]
        table = table.reshape([counts[u] for u in free])
        if not free:
            cost[offsets[leaders[0]]] += float(table) * SCALE
            continue
        if len(free) == 1:
            for k, seconds in enumerate(table):
                cost[offsets[free[0]] + k] += seconds * SCALE
            continue
        # y: one variable per combination; its marginals are the x's, which leave it
        # one point, the product, where the x's are integral (Alpa's linearization)
        first = len(cost)
        cost.extend((table * SCALE).ravel().tolist())
        integral.extend([0] * table.size)
        y = first + np.arange(table.size).reshape(table.shape)
        for axis, u in enumerate(free):
            for k in range(counts[u]):  # sum of y over the others = x_u,k
                column = np.take(y, k, axis=axis).ravel()
                row(np.append(column, offsets[u] + k), np.append(np.ones(column.size), -1.0), 0, 0)
    return _Problem(
        np.asarray(cost),
        np.asarray(integral),
        np.concatenate(rows) if rows else np.zeros(0, int),
        np.concatenate(cols) if cols else np.zeros(0, int),
        np.concatenate(vals) if vals else np.zeros(0),
        np.asarray(lower),
        np.asarray(upper),
        tuple(offsets),
        tuple(counts),
    )


def _links(decisions: Decisions, deadline: float) -> dict[tuple[int, ...], np.ndarray]:
    """The terms between groups, per set of deciders (their indices, ascending): a table
    of seconds over their configs, summed over the edges between two groups and the
    joint terms (a partial sum whose readers decide its collective) spanning them."""
    model, deciders = decisions.model, decisions.deciders
    where = {n: i for i, n in enumerate(deciders)}
    links: dict[tuple[int, ...], np.ndarray] = {}

    def add(ops: tuple[str, ...], price) -> None:
        leaders = decisions.leaders(ops)
        if len(leaders) < 2:
            return  # inside one group: its cost has it
        key = tuple(where[n] for n in leaders)
        configs = [decisions.configs[n] for n in leaders]
        table = links.setdefault(key, np.zeros([len(c) for c in configs]))
        for combo in np.ndindex(*table.shape):
            _check(deadline)
            choice = {n: c[k] for n, c, k in zip(leaders, configs, combo, strict=True)}
            table[combo] += price(decisions.configs_of(ops, choice))

    for j in model.pairwise:
        p, c, _ = model.edges[j]
        add((p, c), lambda conf, j=j, p=p, c=c: model.edge(j, conf[p], conf[c]))
    for i, t in enumerate(model.joints):
        add(t.ops, lambda conf, i=i: model.joint(i, conf))
    return links


def _with_memory(
    problem: _Problem, decisions: Decisions, memory: tuple[int, ...], deadline: float
) -> _Problem:
    """The problem with a row per device: what the groups' configs hold, at most its
    memory (only devices some choice could overfill)."""
    held = []
    for n in decisions.deciders:
        _check(deadline)
        held.append([decisions.group_held(n, c) for c in decisions.configs[n]])
    rows, cols, vals = [problem.rows], [problem.cols], [problem.values]
    lower, upper = list(problem.lower), list(problem.upper)
    for d, limit in enumerate(memory):
        variables, coefficients = [], []
        for g, off in zip(held, problem.offsets, strict=True):
            for i, x in enumerate(g):
                if x[d]:
                    variables.append(off + i)
                    coefficients.append(float(x[d]))
        if variables and sum(coefficients) > limit:
            rows.append(np.full(len(variables), len(lower)))
            cols.append(np.asarray(variables))
            vals.append(np.asarray(coefficients))
            lower.append(-np.inf)
            upper.append(float(limit))
    return replace(
        problem,
        rows=np.concatenate(rows),
        cols=np.concatenate(cols),
        values=np.concatenate(vals),
        lower=np.asarray(lower),
        upper=np.asarray(upper),
        memory_rows=True,
    )


def _solve(problem: _Problem, decisions: Decisions, time_limit_s: float):
    """(a config per decider, status, bound in seconds, gap). Where HiGHS finds no
    solution in time (or none exists within memory), each decider takes its cheapest
    group config and the status says so."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    matrix = coo_matrix(
        (problem.values, (problem.rows, problem.cols)),
        shape=(problem.constraints, problem.variables),
    ).tocsr()
    result = milp(
        problem.cost,
        integrality=problem.integral,
        bounds=Bounds(0.0, 1.0),
        constraints=LinearConstraint(matrix, problem.lower, problem.upper),
        options={"time_limit": float(time_limit_s), "disp": False},
    )
    deciders = decisions.deciders
    if result.x is None:
        status = "no plan fits in memory" if result.status == 2 else "no solution in time"
        choice = {
            n: min(decisions.configs[n], key=lambda c, n=n: decisions.group(n, c)) for n in deciders
        }
        return choice, status, math.inf, math.inf
    choice = {}
    for n, off, count in zip(deciders, problem.offsets, problem.counts, strict=True):
        picked = int(np.argmax(result.x[off : off + count]))
        choice[n] = decisions.configs[n][picked]
    status = "optimal" if result.status == 0 else "time limit"
    bound = getattr(result, "mip_dual_bound", None)
    gap = getattr(result, "mip_gap", None)
    bound_s = float(bound) / SCALE if bound is not None else math.inf
    return choice, status, bound_s, float(gap) if gap is not None else math.inf
