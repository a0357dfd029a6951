"""The graph's order with independent BatchNorms side by side (issue 45).

Ops with statistics (BatchNorm in training mode: ``nest.sync_dims``) that stand next to
each other in the graph's order and do not read one another sum their statistics in one
ring a phase (``soap/stats_batches.py``). Torch's exporters write a ResNet block's
downsample convolution and its BatchNorm after the main branch's last BatchNorm, and
Inception's branches one after another; ``side_by_side`` moves what such a BatchNorm
reads just before the run, so every consumer of the graph's order (the executor's
program, the simulator, the memory model) sees them together.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnx2soap.ir import Op


def side_by_side(ops: Sequence[Op]) -> list[Op]:
    """``ops`` (in topological order) reordered so that ops with statistics that do not
    depend on one another stand next to each other where the graph allows: at each op
    with statistics, each later one that depends on none of the run gathered so far
    joins it, the ops it depends on (that depend on no member) moved just before the
    run, up to the first later op with statistics that depends on the run (nothing
    passes over one: runs stay where their ops were, and what moves ahead is held only
    a few ops longer). The order stays topological: what moves ahead depends on nothing
    that now comes after it. Without two such ops the order is the same list."""
    order = list(ops)
    if sum(map(_stats_op, order)) < 2:  # no run to make: the dependency sets not built
        return order
    producer = {op.output: k for k, op in enumerate(order)}
    # per op (by identity), the ops it depends on, as a bit set of original positions
    below: dict[int, int] = {}
    for op in order:
        bits = 0
        for t in op.inputs:
            if t in producer:
                p = producer[t]
                bits |= below[id(order[p])] | (1 << p)
        below[id(op)] = bits
    position = {id(op): k for k, op in enumerate(ops)}
    k = 0
    while k < len(order):
        if not _stats_op(order[k]):
            k += 1
            continue
        members = 1 << position[id(order[k])]
        end = k + 1  # the run is order[k:end]
        q = end
        while q < len(order):
            t = order[q]
            if _stats_op(t) and below[id(t)] & members:
                break  # what joins later would pass over it: its run comes first
            if not _stats_op(t):
                q += 1
                continue
            ahead = [op for op in order[end:q] if below[id(t)] >> position[id(op)] & 1]
            moved = {id(op) for op in ahead}
            rest = [op for op in order[end:q] if id(op) not in moved]
            order[k:] = [*ahead, *order[k:end], t, *rest, *order[q + 1 :]]
            k, end = k + len(ahead), end + len(ahead) + 1
            members |= 1 << position[id(t)]
            q = end
        k = end
    return order


def _stats_op(op: Op) -> bool:
    return bool(op.nest.sync_dims)
