"""Strategies built by rule, not search: data parallel, model parallel, expert, single
device, Megatron-LM's tensor parallelism (search/megatron.py), context parallelism
(search/context.py), Alpa's intra-operator ILP (search/ilp.py), random, and ZeRO: data
parallelism whose plan shards optimizer state (and gradients) across the replicas
(soap/zero.py; the stage is the plan file's ``zero_stage``, which the caller sets: a
strategy has no stage)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import numpy as np

from onnx2soap.ir import Graph, Op, TensorRole
from onnx2soap.search.context import context_parallel
from onnx2soap.search.ilp import IlpOptions, IlpResult, ilp
from onnx2soap.search.megatron import megatron, node_size
from onnx2soap.search.pipeline_rule import staged_strategy
from onnx2soap.search.replicas import replica_config, split_first
from onnx2soap.sim import Simulator
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.dims import DimKind, SoapDim
from onnx2soap.soap.partition import ParallelConfig
from onnx2soap.soap.strategy import Strategy

Space = Mapping[str, tuple[SoapDim, ...]]


class Rule(Enum):
    DATA_PARALLEL = "data-parallel"
    MODEL_PARALLEL = "model-parallel"
    EXPERT = "expert"
    SINGLE_DEVICE = "single-device"
    MEGATRON = "megatron"
    ILP = "ilp"
    RANDOM = "random"
    ZERO = "zero"
    PIPELINE = "pipeline"  # search/pipeline_rule.py
    CONTEXT = "context"  # search/context.py


# Every plan is compared with each of these (a search could have returned any of them);
# one that does not fit in memory is reported as such and never used as a reference.
BASELINES = (
    Rule.DATA_PARALLEL,
    Rule.EXPERT,
    Rule.SINGLE_DEVICE,
    Rule.MODEL_PARALLEL,
    Rule.MEGATRON,
    Rule.ILP,
)


@dataclass(frozen=True)
class Built:
    """A strategy built by rule, and the ILP's account of itself where it built it."""

    strategy: Strategy
    ilp: IlpResult | None = None


def data_parallel(graph: Graph, space: Space, devices: int, width: int | None = None) -> Strategy:
    """Every op split by samples over devices ``0..width-1`` (all devices by default).

    A weight-only op (``soap/copies.py``) is computed whole on each of them (copies:
    ``replicas.replica_config``); another op without a sample dim is split along a
    weight dim over the same devices (``replicas.replica_split_kind``): whole on device 0
    it had sent every replica the whole tensor and received every replica's gradient of
    it (GPT-1.3B's data-parallel peak grew with the GPUs: 87, 93, 131 GiB at 8, 16, 64)."""
    width = devices if width is None else width
    if not 1 <= width <= devices:
        raise ValueError(f"data parallelism over {width} of {devices} devices")
    configs, copied = {}, weight_only_ops(graph)
    for op in graph.ops:
        dims = space[op.name]
        configs[op.name] = replica_config(dims, tuple(range(width)), op.name in copied)
    return Strategy(devices, configs)


def narrow_data_parallel(graph: Graph, space: Space, devices: int) -> dict[str, Strategy]:
    """Data parallelism over the first k devices for every divisor k of ``devices`` between
    1 and ``devices`` (exclusive), named ``data-parallel:k``: a model too small for the
    whole machine (or a batch too small to feed it) runs best on a node or a few. Devices
    are numbered node by node, so the first k are the fastest-connected k."""
    widths = [k for k in range(2, devices) if devices % k == 0]
    return {f"data-parallel:{k}": data_parallel(graph, space, devices, k) for k in widths}


def _is_fully_connected(op: Op, graph: Graph) -> bool:
    return op.type in ("Gemm", "MatMul") and any(
        graph.tensors[t].role is TensorRole.WEIGHT for t in op.inputs
    )


def expert(graph: Graph, space: Space, devices: int) -> Strategy:
    """Krizhevsky's "one weird trick": data parallel everywhere except fully connected
    layers, which split their output features (model parallel)."""
    configs = {}
    for op in graph.ops:
        kind = DimKind.PARAMETER if _is_fully_connected(op, graph) else DimKind.SAMPLE
        configs[op.name] = split_first(space[op.name], kind, tuple(range(devices)))
    return Strategy(devices, configs)


