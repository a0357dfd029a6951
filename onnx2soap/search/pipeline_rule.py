"""The ``pipeline`` rule (issue 32): pipeline stages over groups of devices, data
parallelism inside each stage.

- Devices are cut into ``S`` contiguous groups, as balanced as the count allows. The
  machine numbers devices node by node, so where ``S`` divides the node count each group
  is whole nodes: the stages' moves cross the slow links, the rings stay in a node.
- Ops, contiguous in graph (topological) order, are cut into ``S`` stages balanced by
  each op's simulated time on its stage (``pipeline_stages.balanced_stages``, exact):
  the forward and backward of its slowest task under data parallelism over a group
  (its forward again where it is recomputed).
- Every op of stage ``s`` is split by samples over group ``s`` (as many of its devices
  as the microbatch's samples allow), the model being loaded at the microbatch's batch.

``default_shape`` gives the baseline's shape: one stage per node (at least 2), and the
most microbatches up to 4 per stage whose samples still fill a stage's devices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from onnx2soap.errors import UserError
from onnx2soap.ir import Graph
from onnx2soap.search.groups import Block, find_groups
from onnx2soap.search.megatron import node_size
from onnx2soap.search.pipeline_stages import balanced_stages
from onnx2soap.search.replicas import replica_config
from onnx2soap.sim import Simulator
from onnx2soap.sim.machine import Machine
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.dims import SoapDim, analyze
from onnx2soap.soap.partition import ParallelConfig, chunk
from onnx2soap.soap.partitioned import Partitioner
from onnx2soap.soap.pipeline import Pipeline, Schedule
from onnx2soap.soap.strategy import Strategy

Space = Mapping[str, tuple[SoapDim, ...]]
# The baseline's microbatches per stage at most (Megatron-LM's advice: M >= 4 S keeps the
# bubble, (S - 1) / (M + S - 1), under a fifth).
MICROBATCHES_PER_STAGE = 4


@dataclass(frozen=True)
class PipelinePlan:
    strategy: Strategy  # on the graph at the microbatch's batch
    pipeline: Pipeline


def stage_groups(devices: int, stages: int) -> tuple[tuple[int, ...], ...]:
    """``stages`` contiguous groups of ``0..devices-1``, sizes differing by one at most."""
    if not 1 <= stages <= devices:
        raise UserError(f"{stages} pipeline stages on {devices} devices: use 1 to {devices}")
    bounds = [chunk(devices, stages, s) for s in range(stages)]
    return tuple(tuple(range(lo, hi)) for lo, hi in bounds)


def op_seconds(
    graph: Graph,
    space: Space,
    simulator: Simulator,
    group: tuple[int, ...],
    recompute: frozenset[str] = frozenset(),
) -> list[float]:
    """Per op (graph order), its slowest task's forward and backward (and its forward
    again where recomputed) under data parallelism over ``group``: the time it adds to
    its stage's passes, its tasks running side by side."""
    copied = weight_only_ops(graph)
    configs = {
        op.name: replica_config(space[op.name], group, op.name in copied) for op in graph.ops
    }
    return task_seconds(graph, configs, simulator, recompute)


def task_seconds(
    graph: Graph,
    configs: Mapping[str, ParallelConfig],
    simulator: Simulator,
    recompute: frozenset[str] = frozenset(),
) -> list[float]:
    """Per op (graph order), its slowest task's forward and backward (and its forward
    again where recomputed) under ``configs``."""
    partitioner = Partitioner(graph)
    devices, cost, size = simulator.machine.devices, simulator.cost, simulator.itemsize
    seconds = []
    for op in graph.ops:
        backward = graph.differentiable(op.output)
        redo = 2 if backward and op.name in recompute else 1
        slowest = 0.0
        for t in partitioner.tasks(op, configs[op.name]):
            device = devices[t.device]
            took = redo * cost.forward(op, t, device, size)
            if backward:
                took += cost.backward(op, t, device, size)
            slowest = max(slowest, took)
        seconds.append(slowest)
    return seconds


def pipeline_plan(
    graph: Graph,
    space: Space,
    simulator: Simulator,
    stages: int,
    microbatches: int,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    recompute: frozenset[str] = frozenset(),
) -> PipelinePlan:
    """The rule's plan on ``graph``, the model at the microbatch's batch."""
    devices = simulator.machine.size
    groups = stage_groups(devices, stages)
    if stages > len(graph.ops):
        raise UserError(
            f"{stages} pipeline stages for {len(graph.ops)} ops: use 1 to {len(graph.ops)}"
        )
    if stages == 1:  # gradient accumulation: every op, no times to balance (each op's
        runs = (range(len(graph.ops)),)  # tasks' costs on 128 GPUs: 1.5 s)
    else:
        narrowest = min(groups, key=len)
        seconds = op_seconds(graph, space, simulator, narrowest, recompute)
        runs = balanced_stages(seconds, stages)
    configs, names, copied = {}, [], weight_only_ops(graph)
    for group, run in zip(groups, runs, strict=True):
        ops = [graph.ops[i] for i in run]
        for op in ops:
            configs[op.name] = replica_config(space[op.name], group, op.name in copied)
        names.append(tuple(op.name for op in ops))
    return PipelinePlan(Strategy(devices, configs), Pipeline(tuple(names), microbatches, schedule))


