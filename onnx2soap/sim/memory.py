"""Per-device peak memory of one training step, as the executor allocates it.

Per device: the batch rows its tasks read of every data input (a rank holds no others),
the labels whole (they give a mean loss its divisor) and every constant, whole; every
weight Rect it holds, once, plus its gradient and the optimizer's state (none for SGD,
one array for momentum, two for Adam), and every state Rect (BatchNorm's running
statistics: no gradient); for every task on it: its assembled input buffers (weights
excluded) and output tile, kept for the backward, and the gradients of both (activation
inputs only), kept until the step ends; the receive buffers and the send copies held
until it ends. Labels count at their own width (int64
class ids).
"""

from __future__ import annotations

from onnx2soap.ir import TensorRole
from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.partition import rect_volume

# Arrays of optimizer state per trainable shard (the executor's ``--optimizer``).
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2, "adamw": 2}


def _op_bytes(
    pg: PartitionedGraph, op, itemsize: int, slots: int = 0
) -> tuple[tuple[int, int], ...]:
    """(device, bytes) held for one op: weight shards with gradients and ``slots``
    optimizer arrays each, task buffers."""
    graph = pg.graph
    held: dict[int, int] = {}
    shards = {(g.weight, g.rect, d, g.trainable) for g in pg.groups[op.name] for d in g.devices}
    for _, rect, d, trainable in shards:
        copies = 2 + slots if trainable else 1  # weight, gradient, optimizer; state alone
        held[d] = held.get(d, 0) + copies * rect_volume(rect) * itemsize
    roles = [graph.tensors[t].role for t in op.inputs]
    widths = [
        graph.tensors[t].dtype.itemsize if r is TensorRole.LABELS else itemsize
        for t, r in zip(op.inputs, roles, strict=True)
    ]
    for t in pg.tasks[op.name]:
        out = rect_volume(t.output) * itemsize
        total = 2 * out  # the output tile and its gradient
        for region, role, width in zip(t.inputs, roles, widths, strict=True):
            if role not in (TensorRole.WEIGHT, TensorRole.STATE):
                copies = 2 if role is TensorRole.ACTIVATION else 1  # buffer (+ its gradient)
                total += copies * rect_volume(region.buffer) * width
        held[t.device] = held.get(t.device, 0) + total
    return tuple(held.items())


def _width(t, itemsize: int) -> int:
    return itemsize if t.dtype.is_float else t.dtype.itemsize  # ids and labels: int64


def _batch_bytes(pg: PartitionedGraph, device: int, itemsize: int) -> int:
    """The device's rows of every data input; the labels and the constants, whole."""
    graph = pg.graph
    held = sum(t.numel * _width(t, itemsize) for t in graph.constants)
    if graph.labels:
        labels = graph.tensors[graph.labels]
        held += labels.numel * _width(labels, itemsize)
    for name, (lo, hi) in pg.data_rows(device).items():
        t = graph.tensors[name]
        if name != graph.labels:
            held += (hi - lo) * (t.numel // t.shape[0]) * _width(t, itemsize)
    return held


def peak_memory(
    pg: PartitionedGraph,
    devices: int,
    itemsize: int = 4,
    memo: dict[tuple, tuple[tuple[int, int], ...]] | None = None,
    slots: int = 0,
) -> tuple[int, ...]:
    """``memo`` must belong to one (itemsize, slots) pair, as a Simulator's does."""
    memo = {} if memo is None else memo
    held = [_batch_bytes(pg, d, itemsize) for d in range(devices)]
    for op in pg.graph.ops:
        key = (op.name, pg.strategy[op.name])
        if key not in memo:
            memo[key] = _op_bytes(pg, op, itemsize, slots)
        for d, n in memo[key]:
            held[d] += n
    for _, o, p, c in pg.moves():
        if p.device != c.device:
            # forward: p keeps a send copy, c a receive buffer; backward: the reverse
            held[p.device] += 2 * o.volume * itemsize
            held[c.device] += 2 * o.volume * itemsize
    return tuple(held)
