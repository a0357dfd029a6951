"""ZeRO-3 on some groups of layers, a lower stage on the rest: FSDP wrapping only the
blocks where its gathers cost nothing.

ZeRO-3 saves a weight's rows on every member but its own, for the price of gathering the
weight before each forward and backward that reads it. The gathers of a block overlap
the compute of the block before it (FSDP's prefetch), except at the start of each
forward, where nothing runs yet: the first blocks' gathers are the ones a step waits for
(LLaMA-3-8B on 8 H100s accumulating two microbatches under ZeRO-3: 1.883 s; the
embedding and the first four layers at ZeRO-2, the rest at 3: 1.874 s, 7 GB more).

The weights are grouped by the model's repeated blocks (``groups.py``: a transformer's
layers, a ResNet stage's blocks; an op outside every block is a group of its own), in
graph order. The first ``k`` groups stay at the lower stage and the rest go to ZeRO-3;
``k`` doubles from 1 (then all the groups: the lower stage everywhere) while the plan
fits (each group more at the lower stage holds its weight whole, so the memory only
grows with ``k``) and time is left, and the fastest that fits is kept: a plan of a
big model on many devices takes seconds to price (LLaMA-3-8B on 128 GPUs: tens).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from onnx2soap.ir import Graph, TensorRole
from onnx2soap.search.groups import Space, find_groups
from onnx2soap.sim import Evaluation
from onnx2soap.soap.zero import Zero, ZeroStage


@dataclass(frozen=True)
class LayerGroups:
    """The model's trainable weights by group of layers, in graph order (a weight read
    by several groups belongs to the first)."""

    weights: tuple[tuple[str, ...], ...]

    def zero(self, kept: int, high: ZeroStage, low: ZeroStage) -> Zero:
        """The first ``kept`` groups' weights at ``low``, every other at ``high``."""
        if kept >= len(self.weights):
            return Zero(low)
        return Zero.mixed(high, {w: low for group in self.weights[:kept] for w in group})

    def counts(self, every: bool = True) -> list[int]:
        """The ``kept`` counts priced: 1, 2, 4, ... below the number of groups, then,
        where ``every``, all of them (the lower stage everywhere)."""
        groups = len(self.weights)
        return [*(1 << i for i in range(groups) if 1 << i < groups), *([groups] if every else [])]


def layer_groups(graph: Graph, space: Space) -> LayerGroups:
    """The trainable weights of each block instance (``groups.find_groups``) and of each
    op outside every block, in the order the graph first reads them."""
    instance = find_groups(graph, space).instance
    seen: set[str] = set()
    groups: dict[str, list[str]] = {}  # by the first op of its block instance
    for op in graph.ops:
        key = instance.get(op.name, (op.name,))[0]
        for t in op.inputs:
            if graph.tensors[t].role is TensorRole.WEIGHT and t not in seen:
                seen.add(t)
                groups.setdefault(key, []).append(t)
    return LayerGroups(tuple(tuple(ws) for ws in groups.values()))


@dataclass(frozen=True)
class Layered:
    """The plan with the first ``kept`` groups at the lower stage: its stages and its
    evaluation."""

    kept: int
    zero: Zero
    evaluation: Evaluation


def fastest_layered(
    groups: LayerGroups,
    high: ZeroStage,
    low: ZeroStage,
    price: Callable[[Zero], Evaluation],
    deadline: float = math.inf,
    every: bool = True,
) -> Layered | None:
    """The fastest that fits of the first 1, 2, 4, ... groups (then all, where
    ``every``: the caller has not priced ``low`` everywhere already) at ``low`` and the
    rest at ``high`` (``price`` gives a plan's evaluation under a ``Zero``), pricing
    until one does not fit or ``deadline`` (``time.perf_counter``'s) has passed; None
    where the first group alone does not fit."""
    best: Layered | None = None
    for kept in groups.counts(every):
        if best is not None and time.perf_counter() > deadline:
            break
        zero = groups.zero(kept, high, low)
        evaluation = price(zero)
        if not evaluation.fits:
            break
        if best is None or evaluation.step_time_s < best.evaluation.step_time_s:
            best = Layered(kept, zero, evaluation)
    return best
