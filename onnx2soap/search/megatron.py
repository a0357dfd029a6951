"""Megatron-LM's tensor parallelism as a rule: tensor parallel inside a node, data parallel
across nodes.

Recognised from the loop nests, not from op names, by following where each tensor is
cut (its *sharding*: an axis in equal chunks, chunk ``c`` on the node's device of rank
``(first + c) mod tp``) through the graph in order:

- a **lookup** (a splittable reduction dim that does no work per point: an embedding's
  vocabulary) splits that dim over the node: partial lookups, summed;
- a **linear** (a splittable reduction dim shared by a batched operand and one computed
  from weights alone: Gemm, or a MatMul with a weight, a tied one through a Transpose
  included) splits by **rows** (the reduction, a partial sum: Megatron's row-parallel
  linear) where its batched input comes cut along that dim, else by **columns** (its
  kept dim that reads only the weight): the first MLP linear, attention's projections,
  the LM head. Where the columns are read as ``s`` equal slices (a fused QKV projection
  split into query, key and value) it splits them ``s * tp`` ways, slice ``j``'s chunks
  on ranks ``0..tp-1`` in turn, so every device gets its own heads of all three;
- any other op **follows** a cut input: the dim that reads the cut axis splits into the
  chunks it covers (through reshapes that split or merge it, transposes, slices): the
  heads through attention, the columns through GELU;
- ops with no rule (LayerNorm, the residual adds, the loss) are data parallel over all
  devices, as are ops whose cut dim does not divide; with fewer samples than devices,
  by samples over the nodes and along the sequence inside each (the loss on each node's
  first device: ``_data_parallel``); ops computed from weights alone (a
  tied weight's Identity, its Transpose) are cut as their first consumer reads them, on
  the first node; a weight-only one (``soap/copies.py``) each chunk copied on every
  device that reads it (the LSTM weights' Slice x 4 -> Concat on every replica), inside
  a pipeline stage (``megatron_at``) too.

Every op with a rule is also split by samples over the nodes (task of node ``j`` and
rank ``i`` on device ``j * tp + i``). ``tp`` is the largest divisor of the node size
(the devices the machine's fastest routes join) under which no cut has to stop for a
size that does not divide (GPT-2 small's 12 heads on 8 GPUs: 4).

What differs from Megatron-LM: an op runs once per task, never replicated, so the
LayerNorms and residual adds between the linears are split by samples over the node
rather than computed whole on every device: the summed output of a row-parallel linear
is all-reduced (every device of the node holds it, as Megatron's) and read where it is,
but the next column-parallel linear gathers its input (half an all-reduce's bytes) where
Megatron has it already; and the loss does not split the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from onnx2soap.ir import Affine, Graph, Grouped, Op
from onnx2soap.sim.machine import Machine
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.dims import DimKind, SoapDim
from onnx2soap.soap.partition import ParallelConfig, task_coords
from onnx2soap.soap.strategy import Strategy

Space = Mapping[str, tuple[SoapDim, ...]]


@dataclass(frozen=True)
class Cut:
    """A tensor cut along ``axis`` into ``parts`` equal chunks; chunk ``c`` on the node's
    device of rank ``(first + c) mod tp``."""

    axis: int
    parts: int
    first: int = 0


@dataclass(frozen=True)
class _Split:
    """One op's tensor-parallel split: ``dim`` in ``degree`` chunks from rank ``first``."""

    dim: int
    degree: int
    first: int = 0


class _Why(Enum):
    """Why a cut input could not be followed."""

    NO_DIM = "no splittable dim reads it"
    SIZE = "its chunks do not divide the dim"


def node_size(machine: Machine) -> int:
    """The largest divisor ``k`` of the device count such that every aligned block of
    ``k`` devices is joined by the machine's fastest routes (its nodes: 4 on
    flexflow-p100, 8 on dgx-h100, every rank on cpu:N)."""
    n = machine.size
    if n == 1:
        return 1

    def bandwidth(a: int, b: int) -> float:
        return min(machine.links[i].bandwidth for i in machine.route(a, b))

    fastest = max(bandwidth(0, d) for d in range(1, n))
    best = 1
    for k in range(2, n + 1):
        if n % k:
            continue
        blocks = range(0, n, k)
        if all(
            bandwidth(a, b) >= fastest
            for s in blocks
            for a in range(s, s + k)
            for b in range(s, s + k)
            if a != b
        ):
            best = k
    return best


