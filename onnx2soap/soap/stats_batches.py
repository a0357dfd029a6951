"""Which statistics all-reduces run together (issue 45).

An op with statistics (BatchNorm in training mode: ``nest.sync_dims``) sums its tasks'
partial statistics over each statistics group (``partition.stat_groups``) in the
forward and again in the backward. Each such ring carries a few numbers a channel, so
it costs its latency alone; a model with many BatchNorms paid one ring latency per op
and phase on its critical path. Ops with statistics that stand next to each other in
the graph's order and do not read one another (``stats_runs``: Inception's parallel
branches, ResNet's downsample BatchNorm beside its block's last one, which the importer
puts side by side: ``importer/stats_order.py``) run as one *run*: every member's
partial half, then one ring per device set of their groups (``stats_rings``: the
members' statistics side by side in one all-reduce), then every member's finishing
half. The backward runs the same run in reverse order.

The runs depend on the graph alone and the rings on the plan's groups: the executor's
program (``executor/program.py``) and the simulator's task graph (``sim/taskgraph.py``)
both take them from here, so both order the halves and rings alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from onnx2soap.ir import Graph
from onnx2soap.soap.partition import StatGroup


@dataclass(frozen=True)
class StatsRing:
    """One all-reduce of statistics over ``devices``: the partial statistics of
    ``members`` ((op index, index into ``PartitionedGraph.stats[op name]``) pairs), in
    that order, side by side in one flat array."""

    devices: tuple[int, ...]
    members: tuple[tuple[int, int], ...]

    def ops(self) -> tuple[int, ...]:
        """The members' ops, each once, in order."""
        return tuple(dict.fromkeys(i for i, _ in self.members))

    def name(self, names: Callable[[int], str], tag: str) -> str:
        """The traced and simulated task's name (``names``: an op's name by its index
        here): ``stats bn1 fwd`` for one op, ``stats bn1+bn2 fwd`` for a ring that sums
        several ops' statistics."""
        return f"stats {'+'.join(map(names, self.ops()))} {tag}"


def _synced(graph: Graph, i: int) -> bool:
    return bool(graph.ops[i].nest.sync_dims)


def stats_runs(graph: Graph) -> tuple[tuple[int, ...], ...]:
    """Every op with statistics, in runs (op indices, graph order) of ops that stand
    next to each other in the graph's order, none reading another's output. The order is
    topological, so between neighbours a direct read is the only path: the members are
    independent, and each one's partial half may run before another's finishing half."""
    runs: list[tuple[int, ...]] = []
    current: list[int] = []
    for i, op in enumerate(graph.ops):
        if not _synced(graph, i):
            runs += [tuple(current)] if current else []
            current = []
            continue
        outputs = {graph.ops[m].output for m in current}
        if current and outputs.isdisjoint(op.inputs):
            current.append(i)
        else:
            runs += [tuple(current)] if current else []
            current = [i]
    runs += [tuple(current)] if current else []
    return tuple(runs)


def run_of(graph: Graph) -> dict[int, tuple[int, ...]]:
    """Per op with statistics, its run (``stats_runs``)."""
    return {i: run for run in stats_runs(graph) for i in run}


def stats_rings(
    run: Sequence[int], stats: Callable[[int], Sequence[StatGroup]]
) -> tuple[StatsRing, ...]:
    """The rings of ``run``'s ops (indices, in the phase's order: the backward's is
    reversed), their groups by ``stats`` (an op's index to its ``StatGroup``s): one per
    set of two or more devices, its members in run order and then group order, the rings
    in the order their first members come. Every rank derives the same rings in the same
    order, so each issues them in one order. A group on one device sums nothing: it stays
    a ring of its own (the one-device plan's statistics are timed per op)."""
    rings: dict[tuple, list[tuple[int, int]]] = {}
    devices: dict[tuple, tuple[int, ...]] = {}
    for i in run:
        for g, group in enumerate(stats(i)):
            key = group.devices if len(group.devices) > 1 else (i, g, group.devices)
            rings.setdefault(key, []).append((i, g))
            devices[key] = group.devices
    return tuple(StatsRing(devices[key], tuple(members)) for key, members in rings.items())
