"""Related ops, found once from the graph, and proposals that change them together.

A one-op proposal changes one op; its neighbours keep their configs and the resharding
between them is paid. Region proposals (``regions.py``) spread a change over nearby ops.
Models also repeat themselves (twelve identical transformer layers, a ResNet stage's
identical blocks), and a plan that is good for one layer is good for its copies, but a
walk must find it twelve times, one op at a time, each step judged on a twelfth of the
gain. Group proposals change the related ops at once:

- **siblings**: ops of identical signature (type, attributes, loop nest up to tensor
  names, operand shapes, dtypes and roles, SOAP dims): the same layer wherever it
  repeats. Their dims are equal, so they have the same candidates: one's config is
  always a valid config of the others.
- **blocks**: a run of ops that repeats back to back in graph order (transformer layers,
  a ResNet stage's identical blocks). Graph order is the order the exporter traced the
  modules in, so identical modules give identical runs of signatures, found as tandem
  repeats of the signature sequence (no names needed: a legacy export's ``/h.3/attn``,
  a dynamo export's metadata and a graph built by hand all give the same order). The op
  at position j of every instance of a block is a *counterpart* of the others.
- **chains**: an op with no weights, statistics or partial sums follows its latest
  producer (``additive.lightweight``, as Alpa's ILP merges it); an op's chain is the ops
  that follow it, transitively: a bias add's reshape, transpose and the attention after
  it.

Moves (``GroupMove``), for a pivot op and a new config drawn for it:

- ``CHAIN``: the pivot takes the config, its chain the config of the same shape
  (``regions.config_shape``: same devices, same degrees on the same output axes);
- ``SIBLINGS``: the same, then every changed op's config copied to its siblings (a
  mutation applied to every layer);
- ``BLOCK``: a region move around the pivot, copied to the counterparts of every op it
  changed (the same change in every instance of the block);
- ``COPY``: no new config: the pivot's block instance's configs copied to every other
  instance (one layer's plan given to all), or without a block the pivot's config to its
  siblings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from onnx2soap.ir import Graph, Op
from onnx2soap.search.additive import followed
from onnx2soap.search.regions import RegionMoves
from onnx2soap.soap import ParallelConfig, SoapDim, Strategy

Space = Mapping[str, tuple[SoapDim, ...]]


class GroupMove(Enum):
    CHAIN = "chain"
    SIBLINGS = "siblings"
    BLOCK = "block"
    COPY = "copy"


@dataclass(frozen=True)
class Block:
    """A run of ops repeated back to back: ``instances[k][j]`` is the op at position j of
    the k-th repeat; ops at one position have one signature."""

    instances: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Groups:
    siblings: Mapping[str, tuple[str, ...]]  # op -> the others of its signature
    blocks: tuple[Block, ...]
    counterparts: Mapping[str, tuple[str, ...]]  # op -> the others at its block position
    instance: Mapping[str, tuple[str, ...]]  # op -> the ops of its block instance
    chain: Mapping[str, tuple[str, ...]]  # op -> the ops that follow it, transitively

    def related(self, name: str) -> bool:
        """Whether a group move from ``name`` can change more than ``name``."""
        return bool(self.siblings.get(name) or self.chain.get(name))


def signature(graph: Graph, op: Op, dims: tuple[SoapDim, ...]) -> tuple:
    """What makes two ops the same layer: everything but their names and their tensors'
    names (a loop nest names its operands' tensors)."""
    nest = op.nest
    nest = replace(nest, inputs=tuple(replace(o, tensor="") for o in nest.inputs))
    try:
        hash(op.attrs)
        attrs = op.attrs
    except TypeError:  # an attribute holding an array: compared by its text
        attrs = repr(op.attrs)
    tensors = [graph.tensors[t] for t in op.inputs]
    output = graph.tensors[op.output]
    return (
        op.type,
        attrs,
        nest,
        op.is_loss,
        op.dtype,
        tuple((t.shape, t.dtype, t.role, t.batched) for t in tensors),
        (output.shape, output.dtype),
        dims,
    )


def find_groups(graph: Graph, space: Space) -> Groups:
    ids = _signature_ids(graph, space)
    names = [op.name for op in graph.ops]
    classes: dict[int, list[str]] = {}
    for name, k in zip(names, ids, strict=True):
        classes.setdefault(k, []).append(name)
    siblings = {
        name: tuple(other for other in members if other != name)
        for members in classes.values()
        if len(members) > 1
        for name in members
    }
    blocks = tuple(
        Block(tuple(tuple(names[start + k * period + j] for j in range(period)) for k in range(n)))
        for start, period, n in tandem_repeats(ids)
    )
    counterparts, instance = {}, {}
    for block in blocks:
        for k, ops in enumerate(block.instances):
            for j, name in enumerate(ops):
                counterparts[name] = tuple(
                    other[j] for i, other in enumerate(block.instances) if i != k
                )
                instance[name] = ops
    return Groups(siblings, blocks, counterparts, instance, _chains(graph))


def _signature_ids(graph: Graph, space: Space) -> list[int]:
    """A small number per distinct signature, in graph order (a loop nest hashes deep:
    compared once here, never in the search)."""
    interned: dict[tuple, int] = {}
    return [
        interned.setdefault(signature(graph, op, space[op.name]), len(interned)) for op in graph.ops
    ]


def tandem_repeats(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Non-overlapping runs of ``ids`` made of a block of ``period`` >= 2 items repeated
    ``n`` >= 2 times back to back, as (start, period, n): the run covering the most items
    first (ties: the shorter period, so twelve layers are twelve blocks, not six pairs),
    then the most among what is left, and so on."""
    seq = np.asarray(ids)
    found = []
    for period in range(2, len(seq) // 2 + 1):
        # same[i]: item i equals item i + period; a run of L such items from i is a block
        # of ``period`` repeated (L + period) // period times
        same = np.concatenate(([False], seq[:-period] == seq[period:], [False]))
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        for begin, end in zip(edges[::2], edges[1::2], strict=True):
            n = (end - begin + period) // period
            if n >= 2:
                found.append((n * period, -period, int(begin), period, int(n)))
    found.sort(key=lambda f: (-f[0], -f[1], f[2]))
    taken = np.zeros(len(seq), dtype=bool)
    chosen = []
    for covered, _, start, period, n in found:
        if not taken[start : start + covered].any():
            taken[start : start + covered] = True
            chosen.append((start, period, n))
    return sorted(chosen)


def _chains(graph: Graph) -> dict[str, tuple[str, ...]]:
    """Per op, the ops that follow it (``additive.followed``, the ILP's rule: a lightweight op
    follows its latest producer), transitively, in graph order; only non-empty ones."""
    index = {op.name: i for i, op in enumerate(graph.ops)}
    children: dict[str, list[str]] = {}
    for follower, leader in followed(graph).items():  # in graph order
        children.setdefault(leader, []).append(follower)
    chains = {}
    for op in reversed(graph.ops):  # children come later in graph order: theirs are done
        if op.name in children:
            found = [c for child in children[op.name] for c in (child, *chains.get(child, ()))]
            chains[op.name] = tuple(sorted(found, key=index.__getitem__))
    return chains


class GroupMoves:
    def __init__(self, graph: Graph, space: Space, regions: RegionMoves) -> None:
        self.groups = find_groups(graph, space)
        self.regions = regions

    def propose(
        self,
        strategy: Strategy,
        pivot: str,
        config: ParallelConfig,
        move: GroupMove,
        rng: np.random.Generator,
    ) -> Strategy | None:
        """``strategy`` after ``move`` from ``pivot`` (``config``: its new config, unused by
        ``COPY``); None when that changes nothing."""
        g = self.groups
        if move is GroupMove.COPY:
            configs = self._copy(strategy, pivot)
        else:
            chain = g.chain.get(pivot, ())
            if move is GroupMove.BLOCK:
                regions = self.regions
                radius = regions.radii[int(rng.integers(len(regions.radii)))]
                changed = regions.spread(pivot, config, regions.region(pivot, radius), rng)
            else:
                changed = self.regions.spread(pivot, config, chain, rng)
            if move is GroupMove.CHAIN:
                configs = changed
            else:
                partners = g.counterparts if move is GroupMove.BLOCK else g.siblings
                if move is GroupMove.BLOCK and pivot not in g.counterparts:
                    partners = g.siblings  # no block: the same change to its siblings
                configs = _mirror(changed, partners)
        if all(strategy[name] == c for name, c in configs.items()):
            return None
        return Strategy(strategy.devices, {**strategy.configs, **configs})

    def _copy(self, strategy: Strategy, pivot: str) -> dict[str, ParallelConfig]:
        g = self.groups
        own = {name: strategy[name] for name in g.instance.get(pivot, (pivot,))}
        partners = g.counterparts if pivot in g.counterparts else g.siblings
        return _mirror(own, partners)


def _mirror(
    configs: Mapping[str, ParallelConfig], partners: Mapping[str, tuple[str, ...]]
) -> dict[str, ParallelConfig]:
    """``configs`` and each config given to the op's partners too; where a partner is
    changed itself, its own change stands."""
    mirrored = {p: c for name, c in configs.items() for p in partners.get(name, ())}
    return {**mirrored, **configs}