def megatron(
    graph: Graph, space: Space, devices: int, node: int, sequence_parallel: bool = False
) -> Strategy:
    """Megatron-LM's plan for ``devices`` devices in nodes of ``node`` (``node_size``).
    ``sequence_parallel``: the ops with no rule (norms, residual adds, dropouts) split
    along the sequence inside each node whatever the batch, as Megatron-LM's
    ``--sequence-parallel`` (else only where the samples are fewer than the devices)."""
    if devices % node:
        raise ValueError(f"{devices} devices are not whole nodes of {node}")
    best: tuple[int, Strategy] | None = None
    # the largest tensor-parallel degree (above 1, where the node has more than one
    # device) under which no cut stops for a size; else the one where fewest do
    for tp in sorted((t for t in range(2, node + 1) if node % t == 0), reverse=True):
        strategy, broken = _plan(graph, space, devices, tp, sequence_parallel, copies=True)
        if broken == 0:
            return strategy
        if best is None or broken < best[0]:
            best = (broken, strategy)
    if best is not None:
        return best[1]
    return _plan(graph, space, devices, 1, sequence_parallel, copies=True)[0]


def megatron_at(graph: Graph, space: Space, devices: int, tp: int) -> Strategy:
    """Megatron-LM's plan at tensor-parallel degree ``tp`` (dividing ``devices``, each
    aligned block of ``tp`` devices one node's): what a pipeline stage runs inside."""
    if devices % tp:
        raise ValueError(f"tensor-parallel degree {tp} does not divide {devices} devices")
    return _plan(graph, space, devices, tp, copies=True)[0]


def _plan(
    graph: Graph,
    space: Space,
    devices: int,
    tp: int,
    sequence_parallel: bool = False,
    copies: bool = False,
) -> tuple[Strategy, int]:
    """The plan at tensor-parallel degree ``tp``, and how many cuts stopped for sizes.
    ``copies``: weight-only ops copied on the devices that read them (``_like_consumer``)."""
    dp = devices // tp
    cut: dict[str, Cut] = {}
    configs: dict[str, ParallelConfig] = {}
    broken = 0
    later: list[Op] = []  # computed from weights alone: cut as their consumers read them
    for op in graph.ops:
        if not graph.tensors[op.output].batched:
            later.append(op)
            continue
        dims = space[op.name]
        split, output, why = _decide(graph, op, dims, cut, tp)
        if why is _Why.SIZE:
            broken += 1
        if split is None:
            configs[op.name] = _data_parallel(dims, devices, tp, sequence_parallel)
            continue
        configs[op.name] = _config(dims, split, dp, tp)
        if output is not None:
            cut[op.output] = output
    copied = weight_only_ops(graph) if copies else frozenset()
    for op in reversed(later):
        configs[op.name] = _like_consumer(graph, op, space, configs, op.name in copied)
    return Strategy(devices, configs), broken


def _decide(graph: Graph, op: Op, dims, cut: dict[str, Cut], tp: int):
    """(the op's split, its output's cut, why a cut input was not followed)."""
    nest = op.nest
    lookup = [d for d in nest.partial_dims if d in nest.free_dims and dims[d].splittable]
    if lookup and tp > 1:  # its output is whole: chunks need not be equal
        if tp <= dims[lookup[0]].max_degree:
            return _Split(lookup[0], tp), None, None
        return None, None, _Why.SIZE
    linear = _linear(graph, op, dims)
    if linear is not None and tp > 1:
        x, reduction, column = linear
        spec = cut.get(op.inputs[x])
        if spec is not None and _reads(nest, x, spec.axis) == reduction:
            followed = _follow(graph, op, dims, x, spec, tp)
            if isinstance(followed, _Split):
                return followed, None, None  # by rows: partial sums
            return None, None, followed
        if column is None:
            return None, None, None
        parts = _column_parts(graph, op, dims, column, tp)
        if parts is None:
            return None, None, _Why.SIZE
        return _Split(column, parts), Cut(dims[column].axis, parts), None
    why = None
    for k, tensor in enumerate(op.inputs):
        spec = cut.get(tensor)
        if spec is None:
            continue
        followed = _follow(graph, op, dims, k, spec, tp)
        if isinstance(followed, _Split):
            axis = dims[followed.dim].axis
            out = None if axis is None else Cut(axis, followed.degree, followed.first)
            return followed, out, None
        why = why or followed
    return None, None, why


