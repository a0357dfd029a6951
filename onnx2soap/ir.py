"""The graph the importer produces and everything downstream reads.

Every operator is described once, as a loop nest over named iteration dims with an access
map per operand axis. Dim kinds, splittability, FLOPs, task regions and halos are all
derived from this description (see ``onnx2soap.soap``); nothing downstream lists them by
op type.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any


class DType(Enum):
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    INT64 = "int64"

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 8

    @property
    def is_float(self) -> bool:
        return self is not DType.INT64


class TensorRole(Enum):
    INPUT = "input"  # a data input (float or int64 ids); its axis 0 is the batch
    LABELS = "labels"  # the loss's targets; axis 0 is the batch
    WEIGHT = "weight"  # trainable float initializer
    STATE = "state"  # float initializer an op's forward updates, never trained (BN stats)
    CONSTANT = "constant"  # float value fixed at load time: a folded constant, a 0-d initializer
    ACTIVATION = "activation"  # written by an op


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: DType
    role: TensorRole
    # Computed from a data input (or the labels): axis 0 started as the batch. Weights,
    # constants and what ops compute from them alone (an RNN's reordered gate weights)
    # have no batch axis.
    batched: bool = False
    # A constant repeated along axes (a causal mask at the bound batch): its distinct
    # values, what a device holds of it (0: every element is its own).
    distinct: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def held_numel(self) -> int:
        """Elements a device stores of it: a broadcast constant's distinct ones."""
        return self.distinct or self.numel


# --- access maps: how one operand axis is indexed by the iteration dims -----------------


@dataclass(frozen=True)
class Affine:
    """Operand index = sum(coef * dim) + offset, every coefficient positive.

    Identity is ``Affine(((d, 1),), 0)``; a convolution window is
    ``Affine(((out, stride), (kernel, dilation)), -pad_begin)``; the input of a Concat at
    offset ``o`` along the axis is ``Affine(((d, 1),), -o)``.
    """

    terms: tuple[tuple[int, int], ...]
    offset: int = 0

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.terms)

    @property
    def is_identity(self) -> bool:
        return len(self.terms) == 1 and self.terms[0][1] == 1 and self.offset == 0


@dataclass(frozen=True)
class Broadcast:
    """A size-1 operand axis read at index 0 whatever the dims (numpy broadcasting)."""


@dataclass(frozen=True)
class Whole:
    """The operand axis is read whole by every task.

    ``dims`` are the iteration dims the index depends on in a way no affine map
    expresses (a Reshape's merged axes, the channel group of a grouped Conv): splitting
    them would need global coordinates in the kernel, so they are never split.

    ``within``: (dim, stride) where the axis's values land, when they all land inside one
    iteration dim: a Reshape merging the axis behind an outer one ([T, N, E] to [T*N, E]
    puts N in the merged dim at stride 1). Only batch tracing reads it (``batch_dims``);
    the partition math reads the axis whole all the same.
    """

    dims: tuple[int, ...] = ()
    within: tuple[int, int] | None = None


@dataclass(frozen=True)
class Grouped:
    """Group-wise channels (a grouped convolution's input): iteration dim ``dim`` counts
    ``out_per_group`` values per group and the operand axis ``in_per_group``, so dim value
    ``c`` reads the operand's whole group ``c // out_per_group``. The dim is chunked in
    whole groups (its ``IterDim.granule``), so a task reads exactly its groups."""

    dim: int
    out_per_group: int
    in_per_group: int


AxisMap = Affine | Broadcast | Whole | Grouped


def identity(dim: int) -> Affine:
    return Affine(((dim, 1),), 0)


@dataclass(frozen=True)
class IterDim:
    """``granule``: a split cuts this dim only at multiples of it (whole groups)."""

    name: str
    size: int
    granule: int = 1

    @property
    def max_degree(self) -> int:
        return self.size // self.granule


@dataclass(frozen=True)
class BatchAt:
    """Where the batch lies in a tensor: along ``axis``, whose index is
    ``outer * (batch * stride) + sample * stride + inner`` with ``inner < stride``.

    A plain batch axis is ``BatchAt(axis)`` (stride 1, nothing outside it); merged with the
    heads behind it ([N*H, T, D], nn.MultiheadAttention's layout) the stride is H; merged
    behind the time steps ([T*N, E]) the stride is 1 and the time steps lie outside it.
    """

    axis: int
    stride: int = 1


