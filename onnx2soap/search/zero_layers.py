"""ZeRO-3 on some groups of layers, a lower stage on the rest: FSDP wrapping only as
many of a model's blocks as memory needs.

ZeRO-3 saves a weight's rows on every member but its own, for the price of gathering the
weight before each forward and backward that reads it. Where a plan fits under ZeRO-3
but not under the stage below, sharding the weights of only some layers may fit too, and
gathers less. The weights are grouped by the model's repeated blocks (``groups.py``: a
transformer's layers, a ResNet stage's blocks; an op outside every block is a group of
its own), in graph order; the first ``n`` groups go to ZeRO-3 and the rest stay at the
lower stage. The fewest that fit are found by bisection over ``n``: a group more at
ZeRO-3 frees the rows of its weight that the rank does not own for the whole step, and
holds them back only while its ops run (one group's gathers at a time), so the peak
falls with ``n`` but for a step of about one group's gathered weight where the gathers
move the peak (an MLP of 256-wide layers: 3.943 MB at one group, 3.947 at two, then
0.2 MB less a group); the count found fits, and is the fewest where the peak falls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onnx2soap.ir import Graph, TensorRole
from onnx2soap.search.groups import Space, find_groups
from onnx2soap.soap.zero import Zero, ZeroStage


@dataclass(frozen=True)
class LayerGroups:
    """The model's trainable weights by group of layers, in graph order (a weight read
    by several groups belongs to the first)."""

    weights: tuple[tuple[str, ...], ...]

    def zero(self, sharded: int, high: ZeroStage, low: ZeroStage) -> Zero:
        """The first ``sharded`` groups' weights at ``high``, every other at ``low``."""
        return Zero.mixed(low, {w: high for group in self.weights[:sharded] for w in group})


def layer_groups(graph: Graph, space: Space) -> LayerGroups:
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
    """The fewest groups of layers at the high stage with which the plan fits."""

    sharded: int
    zero: Zero
    priced: object  # what ``price`` returned for ``zero``


def fewest_sharded(
    groups: LayerGroups,
    high: ZeroStage,
    low: ZeroStage,
    price: Callable[[Zero], object],
    fits: Callable[[object], bool],
) -> Layered | None:
    """Bisection over how many groups (1 to all but one) go to ``high``: the fewest
    with which ``fits(price(zero))``; None where even all but one do not fit. ``price``
    is called about log2(groups) times."""
    count = len(groups.weights)
    lo, hi = 1, count - 1  # all at ``high`` is the plain stage, priced by the caller
    found: Layered | None = None
    while lo <= hi:
        n = (lo + hi) // 2
        zero = groups.zero(n, high, low)
        priced = price(zero)
        if fits(priced):
            found, hi = Layered(n, zero, priced), n - 1
        else:
            lo = n + 1
    return found
