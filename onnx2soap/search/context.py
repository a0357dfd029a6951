"""Context parallelism as a rule: every op split along the sequence over the devices of a
node, data parallel across nodes.

Every op of a transformer but attention works a position at a time, so it splits along
the sequence with nothing to exchange; the fused attention (``ops/defs/attention.py``)
splits along its queries, each device reading every key and value: the partitioner
moves every device's K and V to the others before it and sums their gradients after
its backward. The attention takes them as ring attention does (``soap/streamed.py``):
one block a device, its own first and the others in ring order, computing on each as
it arrives and combining the blocks by log-sum-exp, so the transfers overlap its work;
each device holds K and V whole, as in the all-gather form Llama 3 was trained with
(Dubey et al. 2024, §3.3.2), its backward reading them there. Nothing is chosen for it:
an attention split along its queries over devices always streams its keys.

Under a causal mask a query's work grows with its position, so contiguous chunks leave
the last device of N about 2N-1 times the first's. Where the model has causal attention
the sequence is cut in 2N chunks instead, device i of a node holding chunks i and
2N-1-i (head-tail balancing, as torchtitan's and Megatron-LM's context parallelism):
every device gets the same causal work. Every op split along the sequence is cut so,
two tasks a device, so the per-position ops between the attentions move nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from onnx2soap.errors import UserError
from onnx2soap.ir import Graph
from onnx2soap.search.megatron import sequence_split
from onnx2soap.search.replicas import replica_config
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.dims import SoapDim
from onnx2soap.soap.partition import ParallelConfig, task_coords
from onnx2soap.soap.strategy import Strategy

Space = Mapping[str, tuple[SoapDim, ...]]


def sequence_length(graph: Graph) -> int:
    """The tokens a sample: axis 1 of the data input, token ids [batch, tokens] or
    features [batch, tokens, width]."""
    data = graph.tensors[graph.inputs[0]]
    ids = not data.dtype.is_float and len(data.shape) == 2
    if not (ids or (data.dtype.is_float and len(data.shape) == 3)) or data.shape[1] < 2:
        raise UserError(
            f"--strategy context splits the sequence: the data input '{data.name}' "
            f"{list(data.shape)} ({data.dtype.value}) is not token ids [batch, tokens] nor "
            "features [batch, tokens, width]"
        )
    return data.shape[1]


def context_parallel(
    graph: Graph, space: Space, devices: int, node: int, head_tail: bool = True
) -> Strategy:
    """Each op along the sequence over ``node`` devices, by samples over the nodes; an op
    computed from weights and constants alone copied on every device (``soap/copies.py``),
    another without samples split along a weight dim, as data parallelism does.
    ``head_tail``: where the model has causal attention, the sequence in head and tail
    chunks (``balanced``); else in one contiguous chunk a device."""
    length = sequence_length(graph)
    balance = head_tail and node > 1 and causal_attention(graph)
    configs, copied = {}, weight_only_ops(graph)
    for op in graph.ops:
        dims = space[op.name]
        if graph.tensors[op.output].batched:
            config = sequence_split(dims, devices, node, length)
        else:
            config = replica_config(dims, tuple(range(devices)), op.name in copied)
        # the rotary tables (of positions alone) along the sequence too, as their readers
        configs[op.name] = balanced(dims, config, node, length) if balance else config
    return Strategy(devices, configs)


def causal_attention(graph: Graph) -> bool:
    """Whether some op's work depends on where its queries lie (a causal attention)."""
    return any(op.nest.causal is not None for op in graph.ops)


def head_tail_device(chunk: int, node: int) -> int:
    """The device in a node of ``node`` devices that holds ``chunk`` of 2·node: i and
    2·node-1-i on device i."""
    return chunk if chunk < node else 2 * node - 1 - chunk


def balanced(
    dims: tuple[SoapDim, ...], config: ParallelConfig, node: int, length: int
) -> ParallelConfig:
    """``config`` (``sequence_split``'s: the sequence in ``node`` contiguous chunks inside
    each node) with the sequence in 2·node chunks, the node's devices holding them
    head-tail; as it is where it splits no dim of the sequence's length ``node`` ways or
    that dim cannot be cut 2·node ways."""
    sequence = next(
        (
            i
            for i, (d, k) in enumerate(zip(dims, config.degrees, strict=True))
            if k == node and d.size == length
        ),
        None,
    )
    if sequence is None or config.copies > 1:
        return config
    dim = dims[sequence]
    if 2 * node > dim.max_degree or (dim.size // (2 * node)) % dim.granule:
        return config
    degrees = tuple(2 * node if i == sequence else k for i, k in enumerate(config.degrees))
    where = dict(zip(task_coords(config.degrees), config.devices, strict=True))
    devices = []
    for coord in task_coords(degrees):
        chunk = coord[sequence]
        first = where[(*coord[:sequence], 0, *coord[sequence + 1 :])]  # the node's
        devices.append(first - first % node + head_tail_device(chunk, node))
    return ParallelConfig(degrees, tuple(devices))