def _carried(m: AxisMap, stride: int, batch: int, sizes: tuple[int, ...]) -> tuple[int, int] | None:
    """(dim, stride within it) of the iteration dim that carries a batch lying at ``stride``
    in an operand axis read through ``m``; None where no one dim holds it all."""
    if isinstance(m, Grouped):
        # axis index = group * in_per_group + within; the dim counts out_per_group per group
        if stride % m.in_per_group:
            return None  # the batch lies within the groups, which no dim indexes
        return m.dim, stride // m.in_per_group * m.out_per_group
    if isinstance(m, Whole) and m.within is not None:  # an inner axis of a merge
        dim, inner = m.within
        return dim, stride * inner
    if not isinstance(m, Affine) or not m.terms:
        return None
    if len(m.terms) == 1 and m.terms[0][1] == 1:
        return m.terms[0][0], stride  # a copy (a Concat's part, a Slice: offset and all)
    # A split axis: index = sum(coef * dim), each dim one digit of it.
    for d, coef in m.terms:
        if stride % coef == 0 and stride * batch <= coef * sizes[d]:
            return d, stride // coef
    return None


def batch_dims(
    nest: LoopNest, operands: Sequence[frozenset[BatchAt]], batch: int
) -> dict[int, int]:
    """Iteration dim -> the stride of the batch within it, for every dim that reads the
    batch of an operand (``operands[k]``: where it lies in operand k) through the access
    maps: wherever the batch has moved to (a transpose, a time-major layout, a merge with
    the heads or behind the time steps), not only axis 0. Those are the sample dims."""
    sizes = tuple(d.size for d in nest.dims)
    found: dict[int, int] = {}
    for operand, where in zip(nest.inputs, operands, strict=True):
        for at in where:
            if at.axis < len(operand.axes):
                hit = _carried(operand.axes[at.axis], at.stride, batch, sizes)
                if hit is not None:
                    found.setdefault(*hit)
    return found


def output_batch(nest: LoopNest, carried: dict[int, int]) -> frozenset[BatchAt]:
    """Where the batch lies in the output: the axes of the kept dims that carry it."""
    return frozenset(
        BatchAt(axis, carried[d]) for axis, d in enumerate(nest.out_dims) if d in carried
    )


class Binding(Enum):
    """How an op uses an operand that is a float initializer."""

    READ = "read"  # trainable (a weight)
    CONSTANT = "constant"  # read, never trained (BatchNorm's statistics in inference mode)
    STATE = "state"  # read and updated by the op's forward (running statistics)


@dataclass(frozen=True)
class Operand:
    """One input of a loop nest.

    ``pad_value`` is what a task's buffer holds where the access map reaches outside the
    tensor (0 for Conv, -inf for MaxPool). ``None`` means the buffer is clipped to the
    tensor instead: the map never reaches outside it, or (Concat) what lies outside is
    simply not this operand's part.
    """

    tensor: str
    axes: tuple[AxisMap, ...]
    pad_value: float | None = None
    binding: Binding = Binding.READ


