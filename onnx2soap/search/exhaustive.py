"""Exhaustive search: the exact optimum over every op's candidates (small graphs only).

The oracle that MCMC is checked against, as FlexFlow checked its search on LeNet, and
the ILP (``minimize`` over its own choices, under its additive cost).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import product

from onnx2soap.errors import UserError
from onnx2soap.ir import Graph
from onnx2soap.search.mcmc import cost_of
from onnx2soap.sim import Evaluation, Simulator
from onnx2soap.soap import ParallelConfig, Partitioner, SoapDim, Strategy, candidates


@dataclass(frozen=True)
class ExhaustiveResult:
    best: Strategy
    evaluation: Evaluation
    evaluated: int


def space_size(graph: Graph, space: Mapping[str, tuple[SoapDim, ...]], devices: int) -> int:
    return math.prod(len(candidates(space[op.name], devices)) for op in graph.ops)


def minimize(
    choices: Mapping[str, Sequence[ParallelConfig]],
    cost: Callable[[Mapping[str, ParallelConfig]], float],
    limit: int = 200_000,
) -> tuple[dict[str, ParallelConfig] | None, float, int]:
    """(the cheapest choice of a config per name, its cost, how many were tried): every
    combination, in order; the first of equal costs. None where every cost is infinite."""
    size = math.prod(len(c) for c in choices.values())
    if size > limit:
        raise UserError(f"the search space has {size} strategies, more than the limit {limit}")
    names = list(choices)
    best, best_cost = None, math.inf
    for configs in product(*(choices[n] for n in names)):
        choice = dict(zip(names, configs, strict=True))
        c = cost(choice)
        if c < best_cost:
            best, best_cost = choice, c
    return best, best_cost, size


def exhaustive(
    graph: Graph,
    space: Mapping[str, tuple[SoapDim, ...]],
    simulator: Simulator,
    limit: int = 200_000,
) -> ExhaustiveResult:
    devices = simulator.machine.size
    partitioner = Partitioner(graph)
    choices = {op.name: candidates(space[op.name], devices) for op in graph.ops}
    kept: list[Evaluation] = []  # the best evaluation so far

    def simulated(choice: Mapping[str, ParallelConfig]) -> float:
        ev = simulator.evaluate(partitioner.partition(Strategy(devices, choice)))
        if not kept or cost_of(ev) < cost_of(kept[0]):
            kept[:] = [ev]
        return cost_of(ev)

    best, _, size = minimize(choices, simulated, limit)
    if best is None:
        raise UserError("no strategy fits in device memory")
    return ExhaustiveResult(Strategy(devices, best), kept[0], size)