def check_shape(devices: int, batch: int, ops: int, stages: int, microbatches: int) -> None:
    """The rule's refusals, each one line, before any work: more stages than devices or
    ops, microbatches that do not divide the batch, a microbatch too small to split over
    a stage's devices."""
    if not 1 <= stages <= devices:
        raise UserError(
            f"--stages {stages}: the machine has {devices} devices (use 1 to {devices})"
        )
    if stages > ops:
        raise UserError(f"--stages {stages}: the model has {ops} ops (use 1 to {ops})")
    if microbatches < 1 or batch % microbatches:
        raise UserError(
            f"--microbatches {microbatches} does not divide the batch of {batch} (use a "
            f"divisor of {batch})"
        )
    width = max(len(g) for g in stage_groups(devices, stages))
    if batch // microbatches < width:
        raise UserError(
            f"--microbatches {microbatches}: a microbatch of {batch // microbatches} samples "
            f"cannot be split over a stage's {width} devices (use at most "
            f"{max(1, batch // width)} microbatches, or more stages)"
        )


def shape_accepted(devices: int, batch: int, ops: int, stages: int, microbatches: int) -> bool:
    """Whether ``check_shape`` lets the shape through."""
    try:
        check_shape(devices, batch, ops, stages, microbatches)
    except UserError:
        return False
    return True


def default_shape(machine: Machine, batch: int, ops: int) -> tuple[int, int] | None:
    """The baseline's stages and microbatches: a stage per node (at least 2, at most the
    devices and the ops) and the most microbatches, up to ``MICROBATCHES_PER_STAGE`` per
    stage, that divide the batch with samples enough for a stage's devices; None where
    no pipeline of 2 stages or more is possible."""
    devices = machine.size
    stages = min(max(2, devices // node_size(machine)), devices, ops)
    if stages < 2:
        return None
    microbatches = default_microbatches(devices, batch, stages)
    return None if microbatches is None else (stages, microbatches)


def default_microbatches(devices: int, batch: int, stages: int) -> int | None:
    """The most microbatches, up to ``MICROBATCHES_PER_STAGE`` per stage, that divide
    the batch with samples enough for a stage's devices; None where none does."""
    width = max(len(g) for g in stage_groups(devices, stages))
    fitting = [
        m
        for m in range(1, MICROBATCHES_PER_STAGE * stages + 1)
        if batch % m == 0 and batch // m >= width
    ]
    return max(fitting) if fitting else None


# Ops whose outputs selective recomputation keeps: the products, costly to make again
# (Megatron-LM's selective recomputation keeps them and remakes the cheap ops between),
# and the fused attention (torchtitan's per-op policy saves SDPA's output).
COSTLY = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "LSTM", "GRU", "Attention"})
# the products torchtitan's per-op policy counts (``aten.mm``: the linear layers)
ALTERNATED = frozenset({"MatMul", "Gemm"})


class Recompute(Enum):
    """What a plan (or a pipeline's stage) recomputes in its backward: nothing, every
    op but the checkpoints (``full_recompute``), every op but the products
    (``selective_recompute``), or that and every second product of each repeated block
    (``alternate_products``: torchtitan's per-op policy, a published configuration's;
    the search does not offer it, ``SEARCHED``)."""

    NONE = "none"
    ALL = "all"
    SELECTIVE = "selective"
    SELECTIVE_OP = "selective-op"


SEARCHED = (Recompute.NONE, Recompute.ALL, Recompute.SELECTIVE)


def kept_products(graph: Graph) -> tuple[str, ...]:
    """``selective_recompute``'s list, or () for a model without a product (nothing for
    a search to offer there)."""
    if not any(op.type in COSTLY for op in graph.ops):
        return ()
    return selective_recompute(graph)


def selective_recompute(graph: Graph) -> tuple[str, ...]:
    """``--recompute selective``: every op but the products (``COSTLY``) and the loss, in
    graph order: the normalizations, activations, dropout and elementwise ops between
    products are made again in the backward from the products' outputs, which are kept,
    as Megatron-LM's selective recomputation and torchtitan's per-op policy do. A model
    without a product has nothing to keep: refused in one line."""
    costly = [op.name for op in graph.ops if op.type in COSTLY]
    if not costly:
        raise UserError(
            "--recompute selective keeps the outputs of the products (MatMul, Gemm, Conv, "
            "ConvTranspose, LSTM, GRU) and the model has none: use --recompute all"
        )
    loss = graph.loss_op
    kept = set(costly) | ({loss.name} if loss is not None else set())
    return tuple(op.name for op in graph.ops if op.name not in kept)