def model_parallel(graph: Graph, space: Space, devices: int) -> Strategy:
    """Classic model parallelism: every op whole on one device, the ops in graph order cut
    into ``devices`` consecutive groups of about equal FLOPs."""
    flops = np.array([max(op.nest.flops, 1) for op in graph.ops], dtype=float)
    ends = np.cumsum(flops) - flops / 2  # each op's FLOP midpoint
    share = flops.sum() / devices
    configs = {}
    for op, mid in zip(graph.ops, ends, strict=True):
        device = min(int(mid // share), devices - 1)
        configs[op.name] = ParallelConfig((1,) * len(space[op.name]), (device,))
    return Strategy(devices, configs)


def single_device(graph: Graph, space: Space, devices: int) -> Strategy:
    """Everything on device 0: the plan to beat when links are slow and the model small."""
    return Strategy(
        devices, {op.name: ParallelConfig((1,) * len(space[op.name]), (0,)) for op in graph.ops}
    )


def random_config(
    dims: tuple[SoapDim, ...], devices: int, rng: np.random.Generator
) -> ParallelConfig:
    """Any valid config: mixed degrees (up to ``devices`` tasks) on any devices, several
    tasks of an op possibly on one device."""
    degrees = [1] * len(dims)
    for i in rng.permutation(len(dims)):
        room = devices // math.prod(degrees)
        if dims[i].splittable and room > 1:
            degrees[i] = int(rng.integers(1, min(room, dims[i].max_degree) + 1))
    tasks = math.prod(degrees)
    placement = rng.integers(0, devices, size=tasks)
    return ParallelConfig(tuple(degrees), tuple(int(d) for d in placement))


def random_strategy(graph: Graph, space: Space, devices: int, rng: np.random.Generator) -> Strategy:
    return Strategy(
        devices, {op.name: random_config(space[op.name], devices, rng) for op in graph.ops}
    )


def build(
    rule: Rule,
    graph: Graph,
    space: Space,
    devices: int,
    seed: int = 0,
    simulator: Simulator | None = None,
    ilp_options: IlpOptions | None = None,
    sequence_parallel: bool = False,
    head_tail: bool = True,
) -> Built:
    """The strategy of ``rule``. Megatron reads the machine's nodes off ``simulator``
    (without one, all devices are one node), and splits the ops between its blocks by
    the sequence where ``sequence_parallel``; the ILP prices configs with it (required);
    context parallelism balances causal work by head and tail chunks unless not
    ``head_tail``."""
    if rule is Rule.MEGATRON:
        node = devices if simulator is None else node_size(simulator.machine)
        return Built(megatron(graph, space, devices, node, sequence_parallel))
    if rule is Rule.ILP:
        if simulator is None:
            raise ValueError("the ILP prices every config with a simulator; give one")
        result = ilp(graph, space, simulator, ilp_options or IlpOptions())
        if result.strategy is None:  # not built in time: data parallelism stands in
            return Built(data_parallel(graph, space, devices), result)
        return Built(result.strategy, result)
    return Built(by_rule(rule, graph, space, devices, seed, simulator, head_tail))


def by_rule(
    rule: Rule,
    graph: Graph,
    space: Space,
    devices: int,
    seed: int = 0,
    simulator: Simulator | None = None,
    head_tail: bool = True,
) -> Strategy:
    if rule in (Rule.DATA_PARALLEL, Rule.ZERO):  # ZeRO's splits are data parallelism's
        return data_parallel(graph, space, devices)
    if rule is Rule.MODEL_PARALLEL:
        return model_parallel(graph, space, devices)
    if rule is Rule.EXPERT:
        return expert(graph, space, devices)
    if rule is Rule.SINGLE_DEVICE:
        return single_device(graph, space, devices)
    if rule is Rule.PIPELINE:  # its stages alone; plan --strategy pipeline adds microbatches
        return staged_strategy(graph, space, simulator)
    if rule is Rule.CONTEXT:
        node = devices if simulator is None else node_size(simulator.machine)
        return context_parallel(graph, space, devices, node, head_tail)
    if rule in (Rule.MEGATRON, Rule.ILP):
        return build(rule, graph, space, devices, seed, simulator).strategy
    return random_strategy(graph, space, devices, np.random.default_rng(seed))
