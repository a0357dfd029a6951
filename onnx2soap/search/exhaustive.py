"""Exhaustive search: the exact optimum over every op's candidates (small graphs only).

The oracle that MCMC is checked against, as FlexFlow checked its search on LeNet.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product

from onnx2soap.errors import UserError
from onnx2soap.ir import Graph
from onnx2soap.search.mcmc import cost_of
from onnx2soap.sim import Evaluation, Simulator
from onnx2soap.soap import Partitioner, SoapDim, Strategy, candidates


@dataclass(frozen=True)
class ExhaustiveResult:
    best: Strategy
    evaluation: Evaluation
    evaluated: int


def space_size(graph: Graph, space: Mapping[str, tuple[SoapDim, ...]], devices: int) -> int:
    return math.prod(len(candidates(space[op.name], devices)) for op in graph.ops)


def exhaustive(
    graph: Graph,
    space: Mapping[str, tuple[SoapDim, ...]],
    simulator: Simulator,
    limit: int = 200_000,
) -> ExhaustiveResult:
    devices = simulator.machine.size
    size = space_size(graph, space, devices)
    if size > limit:
        raise UserError(f"the search space has {size} strategies, more than the limit {limit}")
    names = [op.name for op in graph.ops]
    choices = [candidates(space[n], devices) for n in names]
    partitioner = Partitioner(graph)
    best, best_eval, best_cost = None, None, math.inf
    for configs in product(*choices):
        strategy = Strategy(devices, dict(zip(names, configs, strict=True)))
        ev = simulator.evaluate(partitioner.partition(strategy))
        if cost_of(ev) < best_cost:
            best, best_eval, best_cost = strategy, ev, cost_of(ev)
    if best is None:
        raise UserError("no strategy fits in device memory")
    return ExhaustiveResult(best, best_eval, size)