def alternate_products(graph: Graph, space: Space | None = None) -> tuple[str, ...]:
    """``--recompute selective-op``: torchtitan's per-op selective checkpointing
    (``selective_ac_option = 'op'``, the policy of its published Llama runs): every op
    but the products and the loss is recomputed, and so is every second product of each
    checkpointed block (counted from one in each block: torchtitan checkpoints each
    transformer block, and its counter of ``aten.mm`` starts again in each). The blocks
    are the graph's repeated runs (``groups.find_groups``); products outside them keep
    their outputs, as torchtitan's output projection, outside every block, does."""
    cheap = set(selective_recompute(graph))
    products = {op.name for op in graph.ops if op.type in ALTERNATED}
    for block in find_groups(graph, space or analyze(graph)).blocks:
        for instance in block.instances:
            ordered = [name for name in instance if name in products]
            cheap.update(ordered[1::2])
    return tuple(op.name for op in graph.ops if op.name in cheap)


def recompute_list(
    mode: Recompute, graph: Graph, space: Space | None = None, simulator: Simulator | None = None
) -> tuple[str, ...]:
    """The ops a plan recomputes under ``--recompute``'s ``mode``: none, all (checkpoints
    kept, ``full_recompute``), selective (products kept, ``selective_recompute``) or
    selective-op (``alternate_products``)."""
    if mode is Recompute.ALL:
        return full_recompute(graph, space, simulator)
    if mode is Recompute.SELECTIVE:
        return selective_recompute(graph)
    if mode is Recompute.SELECTIVE_OP:
        return alternate_products(graph, space)
    return ()


def full_recompute(
    graph: Graph, space: Space | None = None, simulator: Simulator | None = None
) -> tuple[str, ...]:
    """``--recompute all``: every op but the loss and the checkpoints (``checkpoints``),
    in graph order. The executor rematerializes a segment between checkpoints at its
    first backward need and holds each tile until its own backward, so only one
    segment's activations are live at the backward's peak (with no checkpoint, the
    first backward would make the whole forward again)."""
    loss = graph.loss_op
    kept = set(checkpoints(graph, space or analyze(graph), simulator))
    return tuple(
        op.name
        for op in graph.ops
        if op.name not in kept and (loss is None or op.name != loss.name)
    )


def checkpoints(graph: Graph, space: Space, simulator: Simulator | None = None) -> tuple[str, ...]:
    """The ops ``--recompute all`` keeps, in graph order. Where the model repeats
    blocks (``groups.find_groups``: transformer layers, a ResNet stage's blocks), the
    ops whose outputs cross a block instance's boundary (its input and output, as
    Megatron-LM's full recomputation keeps each layer's input): a layer's inside is
    recomputed during that layer's backward. Else about sqrt(n) ops evenly spaced by
    simulated time (Chen et al. 2016; by op count without a simulator)."""
    blocks = find_groups(graph, space).blocks
    if blocks:
        return _block_boundaries(graph, blocks)
    ops = [op for op in graph.ops if op.name != getattr(graph.loss_op, "name", None)]
    if simulator is None:
        seconds = [1.0] * len(ops)
    else:
        group = (0,)  # one device: only the ops' relative times matter
        every = op_seconds(graph, space, simulator, group)
        by_name = {op.name: t for op, t in zip(graph.ops, every, strict=True)}
        seconds = [by_name[op.name] for op in ops]
    return _evenly_spaced([op.name for op in ops], seconds)


def _block_boundaries(graph: Graph, blocks: tuple[Block, ...]) -> tuple[str, ...]:
    """The ops read across a block instance's boundary: by an op of another instance or
    of none, or, outside every block, by an op inside one."""
    where: dict[str, tuple[int, int]] = {}
    for b, block in enumerate(blocks):
        for k, names in enumerate(block.instances):
            for name in names:
                where[name] = (b, k)
    producer = {op.output: op.name for op in graph.ops}
    kept = set()
    for op in graph.ops:
        for tensor in op.inputs:
            p = producer.get(tensor)
            if p is not None and where.get(p) != where.get(op.name):
                kept.add(p)
    return tuple(op.name for op in graph.ops if op.name in kept)


def _evenly_spaced(names: list[str], seconds: list[float]) -> tuple[str, ...]:
    """About sqrt(n) of ``names``: the ops at which the running time first reaches each
    of ``k`` evenly spaced fractions of the total (k = round(sqrt(n)), k + 1 segments)."""
    k = round(math.sqrt(len(names)))
    total = sum(seconds)
    if k == 0 or total <= 0:
        return ()
    chosen, running, j = [], 0.0, 1
    for name, t in zip(names, seconds, strict=True):
        running += t
        if j <= k and running >= j * total / (k + 1):
            chosen.append(name)
            while j <= k and running >= j * total / (k + 1):
                j += 1
    return tuple(chosen)


def staged_strategy(graph: Graph, space: Space, simulator: Simulator | None) -> Strategy:
    """The rule's stages and devices as a plain strategy (one microbatch, ``graph`` at
    the step's batch): what ``baselines.by_rule`` builds; ``plan --strategy pipeline``
    adds the microbatches and the schedule."""
    if simulator is None:
        raise ValueError("the pipeline rule balances stages by simulated time; give a simulator")
    shape = default_shape(simulator.machine, graph.batch, len(graph.ops))
    return pipeline_plan(graph, space, simulator, shape[0] if shape else 1, 1).strategy
