"""Context parallelism as a rule: every op split along the sequence over the devices of a
node, data parallel across nodes.

Every op of a transformer but attention works a position at a time, so it splits along
the sequence with nothing to exchange; the fused attention (``ops/defs/attention.py``)
splits along its queries, each device reading every key and value: the partitioner
all-gathers K and V inside the node before it and reduce-scatters their gradients after
its backward. That is the all-gather form of context parallelism Llama 3 was trained
with (Dubey et al. 2024, §3.3.2), not the ring form (K and V passed around while each
block computes), and the queries are cut in contiguous chunks: under a causal mask the
last chunk's device does the most work (no head-tail balancing).
"""

from __future__ import annotations

from collections.abc import Mapping

from onnx2soap.errors import UserError
from onnx2soap.ir import Graph
from onnx2soap.search.megatron import sequence_split
from onnx2soap.search.replicas import replica_config
from onnx2soap.soap.dims import SoapDim
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


def context_parallel(graph: Graph, space: Space, devices: int, node: int) -> Strategy:
    """Each op along the sequence over ``node`` devices, by samples over the nodes; an op
    computed from weights alone split along a weight dim over every device, as data
    parallelism does."""
    length = sequence_length(graph)
    configs = {}
    for op in graph.ops:
        dims = space[op.name]
        if graph.tensors[op.output].batched:
            configs[op.name] = sequence_split(dims, devices, node, length)
        else:
            configs[op.name] = replica_config(dims, tuple(range(devices)))
    return Strategy(devices, configs)
