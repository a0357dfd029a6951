"""Which of the ops a plan's ``recompute`` names are recomputed: one answer for the
simulator's time and memory and for the executor (``executor/recompute.py``).

A recomputed op's output is made again in the backward from its inputs, which keep
their forward values until the step's end, so recomputing takes no message. The loss
(a scalar) and an op whose output is a partial sum (a split reduction dim: making its
sum again would take the all-reduce again) are therefore kept, whatever the plan says.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from onnx2soap.ir import Op


def recomputes(op: Op, sums: Sequence, names: Collection[str]) -> bool:
    """Whether ``op`` is recomputed under a plan that names ``names``; ``sums``: its
    partial-sum groups under the plan's config (``PartitionedGraph.sums``)."""
    return op.name in names and not op.is_loss and not sums
