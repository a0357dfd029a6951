"""Per-device peak memory of one training step, as the executor allocates it.

Per device: every weight Rect it holds, once, plus its gradient (SGD keeps no optimizer
state); for every task on it: its assembled input buffers (weights excluded), its
output tile, and their gradients, all kept until the step ends; the receive buffers
posted at the start of the step and the send copies held until the step ends.
"""

from __future__ import annotations

from onnx2soap.ir import TensorRole
from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.partition import rect_volume


def _op_elements(pg: PartitionedGraph, op) -> tuple[tuple[int, int], ...]:
    """(device, elements) held for one op: weight shards with gradients, task buffers."""
    graph = pg.graph
    held: dict[int, int] = {}
    shards = {(g.weight, g.rect, d) for g in pg.groups[op.name] for d in g.devices}
    for _, rect, d in shards:
        held[d] = held.get(d, 0) + 2 * rect_volume(rect)  # weight + gradient
    weight = [graph.tensors[t].role is TensorRole.WEIGHT for t in op.inputs]
    for t in pg.tasks[op.name]:
        buffers = sum(rect_volume(r.buffer) for r, w in zip(t.inputs, weight, strict=True) if not w)
        held[t.device] = held.get(t.device, 0) + 2 * (buffers + rect_volume(t.output))
    return tuple(held.items())


def peak_memory(
    pg: PartitionedGraph,
    devices: int,
    itemsize: int = 4,
    memo: dict[tuple, tuple[tuple[int, int], ...]] | None = None,
) -> tuple[int, ...]:
    memo = {} if memo is None else memo
    elements = [0] * devices
    for op in pg.graph.ops:
        key = (op.name, pg.strategy[op.name])
        if key not in memo:
            memo[key] = _op_elements(pg, op)
        for d, n in memo[key]:
            elements[d] += n
    for edge in pg.edges:
        producers, consumers = pg.tasks[edge.producer], pg.tasks[edge.consumer]
        for o in edge.overlaps:
            a, b = producers[o.src_task].device, consumers[o.dst_task].device
            if a != b:
                # forward: a keeps a send copy, b a receive buffer; backward: the reverse
                elements[a] += 2 * o.volume
                elements[b] += 2 * o.volume
    return tuple(e * itemsize for e in elements)
