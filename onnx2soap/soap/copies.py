"""Weight-only ops: the ops a config may compute more than once (``ParallelConfig.copies``).

An op that reads only weights, constants and the outputs of other such ops (the Slice x 4
-> Concat chains an exporter feeds an LSTM's weights through, a tied head's Identity or
Transpose) has no sample to split: every holder of the weight computes it from the shard
the plan gives it, rather than split over the devices and gathered by its readers every
step. Each copy's weight gradients are summed over the copies' replica group, so the
result is one device's. Copies are sound only where every copy computes the same values
and nothing but the weights' gradients leaves them: no data, labels or state read (a
BatchNorm's running statistics), not the loss, no random draws, no statistics.
"""

from __future__ import annotations

from onnx2soap.ir import Graph, Op, TensorRole
from onnx2soap.ops import definition

_SOURCES = (TensorRole.WEIGHT, TensorRole.CONSTANT)


def _own_weight_only(op: Op, graph: Graph) -> bool:
    """The op's own conditions, its producers aside."""
    if op.is_loss or op.nest.sync_dims or graph.tensors[op.output].batched:
        return False
    return not definition(op.type).draws_random


def weight_only_ops(graph: Graph) -> frozenset[str]:
    """The names of the graph's weight-only ops (the one test of it), in one pass in
    topological order: an activation read must come from an op already found. (A pass
    over the ops' inputs: callers ask once per rule, search or plan check.)"""
    found: set[str] = set()
    made = {op.output: op.name for op in graph.ops}
    for op in graph.ops:
        if not _own_weight_only(op, graph):
            continue
        if all(
            graph.tensors[t].role in _SOURCES
            or (graph.tensors[t].role is TensorRole.ACTIVATION and made.get(t) in found)
            for t in op.inputs
        ):
            found.add(op.name)
    return frozenset(found)
