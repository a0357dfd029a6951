"""One converter per ONNX op type: node + static shapes -> ``Op`` with its loop nest.

Each converter takes the node's attributes as keyword arguments with the ONNX spec's
defaults, so an attribute the spec does not know is refused by Python itself and reported
with the node's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from onnx2soap.errors import ModelError
from onnx2soap.ir import (
    Affine,
    AxisMap,
    Broadcast,
    ConcatAttrs,
    ConvAttrs,
    GemmAttrs,
    IterDim,
    LoopNest,
    LossAttrs,
    LossReduction,
    NoAttrs,
    Op,
    Operand,
    OpType,
    PoolAttrs,
    PoolKind,
    ReduceAttrs,
    Tensor,
    TensorRole,
    Whole,
    identity,
)


@dataclass(frozen=True)
class NodeContext:
    """What a converter sees of one node. ``inputs[i]`` is None for an omitted optional
    input or one that is a folded constant (its value is then in ``constants[i]``).

    Converters compute the output shape from the op's definition (ONNX shape inference is
    only a cross-check: before opset 22 it keeps ceil_mode pooling windows that start in
    the end padding, which onnxruntime and PyTorch drop)."""

    name: str
    op_type: str
    inputs: tuple[Tensor | None, ...]
    constants: tuple[np.ndarray | None, ...]
    output: str

    def fail(self, what: str) -> ModelError:
        return ModelError(f"node '{self.name}' ({self.op_type}): {what}")

    def tensor(self, i: int) -> Tensor:
        t = self.optional(i)
        if t is None:
            raise self.fail(f"input {i} must be a tensor computed at run time or a weight")
        return t

    def optional(self, i: int) -> Tensor | None:
        """Input ``i``, or None if it is omitted. A given input that is a folded constant
        (a Constant node) is refused: dropping it would compute something else."""
        if i < len(self.constants) and self.constants[i] is not None:
            raise self.fail(
                f"input {i} is a constant (a Constant node or a folded expression); only "
                "weights (float initializers) and computed tensors are supported there"
            )
        return self.inputs[i] if i < len(self.inputs) else None

    def constant(self, i: int) -> np.ndarray:
        c = self.constants[i] if i < len(self.constants) else None
        if c is None:
            raise self.fail(f"input {i} must be a constant known when the model is loaded")
        return c


def axis_names(rank: int) -> tuple[str, ...]:
    names = {
        0: (),
        1: ("n",),
        2: ("n", "f"),
        3: ("n", "c", "l"),
        4: ("n", "c", "h", "w"),
        5: ("n", "c", "d", "h", "w"),
    }
    return names.get(rank, ("n", *(f"a{i}" for i in range(1, rank))))


def _spatial_names(count: int) -> tuple[str, ...]:
    return axis_names(count + 2)[2:]


def _make_op(ctx: NodeContext, op_type: OpType, operands, attrs, dims, out_dims, fpp) -> Op:
    nest = LoopNest(
        dims=tuple(IterDim(n, s) for n, s in dims),
        inputs=tuple(operands),
        out_dims=tuple(out_dims),
        flops_per_point=fpp,
    )
    return Op(
        name=ctx.name,
        type=op_type,
        inputs=tuple(o.tensor for o in operands),
        output=ctx.output,
        attrs=attrs,
        nest=nest,
    )


def output_tensor(op: Op, tensors: dict[str, Tensor]) -> Tensor:
    """The op's output, its shape from the loop nest, its dtype the first float input's."""
    shape = tuple(1 if d is None else op.nest.dims[d].size for d in op.nest.out_dims)
    dtype = next(tensors[t].dtype for t in op.inputs if tensors[t].dtype.is_float)
    return Tensor(op.output, shape, dtype, TensorRole.ACTIVATION)


# --- elementwise ------------------------------------------------------------------------


def _broadcast_operand(t: Tensor, out_shape: tuple[int, ...]) -> Operand:
    """numpy-style multidirectional broadcasting: align right, size-1 axes broadcast."""
    lead = len(out_shape) - len(t.shape)
    axes: list[AxisMap] = []
    for i, size in enumerate(t.shape):
        d = lead + i
        axes.append(Broadcast() if size == 1 and out_shape[d] != 1 else identity(d))
    return Operand(t.name, tuple(axes))


def _broadcast_shape(ctx: NodeContext, operands: list[Tensor]) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in np.broadcast_shapes(*(t.shape for t in operands)))
    except ValueError as e:
        shapes = [list(t.shape) for t in operands]
        raise ctx.fail(f"shapes {shapes} do not broadcast") from e


def _elementwise(ctx: NodeContext, op_type: OpType, operands: list[Tensor], fpp: int) -> Op:
    shape = _broadcast_shape(ctx, operands)
    dims = list(zip(axis_names(len(shape)), shape, strict=True))
    ops = [_broadcast_operand(t, shape) for t in operands]
    return _make_op(ctx, op_type, ops, NoAttrs(), dims, range(len(shape)), fpp)


def add(ctx: NodeContext) -> Op:
    return _elementwise(ctx, OpType.ADD, [ctx.tensor(0), ctx.tensor(1)], 1)


def relu(ctx: NodeContext) -> Op:
    return _elementwise(ctx, OpType.RELU, [ctx.tensor(0)], 1)


def identity_op(ctx: NodeContext) -> Op:
    return _elementwise(ctx, OpType.IDENTITY, [ctx.tensor(0)], 0)


# --- matrix products ----------------------------------------------------------------------


def gemm(ctx: NodeContext, *, alpha=1.0, beta=1.0, transA=0, transB=0) -> Op:
    a, b, c = ctx.tensor(0), ctx.tensor(1), ctx.optional(2)
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise ctx.fail(f"A and B must be 2-D, got {list(a.shape)} and {list(b.shape)}")
    m, k = a.shape[::-1] if transA else a.shape
    kb, n = b.shape[::-1] if transB else b.shape
    if k != kb:
        raise ctx.fail(f"A' {[m, k]} and B' {[kb, n]} do not multiply")
    N, CO, CI = 0, 1, 2  # dims: rows (n), output features (co), reduction (ci)
    a_axes = (identity(CI), identity(N)) if transA else (identity(N), identity(CI))
    b_axes = (identity(CO), identity(CI)) if transB else (identity(CI), identity(CO))
    operands = [Operand(a.name, a_axes), Operand(b.name, b_axes)]
    if c is not None:
        operands.append(_broadcast_operand(c, (m, n)))
    attrs = GemmAttrs(float(alpha), float(beta), bool(transA), bool(transB))
    dims = [("n", m), ("co", n), ("ci", k)]
    return _make_op(ctx, OpType.GEMM, operands, attrs, dims, (N, CO), 2)


def matmul(ctx: NodeContext) -> Op:
    a, b = ctx.tensor(0), ctx.tensor(1)
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise ctx.fail(
            f"both operands must have rank >= 2 (got {list(a.shape)} and {list(b.shape)})"
        )
    if a.shape[-1] != b.shape[-2]:
        raise ctx.fail(f"{list(a.shape)} @ {list(b.shape)}: inner dims differ")
    batch = _broadcast_shape(
        ctx,
        [Tensor("a", a.shape[:-2], a.dtype, a.role), Tensor("b", b.shape[:-2], b.dtype, b.role)],
    )
    out = (*batch, a.shape[-2], b.shape[-1])
    nb = len(out) - 2
    batch_names = ("n", *(f"b{i}" for i in range(1, nb)))[:nb]
    row_name = "m" if nb else "n"
    dims = [*zip(batch_names, out[:nb], strict=True), (row_name, out[-2]), ("co", out[-1])]
    dims.append(("ci", a.shape[-1]))
    M, CO, CI = nb, nb + 1, nb + 2

    def batch_axes(t: Tensor) -> list[AxisMap]:
        lead = nb - (len(t.shape) - 2)
        return [
            Broadcast() if size == 1 and out[lead + i] != 1 else identity(lead + i)
            for i, size in enumerate(t.shape[:-2])
        ]

    operands = [
        Operand(a.name, (*batch_axes(a), identity(M), identity(CI))),
        Operand(b.name, (*batch_axes(b), identity(CI), identity(CO))),
    ]
    return _make_op(ctx, OpType.MATMUL, operands, NoAttrs(), dims, range(nb + 2), 2)


# --- convolution and pooling ------------------------------------------------------------------


def _resolve_pads(ctx, auto_pad, pads, in_sizes, kernel, strides, dilations):
    rank = len(in_sizes)
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("NOTSET", ""):
        pads = tuple(pads) if pads is not None else (0,) * (2 * rank)
        if len(pads) != 2 * rank:
            raise ctx.fail(f"pads must have {2 * rank} entries, got {list(pads)}")
        return pads[:rank], pads[rank:]
    if auto_pad == "VALID":
        return (0,) * rank, (0,) * rank
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise ctx.fail(f"auto_pad '{auto_pad}' is not one of NOTSET, VALID, SAME_UPPER, SAME_LOWER")
    begin, end = [], []
    for size, k, s, d in zip(in_sizes, kernel, strides, dilations, strict=True):
        out = -(-size // s)
        total = max(0, (out - 1) * s + d * (k - 1) + 1 - size)
        small, big = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else big)
        end.append(big if auto_pad == "SAME_UPPER" else small)
    return tuple(begin), tuple(end)


def _window_outputs(ctx, sizes, kernel, strides, dilations, pb, pe, ceil_mode) -> tuple[int, ...]:
    """Output sizes of a sliding window (ONNX Conv/pool, PyTorch's ceil_mode rule: a last
    window that would start in the end padding is dropped)."""
    out = []
    for size, k, s, d, b, e in zip(sizes, kernel, strides, dilations, pb, pe, strict=True):
        span = size + b + e - d * (k - 1) - 1
        if span < 0:
            raise ctx.fail(f"the window ({k} with dilation {d}) is larger than the padded input")
        n = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (n - 1) * s >= size + b:
            n -= 1
        out.append(n)
    return tuple(out)


def _window_axes(first_out: int, first_kernel: int, strides, dilations, pads_begin):
    return tuple(
        Affine(((first_out + i, s), (first_kernel + i, d)), -p)
        for i, (s, d, p) in enumerate(zip(strides, dilations, pads_begin, strict=True))
    )


def conv(
    ctx: NodeContext,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    pads=None,
    strides=None,
) -> Op:
    x, w, b = ctx.tensor(0), ctx.tensor(1), ctx.optional(2)
    rank = len(x.shape) - 2
    if rank < 1 or len(w.shape) != rank + 2:
        raise ctx.fail(f"X {list(x.shape)} and W {list(w.shape)} are not a valid Conv pair")
    kernel = tuple(kernel_shape) if kernel_shape is not None else w.shape[2:]
    if tuple(kernel) != tuple(w.shape[2:]):
        raise ctx.fail(f"kernel_shape {list(kernel)} disagrees with W {list(w.shape)}")
    strides = tuple(strides) if strides is not None else (1,) * rank
    dilations = tuple(dilations) if dilations is not None else (1,) * rank
    pb, pe = _resolve_pads(ctx, auto_pad, pads, x.shape[2:], kernel, strides, dilations)
    co, ci = w.shape[0], w.shape[1]
    if x.shape[1] != ci * group or co % group:
        raise ctx.fail(f"channels of X {list(x.shape)} and W {list(w.shape)} vs group {group}")
    out_sp = _window_outputs(ctx, x.shape[2:], kernel, strides, dilations, pb, pe, False)
    names = _spatial_names(rank)
    # dims: n, co, spatial outputs..., ci, kernel positions...
    dims = [("n", x.shape[0]), ("co", co), *zip(names, out_sp, strict=True), ("ci", ci)]
    dims += [(f"k{n}", k) for n, k in zip(names, kernel, strict=True)]
    CI, K0 = 2 + rank, 3 + rank
    # Grouped convolutions read a channel range that depends on the output channel's
    # group: not an affine map, so every task reads all input channels.
    channel: AxisMap = identity(CI) if group == 1 else Whole(dims=(1,))
    x_axes = (identity(0), channel, *_window_axes(2, K0, strides, dilations, pb))
    w_axes = (identity(1), identity(CI), *(identity(K0 + i) for i in range(rank)))
    operands = [Operand(x.name, x_axes, pad_value=0.0), Operand(w.name, w_axes)]
    if b is not None:
        operands.append(Operand(b.name, (identity(1),)))
    attrs = ConvAttrs(kernel, strides, dilations, pb, pe, group)
    return _make_op(ctx, OpType.CONV, operands, attrs, dims, range(2 + rank), 2)


def _pool(ctx, kind, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, include):
    x = ctx.tensor(0)
    rank = len(x.shape) - 2
    if kernel_shape is None or len(kernel_shape) != rank:
        raise ctx.fail(f"kernel_shape must have {rank} entries for input {list(x.shape)}")
    kernel = tuple(kernel_shape)
    strides = tuple(strides) if strides is not None else (1,) * rank
    dilations = tuple(dilations) if dilations is not None else (1,) * rank
    pb, pe = _resolve_pads(ctx, auto_pad, pads, x.shape[2:], kernel, strides, dilations)
    if any(p >= k for p, k in zip((*pb, *pe), kernel * 2, strict=True)):
        raise ctx.fail(f"pads {[*pb, *pe]} must be smaller than kernel_shape {list(kernel)}")
    out_sp = _window_outputs(ctx, x.shape[2:], kernel, strides, dilations, pb, pe, ceil_mode)
    names = _spatial_names(rank)
    dims = [("n", x.shape[0]), ("c", x.shape[1]), *zip(names, out_sp, strict=True)]
    dims += [(f"k{n}", k) for n, k in zip(names, kernel, strict=True)]
    K0 = 2 + rank
    x_axes = (identity(0), identity(1), *_window_axes(2, K0, strides, dilations, pb))
    pad_value = float("-inf") if kind is PoolKind.MAX else 0.0
    attrs = PoolAttrs(kind, kernel, strides, dilations, pb, pe, bool(ceil_mode), bool(include))
    op_type = OpType.MAXPOOL if kind is PoolKind.MAX else OpType.AVERAGEPOOL
    operands = [Operand(x.name, x_axes, pad_value=pad_value)]
    return _make_op(ctx, op_type, operands, attrs, dims, range(2 + rank), 1)


def maxpool(
    ctx: NodeContext,
    *,
    auto_pad="NOTSET",
    ceil_mode=0,
    dilations=None,
    kernel_shape=None,
    pads=None,
    storage_order=0,
    strides=None,
) -> Op:
    del storage_order  # only affects the Indices output, which is refused
    return _pool(ctx, PoolKind.MAX, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, 0)


def averagepool(
    ctx: NodeContext,
    *,
    auto_pad="NOTSET",
    ceil_mode=0,
    count_include_pad=0,
    dilations=None,
    kernel_shape=None,
    pads=None,
    strides=None,
) -> Op:
    return _pool(
        ctx,
        PoolKind.AVERAGE,
        kernel_shape,
        strides,
        dilations,
        pads,
        auto_pad,
        ceil_mode,
        count_include_pad,
    )


def globalaveragepool(ctx: NodeContext) -> Op:
    x = ctx.tensor(0)
    rank = len(x.shape) - 2
    names = _spatial_names(rank)
    dims = [("n", x.shape[0]), ("c", x.shape[1]), *zip(names, x.shape[2:], strict=True)]
    operands = [Operand(x.name, tuple(identity(i) for i in range(len(x.shape))))]
    out_dims = (0, 1, *([None] * rank))
    return _make_op(ctx, OpType.GLOBALAVERAGEPOOL, operands, NoAttrs(), dims, out_dims, 1)


# --- layout -----------------------------------------------------------------------------


def _batch_preserving(ctx: NodeContext, op_type: OpType, out: tuple[int, ...], detail: str) -> Op:
    x = ctx.tensor(0)
    if not out or out[0] != x.shape[0]:
        raise ctx.fail(
            f"only batch-preserving reshapes are supported: input {list(x.shape)} becomes "
            f"{list(out)}{detail}"
        )
    dims = [("n", out[0]), *((f"r{i}", s) for i, s in enumerate(out[1:], start=1))]
    # Samples keep their identity; everything else is re-laid out within a sample, so
    # a task reads whole samples.
    merged = tuple(range(1, len(out)))
    axes = (identity(0), *(Whole(dims=merged) for _ in x.shape[1:]))
    return _make_op(ctx, op_type, [Operand(x.name, axes)], NoAttrs(), dims, range(len(out)), 0)


def flatten(ctx: NodeContext, *, axis=1) -> Op:
    if axis != 1:
        raise ctx.fail(f"axis={axis} merges or splits the batch axis; only axis=1 is supported")
    x = ctx.tensor(0)
    return _batch_preserving(ctx, OpType.FLATTEN, (x.shape[0], math.prod(x.shape[1:])), "")


def _reshaped(ctx: NodeContext, source: tuple[int, ...], shape: list[int], allowzero: int):
    out = [source[i] if s == 0 and not allowzero else s for i, s in enumerate(shape)]
    if out.count(-1) > 1 or any(s < -1 for s in out):
        raise ctx.fail(f"shape {shape} is not a valid Reshape target")
    known = math.prod(s for s in out if s != -1)
    if -1 in out:
        if known == 0 or math.prod(source) % known:
            raise ctx.fail(f"cannot reshape {list(source)} to {shape}")
        out[out.index(-1)] = math.prod(source) // known
    if math.prod(out) != math.prod(source):
        raise ctx.fail(f"cannot reshape {list(source)} ({math.prod(source)} elements) to {shape}")
    return tuple(out)


def reshape(ctx: NodeContext, *, allowzero=0) -> Op:
    shape = [int(s) for s in ctx.constant(1)]
    detail = ""
    if shape and shape[0] not in (0, -1):
        detail = (
            f" (its shape input {shape} fixes the batch at {shape[0]}: export with a dynamic "
            f"batch axis, or plan with --batch {shape[0]})"
        )
    out = _reshaped(ctx, ctx.tensor(0).shape, shape, allowzero)
    return _batch_preserving(ctx, OpType.RESHAPE, out, detail)


def concat(ctx: NodeContext, *, axis) -> Op:
    parts = [ctx.tensor(i) for i in range(len(ctx.inputs))]
    rank = len(parts[0].shape)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank or any(
        len(t.shape) != rank
        or t.shape[:axis] + t.shape[axis + 1 :]
        != parts[0].shape[:axis] + parts[0].shape[axis + 1 :]
        for t in parts
    ):
        raise ctx.fail(f"inputs {[list(t.shape) for t in parts]} cannot be joined on axis {axis}")
    out = list(parts[0].shape)
    out[axis] = sum(t.shape[axis] for t in parts)
    if axis == 0:
        raise ctx.fail("concatenation along the batch axis is not supported")
    dims = list(zip(axis_names(len(out)), out, strict=True))
    operands, offset = [], 0
    for t in parts:
        axes = tuple(
            Affine(((i, 1),), -offset) if i == axis else identity(i) for i in range(len(out))
        )
        operands.append(Operand(t.name, axes))
        offset += t.shape[axis]
    return _make_op(ctx, OpType.CONCAT, operands, ConcatAttrs(axis), dims, range(len(out)), 0)


def reducemean(ctx: NodeContext, *, axes=None, keepdims=1, noop_with_empty_axes=0) -> Op:
    x = ctx.tensor(0)
    rank = len(x.shape)
    if axes is None and len(ctx.inputs) > 1 and ctx.constants[1] is not None:
        axes = [int(a) for a in ctx.constant(1)]  # opset 18 moved axes to an input
    if not axes:
        if noop_with_empty_axes:
            return _elementwise(ctx, OpType.IDENTITY, [x], 0)
        axes = list(range(rank))
    reduced = tuple(sorted({a + rank if a < 0 else a for a in axes}))
    if any(not 0 <= a < rank for a in reduced):
        raise ctx.fail(f"axes {list(axes)} out of range for rank {rank}")
    if 0 in reduced:
        raise ctx.fail("reducing over the batch axis (axis 0) is not supported")
    dims = list(zip(axis_names(rank), x.shape, strict=True))
    out_dims = [None if a in reduced else a for a in range(rank) if keepdims or a not in reduced]
    operands = [Operand(x.name, tuple(identity(i) for i in range(rank)))]
    attrs = ReduceAttrs(reduced, bool(keepdims))
    return _make_op(ctx, OpType.REDUCE_MEAN, operands, attrs, dims, out_dims, 1)


# --- loss -------------------------------------------------------------------------------


def softmaxcrossentropyloss(ctx: NodeContext, *, ignore_index=None, reduction="mean") -> Op:
    scores, labels = ctx.tensor(0), ctx.tensor(1)
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if ctx.optional(2) is not None:
        raise ctx.fail("class weights (input 2) are not supported")
    if reduction not in ("mean", "sum"):
        raise ctx.fail(f"reduction '{reduction}' is not supported (use mean or sum)")
    if len(scores.shape) != 2 or labels.shape != scores.shape[:1]:
        raise ctx.fail(
            f"scores must be [N, C] and labels [N]; got {list(scores.shape)} and "
            f"{list(labels.shape)}"
        )
    return cross_entropy_op(ctx, scores, labels, LossAttrs(LossReduction(reduction), ignore_index))


def cross_entropy_op(ctx: NodeContext, scores: Tensor, labels: Tensor, attrs: LossAttrs) -> Op:
    dims = [("n", scores.shape[0]), ("c", scores.shape[1])]
    operands = [
        Operand(scores.name, (identity(0), identity(1))),
        Operand(labels.name, (identity(0),)),
    ]
    return _make_op(ctx, OpType.SOFTMAX_CROSS_ENTROPY, operands, attrs, dims, (), 4)


def mse_op(ctx: NodeContext, pred: Tensor, target: Tensor) -> Op:
    dims = list(zip(axis_names(len(pred.shape)), pred.shape, strict=True))
    axes = tuple(identity(i) for i in range(len(pred.shape)))
    operands = [Operand(pred.name, axes), Operand(target.name, axes)]
    return _make_op(ctx, OpType.MSE_LOSS, operands, LossAttrs(), dims, (), 3)


Converter = Callable[..., Op]

CONVERTERS: dict[str, Converter] = {
    "Add": add,
    "AveragePool": averagepool,
    "Concat": concat,
    "Conv": conv,
    "Flatten": flatten,
    "Gemm": gemm,
    "GlobalAveragePool": globalaveragepool,
    "Identity": identity_op,
    "MatMul": matmul,
    "MaxPool": maxpool,
    "Relu": relu,
    "ReduceMean": reducemean,
    "Reshape": reshape,
    "SoftmaxCrossEntropyLoss": softmaxcrossentropyloss,
}
