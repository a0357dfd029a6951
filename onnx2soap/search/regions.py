"""Region proposals: one op's new way of being split, given to its neighbourhood too.

A proposal that changes one op pays for the resharding between that op and its
neighbours, which stay as they were: moving a conv of a data-parallel Inception branch to
a channel split costs two all-to-alls, and the search rejects it although the whole
branch split by channels may be faster. A region move spreads the pivot's change over
the ops within ``radius`` edges of it (producers and consumers, breadth first): each of
them takes the candidate config of the same *shape* as the pivot's new one (the same
devices in the same order, the same degree on the dims that index the same output axis,
the samples, and reductions), when it has one; ops with none keep their config, and so does every
op beyond the radius. Axes rather than dim kinds: a conv's output channels are a
parameter dim and the following Relu's an attribute dim, but both index axis 1, so a
channel split passes from the one to the other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np

from onnx2soap.ir import Graph
from onnx2soap.soap import DimKind, ParallelConfig, SoapDim, Strategy

# (devices, sorted (role, degree) of the split dims): what a config does to the op's
# output, whatever its dims are called or in what order they come.
Shape = tuple[tuple[int, ...], tuple[tuple[str, int], ...]]


def dim_role(dim: SoapDim) -> str:
    """Samples (a loss's too, which indexes no output axis), the output axis a dim
    indexes, or a reduction."""
    if dim.kind is DimKind.SAMPLE:
        return "sample"
    return "reduction" if dim.axis is None else f"axis {dim.axis}"


def config_shape(dims: Sequence[SoapDim], config: ParallelConfig) -> Shape:
    degrees = zip(dims, config.degrees, strict=True)
    return config.devices, tuple(sorted((dim_role(d), n) for d, n in degrees if n > 1))


class RegionMoves:
    def __init__(
        self,
        graph: Graph,
        space: Mapping[str, tuple[SoapDim, ...]],
        moves: Mapping[str, Sequence[ParallelConfig]],
    ) -> None:
        self.space = space
        self.neighbours = _neighbours(graph)
        self.by_shape: dict[str, dict[Shape, list[ParallelConfig]]] = {}
        # Ops of one signature share their dims and candidates (a transformer's layers):
        # one table for them all (a LLaMA-3-8B shape's 2,225 ops on 64 devices: 1.5 M
        # configs shaped, 27 s of the search's setup, for 31 distinct tables). Keyed by
        # the candidates' identity, which the memo holds on to.
        memo: dict[tuple, tuple[Sequence[ParallelConfig], dict]] = {}
        for name, configs in moves.items():
            key = (space[name], id(configs))
            if key not in memo:
                table: dict[Shape, list[ParallelConfig]] = {}
                for config in configs:
                    table.setdefault(config_shape(space[name], config), []).append(config)
                memo[key] = (configs, table)
            self.by_shape[name] = memo[key][1]
        # Radii 1, 2, 4, ... up to the graph's size: small regions most of the time.
        self.radii = tuple(2**i for i in range(max(1, len(graph.ops)).bit_length()))

    def propose(
        self, strategy: Strategy, pivot: str, config: ParallelConfig, rng: np.random.Generator
    ) -> Strategy | None:
        """``strategy`` with ``pivot`` given ``config`` and its region the same shape; None
        when that changes nothing."""
        radius = self.radii[int(rng.integers(len(self.radii)))]
        configs = self.spread(pivot, config, self.region(pivot, radius), rng)
        if all(strategy[name] == c for name, c in configs.items()):
            return None
        return Strategy(strategy.devices, {**strategy.configs, **configs})

    def spread(
        self,
        pivot: str,
        config: ParallelConfig,
        names: Sequence[str],
        rng: np.random.Generator,
    ) -> dict[str, ParallelConfig]:
        """``pivot``'s new config, and for each of ``names`` a candidate of the same shape
        (drawn among them), where it has one."""
        shape = config_shape(self.space[pivot], config)
        configs = {pivot: config}
        for name in names:
            same = self.by_shape[name].get(shape)
            if same:
                configs[name] = same[int(rng.integers(len(same)))]
        return configs

    def region(self, pivot: str, radius: int) -> list[str]:
        """The ops within ``radius`` edges of ``pivot`` (not the pivot), nearest first."""
        seen, found = {pivot}, []
        frontier = deque([(pivot, 0)])
        while frontier:
            name, hops = frontier.popleft()
            if hops == radius:
                continue
            for other in self.neighbours[name]:
                if other not in seen:
                    seen.add(other)
                    found.append(other)
                    frontier.append((other, hops + 1))
        return found


def _neighbours(graph: Graph) -> dict[str, tuple[str, ...]]:
    """Per op, the ops that produce its inputs and those that read its output."""
    producer = {op.output: op.name for op in graph.ops}
    adjacent: dict[str, dict[str, None]] = {op.name: {} for op in graph.ops}
    for op in graph.ops:
        for tensor in op.inputs:
            source = producer.get(tensor)
            if source is not None and source != op.name:
                adjacent[op.name][source] = None
                adjacent[source][op.name] = None
    return {name: tuple(others) for name, others in adjacent.items()}