@dataclass(frozen=True)
class LoopNest:
    """``output[out_dims] (+)= f(inputs)`` over the iteration space ``dims``.

    Output axis ``i`` is indexed by dim ``out_dims[i]`` (identity), or is a size-1 axis
    where the entry is None. Dims absent from ``out_dims`` are reductions.
    ``flops_per_point`` counts the forward FLOPs of one point of the iteration space.

    ``sync_dims`` are kept dims over which the op computes statistics (BatchNorm in
    training mode: the batch and spatial dims). They split like any kept dim, but the
    tasks that differ only in them then combine their partial statistics
    (``sync_values``: numbers per point of the other dims, forward and backward) before
    finishing, in each phase, so every split computes what one task would.
    """

    dims: tuple[IterDim, ...]
    inputs: tuple[Operand, ...]
    out_dims: tuple[int | None, ...]
    flops_per_point: int = 1
    sync_dims: tuple[int, ...] = ()
    sync_values: tuple[int, int] = (0, 0)
    # Reduction dims a plan may split all the same (an embedding's vocabulary): the tasks
    # that differ only in them compute partial outputs, which are summed; the first of
    # them owns the tile, and each gets the whole tile's gradient back.
    partial_dims: tuple[int, ...] = ()
    # Dims that do no work per point (a lookup's vocabulary: one row is read, not all):
    # FLOPs count the points of the other dims only.
    free_dims: tuple[int, ...] = ()
    # (queries, keys, block): a causal mask over two dims, query i seeing key j only
    # where j <= i (global indices, aligned at the top left). The kernel runs a task's
    # queries in blocks of ``block`` rows from its first, each block over every key up
    # to its last row's and none past it (``ops/flash.py``): only those (query, key)
    # pairs do work. None: every point does.
    causal: tuple[int, int, int] | None = None

    @property
    def points(self) -> int:
        return math.prod(d.size for d in self.dims)

    @property
    def flops(self) -> int:
        return self.work_points(tuple((0, d.size) for d in self.dims)) * self.flops_per_point

    def work_points(self, box) -> int:
        """The points of ``box`` that do work: all but ``free_dims``, and of the
        ``causal`` pair of dims only the pairs the kernel computes."""
        if self.causal is None:
            return math.prod(hi - lo for i, (lo, hi) in enumerate(box) if i not in self.free_dims)
        rows, keys, block = self.causal
        rest = math.prod(
            hi - lo
            for i, (lo, hi) in enumerate(box)
            if i not in self.free_dims and i != rows and i != keys
        )
        return rest * LoopNest.causal_pairs(box[rows], box[keys], block)

    @staticmethod
    def causal_pairs(rows: tuple[int, int], keys: tuple[int, int], block: int) -> int:
        """The (query, key) pairs computed for the queries ``rows`` and keys ``keys``
        (half-open global intervals): each block of ``block`` queries from ``rows[0]``
        reads the keys of ``keys`` below its last query's index plus one."""
        (lo, hi), (k0, k1) = rows, keys
        if hi <= lo or k1 <= k0:
            return 0
        full, tail = divmod(hi - lo, block)
        if k0 == 0 and k1 >= hi:  # no block's keys clipped: blocks j = 1..full end at lo + jb
            return block * full * lo + block * block * full * (full + 1) // 2 + tail * hi
        pairs = 0
        for start in range(lo, hi, block):
            end = min(hi, start + block)
            pairs += (end - start) * max(0, min(k1, end) - k0)
        return pairs

    def dim_index(self, name: str) -> int:
        for i, d in enumerate(self.dims):
            if d.name == name:
                return i
        raise KeyError(name)


@dataclass(frozen=True)
class Op:
    """One compute op. ``inputs`` are the operand tensors, in the order of ``nest.inputs``;
    everything op-specific (attributes, kernels) belongs to its definition."""

    name: str
    type: str  # the name of its definition in ``onnx2soap.ops`` (the ONNX op type)
    inputs: tuple[str, ...]
    output: str
    attrs: Any  # a frozen dataclass of the op's definition
    nest: LoopNest
    is_loss: bool = False  # a scalar loss: sample dim split, partial losses summed
    # The output's dtype where the op decides it (a Cast of ids to float); None: the
    # first float input's, else the first input's.
    dtype: DType | None = None


class LossKind(Enum):
    CROSS_ENTROPY = "cross-entropy"
    MSE = "mse"
    NONE = "none"
    MODEL = "model"  # the ONNX graph computes its own loss


@dataclass(frozen=True)
class Graph:
    """A training graph: ops in topological order, the loss op (if any) last."""

    name: str
    tensors: dict[str, Tensor]
    ops: tuple[Op, ...]
    inputs: tuple[str, ...]  # the data inputs, in the ONNX graph's order
    output: str
    labels: str | None
    loss: LossKind
    batch: int

    @property
    def input(self) -> str:
        """The first data input (the only one of most vision models)."""
        return self.inputs[0]

    def differentiable(self, tensor: str) -> bool:
        """Whether a gradient flows through ``tensor``: float tensors only (token ids and
        masks computed from them take none)."""
        return self.tensors[tensor].dtype.is_float

    @property
    def loss_op(self) -> Op | None:
        return self.ops[-1] if self.ops and self.ops[-1].is_loss else None

    def producer(self, tensor: str) -> Op | None:
        for op in self.ops:
            if op.output == tensor:
                return op
        return None

    @property
    def weights(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors.values() if t.role is TensorRole.WEIGHT)

    @property
    def states(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors.values() if t.role is TensorRole.STATE)

    @property
    def constants(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors.values() if t.role is TensorRole.CONSTANT)