def _linear(graph: Graph, op: Op, dims) -> tuple[int, int, int | None] | None:
    """(the batched operand, the reduction dim, the column dim or None) of a linear: a
    splittable partial-sum dim read by a batched operand and by one computed from
    weights alone, which a kept non-sample dim (the columns) reads and the batched
    operand does not."""
    nest = op.nest
    tensors = [graph.tensors[t] for t in op.inputs]
    for r in nest.partial_dims:
        if not dims[r].splittable or r in nest.free_dims:
            continue
        readers = [k for k, spec in enumerate(nest.inputs) if r in _dims_of(spec.axes)]
        batched = [k for k in readers if tensors[k].batched]
        weights = [k for k in readers if not tensors[k].batched]
        if len(batched) != 1 or len(weights) != 1:
            continue
        x, w = batched[0], weights[0]
        seen_x, seen_w = _dims_of(nest.inputs[x].axes), _dims_of(nest.inputs[w].axes)
        column = next(
            (
                i
                for i, d in enumerate(dims)
                if d.axis is not None
                and d.kind is not DimKind.SAMPLE
                and i in seen_w
                and i not in seen_x
            ),
            None,
        )
        return x, r, column
    return None


def _dims_of(axes) -> set[int]:
    found: set[int] = set()
    for m in axes:
        if isinstance(m, Affine):
            found.update(d for d, _ in m.terms)
        elif isinstance(m, Grouped):
            found.add(m.dim)
    return found


def _reads(nest, operand: int, axis: int) -> int | None:
    """The dim that reads ``axis`` of an operand one to one, if one does."""
    m = nest.inputs[operand].axes[axis]
    if isinstance(m, Affine) and len(m.terms) == 1 and m.terms[0][1] == 1:
        return m.terms[0][0]
    return None


