"""Hand-built loop nests, ops and graphs for the SOAP tests (no ONNX involved).

The window ops follow the converters' encoding: a spatial input axis is
``Affine(((out_dim, stride), (kernel_dim, dilation)), -pad_begin)`` with a pad value; a
Concat input is ``Affine(((d, 1),), -offset)`` with no pad value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from onnx2soap.ir import (
    Affine,
    AxisMap,
    DType,
    Graph,
    IterDim,
    LoopNest,
    LossKind,
    Op,
    Operand,
    Tensor,
    TensorRole,
    Whole,
    identity,
)
from onnx2soap.ops.base import NoAttrs
from onnx2soap.ops.defs.concat import ConcatAttrs
from onnx2soap.ops.defs.losses import LossAttrs
from onnx2soap.soap.partition import ParallelConfig, Rect

# --- window geometry ----------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """One spatial axis of a Conv/pool: input size and the window's parameters."""

    size: int
    kernel: int
    stride: int = 1
    dilation: int = 1
    pad_begin: int = 0
    pad_end: int = 0
    ceil_mode: bool = False

    @property
    def span(self) -> int:
        return self.size + self.pad_begin + self.pad_end - self.dilation * (self.kernel - 1) - 1

    @property
    def out(self) -> int:
        """ONNX's output size; with ceil_mode, PyTorch's rule that the last window must
        start inside input + pad_begin."""
        if self.ceil_mode:
            out = -(-self.span // self.stride) + 1
            if (out - 1) * self.stride >= self.size + self.pad_begin:
                out -= 1
            return out
        return self.span // self.stride + 1

    def touched(self, outs: range) -> list[int]:
        """Every input index the windows of the outputs ``outs`` read (brute force)."""
        return [
            o * self.stride + k * self.dilation - self.pad_begin
            for o in outs
            for k in range(self.kernel)
        ]


@st.composite
def windows(draw, max_size: int = 12, size: int | None = None) -> Window:
    """A window (over an input of ``size``, or a random one up to ``max_size``) whose
    padded input holds at least one window."""
    if size is None:
        size = draw(st.integers(1, max_size))
    kernel = draw(st.integers(1, 4))
    stride = draw(st.integers(1, 5))
    dilation = draw(st.integers(1, 3))
    pad_begin = draw(st.integers(0, 4))
    pad_end = draw(st.integers(0, 4))
    ceil_mode = draw(st.booleans())
    w = Window(size, kernel, stride, dilation, pad_begin, pad_end, ceil_mode)
    if w.span < 0:
        # widen the padding until one window fits
        w = Window(size, kernel, stride, dilation, pad_begin, pad_end - w.span, ceil_mode)
    return w


def _window_axes(first_out: int, first_kernel: int, wins: Sequence[Window]) -> tuple:
    return tuple(
        Affine(((first_out + i, w.stride), (first_kernel + i, w.dilation)), -w.pad_begin)
        for i, w in enumerate(wins)
    )


def _spatial(count: int) -> tuple[str, ...]:
    return ("h", "w", "d")[:count] if count > 1 else ("l",)


def pool_op(
    name: str,
    x: str,
    out: str,
    batch: int,
    channels: int,
    wins: Sequence[Window],
    pad_value: float = float("-inf"),
) -> Op:
    """MaxPool-like: dims n, c, spatial outputs..., kernel positions...; kernels reduce."""
    r = len(wins)
    names = _spatial(r)
    dims = [IterDim("n", batch), IterDim("c", channels)]
    dims += [IterDim(n, w.out) for n, w in zip(names, wins, strict=True)]
    dims += [IterDim(f"k{n}", w.kernel) for n, w in zip(names, wins, strict=True)]
    axes = (identity(0), identity(1), *_window_axes(2, 2 + r, wins))
    nest = LoopNest(tuple(dims), (Operand(x, axes, pad_value),), tuple(range(2 + r)))
    return Op(name, "MaxPool", (x,), out, NoAttrs(), nest)


def conv_op(
    name: str,
    x: str,
    weight: str,
    bias: str | None,
    out: str,
    batch: int,
    c_in: int,
    c_out: int,
    wins: Sequence[Window],
) -> Op:
    """Conv-like: dims n, co, spatial outputs..., ci, kernel positions...; W[co, ci, k...]."""
    r = len(wins)
    names = _spatial(r)
    dims = [IterDim("n", batch), IterDim("co", c_out)]
    dims += [IterDim(n, w.out) for n, w in zip(names, wins, strict=True)]
    dims += [IterDim("ci", c_in)]
    dims += [IterDim(f"k{n}", w.kernel) for n, w in zip(names, wins, strict=True)]
    ci, k0 = 2 + r, 3 + r
    x_axes = (identity(0), identity(ci), *_window_axes(2, k0, wins))
    w_axes = (identity(1), identity(ci), *(identity(k0 + i) for i in range(r)))
    operands = [Operand(x, x_axes, 0.0), Operand(weight, w_axes)]
    if bias is not None:
        operands.append(Operand(bias, (identity(1),)))
    nest = LoopNest(tuple(dims), tuple(operands), tuple(range(2 + r)), 2)
    return Op(name, "Conv", tuple(o.tensor for o in operands), out, NoAttrs(), nest)


def conv_shapes(batch: int, c_in: int, c_out: int, wins: Sequence[Window]) -> dict[str, tuple]:
    """Shapes of a conv_op's x, weight, bias and output."""
    return {
        "x": (batch, c_in, *(w.size for w in wins)),
        "weight": (c_out, c_in, *(w.kernel for w in wins)),
        "bias": (c_out,),
        "out": (batch, c_out, *(w.out for w in wins)),
    }


# --- other op families ----------------------------------------------------------------------

AXIS_NAMES = ("n", "c", "l", "h", "w")


def elementwise_op(name: str, inputs: Sequence[str], out: str, shape: Sequence[int]) -> Op:
    """Relu/Add-like: one dim per axis, every input read identically."""
    dims = tuple(IterDim(AXIS_NAMES[i], s) for i, s in enumerate(shape))
    axes = tuple(identity(i) for i in range(len(shape)))
    operands = tuple(Operand(t, axes) for t in inputs)
    nest = LoopNest(dims, operands, tuple(range(len(shape))))
    op_type = "Relu" if len(inputs) == 1 else "Add"
    return Op(name, op_type, tuple(inputs), out, NoAttrs(), nest)


def gemm_op(name: str, x: str, weight: str, bias: str | None, out: str, n: int, ci: int, co: int):
    """Gemm-like: X[n, ci] @ W[ci, co] + b[co]; dims n, co, ci (ci reduces)."""
    dims = (IterDim("n", n), IterDim("co", co), IterDim("ci", ci))
    operands = [Operand(x, (identity(0), identity(2))), Operand(weight, (identity(2), identity(1)))]
    if bias is not None:
        operands.append(Operand(bias, (identity(1),)))
    nest = LoopNest(dims, tuple(operands), (0, 1), 2)
    return Op(name, "Gemm", tuple(o.tensor for o in operands), out, NoAttrs(), nest)


def concat_op(name: str, parts: Sequence[tuple[str, Sequence[int]]], out: str, axis: int) -> Op:
    """Concat of ``parts`` (tensor, shape) along ``axis``: input i at offset o is read as
    ``Affine(((axis, 1),), -o)`` with no pad value."""
    shape = list(parts[0][1])
    shape[axis] = sum(s[axis] for _, s in parts)
    dims = tuple(IterDim(AXIS_NAMES[i], s) for i, s in enumerate(shape))
    operands, offset = [], 0
    for tensor, s in parts:
        axes: tuple[AxisMap, ...] = tuple(
            Affine(((i, 1),), -offset) if i == axis else identity(i) for i in range(len(shape))
        )
        operands.append(Operand(tensor, axes))
        offset += s[axis]
    nest = LoopNest(dims, tuple(operands), tuple(range(len(shape))))
    return Op(name, "Concat", tuple(t for t, _ in parts), out, ConcatAttrs(axis), nest)


def flatten_op(name: str, x: str, x_shape: Sequence[int], out: str) -> Op:
    """Flatten-like: [n, ...] -> [n, prod(...)]; the merged axes are read Whole(dims=(1,))."""
    dims = (IterDim("n", x_shape[0]), IterDim("r1", math.prod(x_shape[1:])))
    axes = (identity(0), *(Whole(dims=(1,)) for _ in x_shape[1:]))
    nest = LoopNest(dims, (Operand(x, axes),), (0, 1), 0)
    return Op(name, "Flatten", (x,), out, NoAttrs(), nest)


def transpose_op(name: str, x: str, out: str, rows: int, cols: int) -> Op:
    """out[c, n] = x[n, c]: dims n, c with out_dims (1, 0)."""
    dims = (IterDim("n", rows), IterDim("c", cols))
    nest = LoopNest(dims, (Operand(x, (identity(0), identity(1))),), (1, 0), 0)
    return Op(name, "Identity", (x,), out, NoAttrs(), nest)


def ce_loss_op(name: str, scores: str, labels: str, out: str, n: int, c: int) -> Op:
    """SoftmaxCrossEntropy-like: scalar output, dims n, c both absent from it."""
    dims = (IterDim("n", n), IterDim("c", c))
    operands = (
        Operand(scores, (identity(0), identity(1))),
        Operand(labels, (identity(0),)),
    )
    nest = LoopNest(dims, operands, (), 4)
    return Op(
        name, "SoftmaxCrossEntropyLoss", (scores, labels), out, LossAttrs(), nest, is_loss=True
    )


def mse_loss_op(name: str, pred: str, target: str, out: str, shape: Sequence[int]) -> Op:
    dims = tuple(IterDim(AXIS_NAMES[i], s) for i, s in enumerate(shape))
    axes = tuple(identity(i) for i in range(len(shape)))
    nest = LoopNest(dims, (Operand(pred, axes), Operand(target, axes)), (), 3)
    return Op(name, "MeanSquaredError", (pred, target), out, LossAttrs(), nest, is_loss=True)


# --- graphs -----------------------------------------------------------------------------------


def tensor(name: str, shape: Sequence[int], role: TensorRole = TensorRole.ACTIVATION) -> Tensor:
    dtype = DType.INT64 if role is TensorRole.LABELS else DType.FLOAT32
    return Tensor(name, tuple(shape), dtype, role)


def make_graph(
    tensors: Sequence[Tensor],
    ops: Sequence[Op],
    *,
    input: str = "x",
    labels: str | None = "labels",
    loss: LossKind = LossKind.CROSS_ENTROPY,
) -> Graph:
    by_name = {t.name: t for t in tensors}
    return Graph(
        name="hand-built",
        tensors=by_name,
        ops=tuple(ops),
        inputs=(input,),
        output=ops[-1].output,
        labels=labels,
        loss=loss,
        batch=by_name[input].shape[0],
    )


BATCH = 4


def small_cnn() -> Graph:
    """x -> conv ─┐
    x -> pool ─┴> concat -> relu -> flatten -> gemm -> loss(labels)"""
    n, c, length, co, classes = BATCH, 3, 10, 4, 5
    win = Window(length, 3, 1, 1, 1, 1)
    R = TensorRole
    tensors = [
        tensor("x", (n, c, length), R.INPUT),
        tensor("labels", (n,), R.LABELS),
        tensor("W", (co, c, 3), R.WEIGHT),
        tensor("b", (co,), R.WEIGHT),
        tensor("y", (n, co, length)),
        tensor("p", (n, c, length)),
        tensor("cat", (n, co + c, length)),
        tensor("r", (n, co + c, length)),
        tensor("f", (n, (co + c) * length)),
        tensor("W2", ((co + c) * length, classes), R.WEIGHT),
        tensor("b2", (classes,), R.WEIGHT),
        tensor("logits", (n, classes)),
        tensor("loss", ()),
    ]
    ops = [
        conv_op("conv", "x", "W", "b", "y", n, c, co, [win]),
        pool_op("pool", "x", "p", n, c, [win]),
        concat_op("concat", [("y", (n, co, length)), ("p", (n, c, length))], "cat", 1),
        elementwise_op("relu", ["cat"], "r", (n, co + c, length)),
        flatten_op("flatten", "r", (n, co + c, length), "f"),
        gemm_op("gemm", "f", "W2", "b2", "logits", n, (co + c) * length, classes),
        ce_loss_op("loss_op", "logits", "labels", "loss", n, classes),
    ]
    return make_graph(tensors, ops)


def shapes_of(graph: Graph, op: Op) -> list[tuple[int, ...]]:
    return [graph.tensors[t].shape for t in op.inputs]


# --- configs and rects ----------------------------------------------------------------------


def kept_dims(op: Op) -> set[int]:
    return {d for d in op.nest.out_dims if d is not None}


@st.composite
def configs(
    draw,
    sizes: Sequence[int],
    splittable: Sequence[bool],
    devices: int = 8,
    max_degree: int = 3,
) -> ParallelConfig:
    """A config with a random degree (<= size) on every splittable dim, random devices."""
    degrees = tuple(
        draw(st.integers(1, min(max_degree, size))) if split else 1
        for size, split in zip(sizes, splittable, strict=True)
    )
    tasks = math.prod(degrees)
    placed = draw(st.lists(st.integers(0, devices - 1), min_size=tasks, max_size=tasks))
    return ParallelConfig(degrees, tuple(placed))


def op_configs(op: Op, devices: int = 8, max_degree: int = 3):
    """Configs that split only the kept dims of ``op``."""
    kept = kept_dims(op)
    sizes = [d.size for d in op.nest.dims]
    return configs(sizes, [i in kept for i in range(len(sizes))], devices, max_degree)


def slices(rect: Rect, origin: Rect | None = None) -> tuple[slice, ...]:
    if origin is None:
        return tuple(slice(lo, hi) for lo, hi in rect)
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(rect, origin, strict=True))


def coverage(shape: Sequence[int], rects: Sequence[Rect], origin: Rect | None = None):
    """How many of ``rects`` cover each element of an array of ``shape``."""
    count = np.zeros(tuple(shape), dtype=np.int64)
    for r in rects:
        count[slices(r, origin)] += 1
    return count


def inside(inner: Rect, outer: Rect) -> bool:
    return all(olo <= ilo < ihi <= ohi for (ilo, ihi), (olo, ohi) in zip(inner, outer, strict=True))
