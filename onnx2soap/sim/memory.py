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


def peak_memory(pg: PartitionedGraph, devices: int, itemsize: int = 4) -> tuple[int, ...]:
    graph = pg.graph
    elements = [0] * devices
    for op in graph.ops:
        shards = {(g.weight, g.rect, d) for g in pg.groups[op.name] for d in g.devices}
        for _, rect, d in shards:
            elements[d] += 2 * rect_volume(rect)  # weight + gradient
        weight_operand = [graph.tensors[t].role is TensorRole.WEIGHT for t in op.inputs]
        for t in pg.tasks[op.name]:
            buffers = sum(
                rect_volume(r.buffer)
                for r, is_weight in zip(t.inputs, weight_operand, strict=True)
                if not is_weight
            )
            elements[t.device] += 2 * (buffers + rect_volume(t.output))
    for edge in pg.edges:
        producers, consumers = pg.tasks[edge.producer], pg.tasks[edge.consumer]
        for o in edge.overlaps:
            a, b = producers[o.src_task].device, consumers[o.dst_task].device
            if a != b:
                # forward: a keeps a send copy, b a receive buffer; backward: the reverse
                elements[a] += 2 * rect_volume(o.rect)
                elements[b] += 2 * rect_volume(o.rect)
    return tuple(e * itemsize for e in elements)