def _follow(graph: Graph, op: Op, dims, operand: int, spec: Cut, tp: int) -> _Split | _Why:
    """The split of the dim that reads the cut axis of ``operand`` in the chunks it
    covers; why not, where none can."""
    nest = op.nest
    m = nest.inputs[operand].axes[spec.axis]
    if isinstance(m, Affine) and len(m.terms) == 1 and m.terms[0][1] == 1:
        d = m.terms[0][0]
    elif isinstance(m, Affine) and m.terms and m.offset == 0:
        d, coef = max(m.terms, key=lambda t: t[1])  # the outer dim of a split axis
    elif isinstance(m, Grouped):
        d = m.dim
    else:
        return _Why.NO_DIM
    soap = dims[d]
    if not soap.splittable or soap.kind is DimKind.SAMPLE:
        return _Why.NO_DIM
    size = graph.tensors[op.inputs[operand]].shape[spec.axis]
    if size % spec.parts:
        return _Why.SIZE
    chunk = size // spec.parts
    extent = nest.dims[d].size
    if isinstance(m, Grouped):
        if chunk % m.in_per_group or extent % (chunk // m.in_per_group * m.out_per_group):
            return _Why.SIZE
        degree, first = extent // (chunk // m.in_per_group * m.out_per_group), spec.first
    elif len(m.terms) == 1 and m.terms[0][1] == 1:
        if m.offset % chunk or extent % chunk:
            return _Why.SIZE
        degree, first = extent // chunk, (spec.first + m.offset // chunk) % tp
    else:
        if chunk % coef or coef * extent != size:
            return _Why.SIZE
        degree, first = spec.parts, spec.first
    if degree % tp or degree > soap.max_degree or (soap.size // degree) % soap.granule:
        return _Why.SIZE
    return _Split(d, degree, first)


def _column_parts(graph: Graph, op: Op, dims, column: int, tp: int) -> int | None:
    """``s * tp`` where the columns are read as ``s`` equal slices, else ``tp``; in
    uneven chunks where need be (GPT-2's 50,257 words: Megatron pads the vocabulary),
    which then only an op that needs no alignment can follow (the loss reads them whole)."""
    dim = dims[column]
    slices = _slices(graph, op.output, dim.axis, depth=4)
    for parts in ((slices * tp,) if slices > 1 else ()) + (tp,):
        if dim.size % parts == 0 and parts <= dim.max_degree:
            return parts
    return tp if tp <= dim.max_degree else None


def _slices(graph: Graph, tensor: str, axis: int, depth: int) -> int:
    """Into how many equal slices the readers of ``tensor`` cut ``axis``, followed through
    ops that pass it on whole (a reshape of the other axes, an elementwise op); 1 if
    they do not cut it so."""
    size = graph.tensors[tensor].shape[axis]
    found: set[tuple[int, int]] = set()
    for op in graph.ops:
        for k, name in enumerate(op.inputs):
            if name != tensor:
                continue
            d = _reads(op.nest, k, axis)
            if d is None:
                continue
            extent, offset = op.nest.dims[d].size, op.nest.inputs[k].axes[axis].offset
            if extent == size and offset == 0:
                out = op.nest.out_dims.index(d) if d in op.nest.out_dims else None
                if depth > 0 and out is not None:
                    inner = _slices(graph, op.output, out, depth - 1)
                    if inner > 1:
                        return inner
            elif extent < size:
                found.add((offset, extent))
    extents = {e for _, e in found}
    if len(extents) != 1:
        return 1
    extent = extents.pop()
    if size % extent or any(o % extent for o, _ in found) or len(found) != size // extent:
        return 1
    return size // extent


def _config(dims: Sequence[SoapDim], split: _Split, dp: int, tp: int) -> ParallelConfig:
    """The split over the node, and the samples over the nodes: the task of node ``j``
    and chunk ``c`` on device ``j * tp + (first + c) mod tp``."""
    degrees = [1] * len(dims)
    degrees[split.dim] = split.degree
    sample = next(
        (i for i, d in enumerate(dims) if d.kind is DimKind.SAMPLE and d.splittable), None
    )
    if sample is not None and sample != split.dim:
        degrees[sample] = min(dp, dims[sample].max_degree)
    devices = []
    for coord in task_coords(degrees):
        j = coord[sample] if sample is not None and sample != split.dim else 0
        devices.append(j * tp + (split.first + coord[split.dim]) % tp)
    return ParallelConfig(tuple(degrees), tuple(devices))


def sequence_split(
    dims: Sequence[SoapDim], devices: int, node: int, length: int | None = None
) -> ParallelConfig:
    """``_data_parallel`` with the sequence always split inside each node; ``length``:
    the sequence dim is the first splittable one of that size (attention's queries, not
    its heads), else the first kept non-sample dim."""
    return _data_parallel(dims, devices, node, True, length)


def _data_parallel(
    dims: Sequence[SoapDim],
    devices: int,
    tp: int = 1,
    sequence: bool = False,
    length: int | None = None,
) -> ParallelConfig:
    """Split by samples over every device; where there are fewer samples than devices
    (or ``sequence``: always), by samples over the nodes and inside each along its
    first other kept dim (the sequence) over the node's ``tp`` devices, as Megatron-LM's
    sequence parallelism (Korthikanti et al., 2022) cuts the LayerNorms and residual
    adds; without one (the loss) on the node's first device. Split by samples over all
    devices they all ran on the first node: a LLaMA-3-8B shape at 8 sequences on 64
    H100s held 135 GiB on its devices, 65 GiB on the others', and every node sent it its
    logits."""
    degrees = [1] * len(dims)
    # a loss's positions are sample dims too (``dims._label_dims``): the batch is the
    # sample dim not of the sequence's length
    sample = next(
        (
            i
            for i, d in enumerate(dims)
            if d.kind is DimKind.SAMPLE and d.splittable and d.size != length
        ),
        None,
    )
    # one sample (no sample dim splits) is fewer samples than devices too
    short = sequence or sample is None or dims[sample].max_degree < devices
    inner_kinds = (DimKind.ATTRIBUTE,) if length is None else (DimKind.ATTRIBUTE, DimKind.SAMPLE)
    if short and tp > 1:
        fitting = [
            i
            for i, d in enumerate(dims)
            if d.kind in inner_kinds
            and i != sample
            and d.splittable
            and tp <= d.max_degree
            and (d.size // tp) % d.granule == 0
        ]
        sized = [i for i in fitting if dims[i].size == length]
        inner = (sized or fitting or [None])[0]
        if inner is not None:
            return _config(dims, _Split(inner, tp), devices // tp, tp)
        enough = sample is not None and dims[sample].max_degree >= devices
        # else (the loss) by samples over the nodes, each node's on its first device,
        # where the rest of its samples' ops are; but where only ``sequence`` made it
        # short (samples enough for every device), by samples over all, as without it:
        # on each node's first device the loss of LLaMA-3-8B at 16 x 8,192 tokens took
        # the whole logits (bf16, and the kernel's float32) there, 141 GB beyond its peers
        if sample is None:
            return ParallelConfig(tuple(degrees), (0,))
        if not enough:
            degrees[sample] = min(devices // tp, dims[sample].max_degree)
            return ParallelConfig(tuple(degrees), tuple(j * tp for j in range(degrees[sample])))
    if sample is not None:
        degrees[sample] = min(devices, dims[sample].max_degree)
    return ParallelConfig(tuple(degrees), tuple(range(math.prod(degrees))))


def _task_coords(config: ParallelConfig) -> list[tuple[tuple[int, ...], int]]:
    """(grid coordinate, device) of every task of ``config``, its copies included."""
    coords = (c for c in task_coords(config.degrees) for _ in range(config.copies))
    return list(zip(coords, config.devices, strict=True))


def _like_consumer(
    graph: Graph,
    op: Op,
    space: Space,
    configs: Mapping[str, ParallelConfig],
    copies: bool = False,
) -> ParallelConfig:
    """An op computed from weights alone, cut along the axis its first consumer splits
    (other than by samples), on that consumer's devices for the chunks of its first
    tasks; whole on device 0 where no consumer splits it so. ``copies`` (a weight-only
    op, ``soap/copies.py``): each chunk computed on every device of the consumer's
    tasks that read it (the data-parallel replicas), as the whole op on every device
    of the consumer where it splits none, so that no reader gathers it each step."""
    dims = space[op.name]
    whole = ParallelConfig((1,) * len(dims), (0,))
    for consumer in graph.ops:
        if consumer.name not in configs or op.output not in consumer.inputs:
            continue
        k = consumer.inputs.index(op.output)
        config, cdims = configs[consumer.name], space[consumer.name]
        if copies:
            whole = _copied(dims, {(): [d for _, d in _task_coords(config)]}, 1, None) or whole
        for axis in range(len(graph.tensors[op.output].shape)):
            d = _reads(consumer.nest, k, axis)
            if d is None or config.degrees[d] == 1 or cdims[d].kind is DimKind.SAMPLE:
                continue
            mine = next((i for i, x in enumerate(dims) if x.axis == axis), None)
            degree = config.degrees[d]
            if mine is None or not dims[mine].splittable or degree > dims[mine].max_degree:
                continue
            if dims[mine].size != cdims[d].size:
                continue
            # the device of the consumer's first task with each chunk of the dim
            devices: dict[int, list[int]] = {}
            for coord, device in _task_coords(config):
                devices.setdefault(coord[d], []).append(device)
            degrees = tuple(degree if i == mine else 1 for i in range(len(dims)))
            if copies:
                copied = _copied(dims, devices, degree, mine)
                if copied is not None:
                    return copied
            return ParallelConfig(degrees, tuple(devices[c][0] for c in range(degree)))
        return whole
    return whole


def _copied(
    dims: Sequence[SoapDim], readers: Mapping, degree: int, mine: int | None
) -> ParallelConfig | None:
    """Chunk ``c`` of dim ``mine`` (in ``degree``; the whole op where None) copied on
    the distinct devices in ``readers[c]`` (``()`` the key for the whole op): None
    where the chunks' readers are not as many devices each, or only one."""
    held = [list(dict.fromkeys(readers[c])) for c in (range(degree) if mine is not None else [()])]
    r = len(held[0])
    if r < 2 or any(len(h) != r for h in held):
        return None
    degrees = tuple(degree if i == mine else 1 for i in range(len(dims)))
    return ParallelConfig(degrees, tuple(d for h in held for d in h), r)
