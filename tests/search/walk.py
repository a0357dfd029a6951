"""The search's walk on its own: MCMC's chains, proposals (one-op and region moves),
acceptance, delta simulation and restarts, started from random strategies only.

``mcmc`` also evaluates every strategy built by rule (data parallelism and the other
baselines) and starts its chains from the fastest, so "the search is no slower than data
parallelism" holds by construction. Walking from random strategies, with none of those
among its starts, tests what the walk finds: the families' and sequence models' tests
require it to come near the best strategy built by rule. The loop is ``mcmc``'s, through
its internal ``_Search`` (the same proposals and acceptance), with the random starts in
place of the rule-built ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from onnx2soap.ir import Graph
from onnx2soap.search.mcmc import Scale, SearchOptions, _rule_strategies, _Search, cost_of
from onnx2soap.sim import Simulator
from onnx2soap.soap import Partitioner, SoapDim

# shufflenet_v2_x0_5, the slowest family to get there, took 1,965 proposals; 4,692 once
# every Conv's input channels could split too (reduction splits: a larger space to walk;
# seeds 1 and 2 took 2,430 and 669)
WALK_PROPOSALS = 5000


@dataclass(frozen=True)
class Walk:
    best_rule: float  # the fastest strategy built by rule, and its name
    best_rule_name: str
    start: float  # the best of the random starts
    reached: float  # the best the walk found
    proposals: int


def best_rule(graph: Graph, space: Mapping[str, tuple[SoapDim, ...]], simulator: Simulator):
    """(name, cost) of the fastest strategy ``mcmc`` would have started from."""
    partitioner = Partitioner(graph)
    named, _ = _rule_strategies(graph, space, simulator, SearchOptions())
    costs = {n: cost_of(simulator.evaluate(partitioner.partition(s))) for n, s in named.items()}
    name = min(costs, key=costs.__getitem__)
    return name, costs[name]


def walk_from_random(
    graph: Graph,
    space: Mapping[str, tuple[SoapDim, ...]],
    simulator: Simulator,
    seed: int,
    target: float,
    max_proposals: int,
) -> Walk:
    """Walk until the best strategy costs at most ``target`` times the best rule-built one,
    or ``max_proposals`` proposals have been made."""
    rule_name, rule_cost = best_rule(graph, space, simulator)
    options = SearchOptions(seed=seed)
    search = _Search(graph, space, simulator, options)
    seeds = np.random.SeedSequence(seed)

    def random_chain():
        rng = np.random.default_rng(seeds.spawn(1)[0])
        return search.start(search.random(rng), rng)

    chains = [random_chain() for _ in range(options.chains)]
    start = search.best_cost.seconds
    scale = Scale(start if math.isfinite(start) else 1.0)  # mcmc's: the best start's cost
    proposals, restarts = 0, 0
    while search.best_cost.seconds > target * rule_cost and proposals < max_proposals:
        for i, chain in enumerate(chains):
            search.propose(chain, scale)
            proposals += 1
            if not chain.active:  # as mcmc: from the best so far, every other time random
                restarts += 1
                if restarts % 2:
                    rng = np.random.default_rng(seeds.spawn(1)[0])
                    chains[i] = search.start(search.best, rng, chain.state)
                else:
                    chains[i] = random_chain()
    return Walk(rule_cost, rule_name, start, search.best_cost.seconds, proposals)
