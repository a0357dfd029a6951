"""Helpers shared by kernels: broadcasting reductions and window taps."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from itertools import product

from onnx2soap.ops.base import Array


def matmul(xp, a: Array, b: Array, dtype=None) -> Array:
    """``a @ b``, multiplied in ``dtype`` when one is given (float16 on a GPU: cuBLAS's
    tensor cores, summing in float32), the result in ``a``'s dtype. In mixed precision
    the operands hold float16 values already, so only the product's rounding moves, and
    the step rounds every kernel's result to float16 anyway."""
    if dtype is None:
        return xp.matmul(a, b)
    return xp.matmul(a.astype(dtype), b.astype(dtype)).astype(a.dtype)


def unbroadcast(xp, grad: Array, shape: Sequence[int]) -> Array:
    """Sum ``grad`` over the axes numpy broadcasting added or stretched to reach its shape
    from ``shape``. Always a fresh array: two operands of one op must never share (and so
    accumulate into) the same gradient buffer."""
    shape = tuple(shape)
    lead = grad.ndim - len(shape)
    if lead:
        grad = grad.sum(axis=tuple(range(lead)))
    stretched = tuple(i for i, s in enumerate(shape) if s == 1 and grad.shape[i] != 1)
    if stretched:
        grad = grad.sum(axis=stretched, keepdims=True)
    if lead or stretched:
        return grad.reshape(shape)
    return grad.copy()


def strided(start: int, count: int, step: int) -> slice:
    """The slice of ``count`` indices ``start, start + step, ...`` (empty for ``count == 0``,
    where ``start + (count - 1) * step + 1`` would run backwards)."""
    stop = start + (count - 1) * step + 1 if count else start
    return slice(start, stop, step)


def window_taps(attrs, out_spatial: Sequence[int]) -> Iterator[tuple[slice, ...]]:
    """Per kernel position, row-major (the scan order that decides MaxPool ties), the
    spatial slices of a window buffer that all outputs of the tile read at that position.

    ``attrs`` has ``kernel_shape``, ``strides`` and ``dilations``. The buffer starts at the
    first window's first tap (halo and padding included), so position ``k`` of output ``j``
    is buffer index ``j * stride + k * dilation``: no global coordinate is needed.
    """
    for pos in product(*(range(k) for k in attrs.kernel_shape)):
        yield tuple(
            strided(k * d, o, s)
            for k, d, s, o in zip(pos, attrs.dilations, attrs.strides, out_spatial, strict=True)
        )


def flat_shifts(attrs, buffer: Sequence[int]) -> list[int]:
    """For stride-1 windows over a buffer of spatial shape ``buffer``: per kernel position
    (row-major, increasing), the shift in the row-major flattened buffer from an
    output's own position to the element it reads there.

    Output (i, j, ...) reads (i + a*d, j + b*d', ...) at tap (a, b, ...), so a tap reads,
    for the outputs of every sample and channel at once, one run of the flat buffer: a
    long vectorized copy or add instead of many short strided rows (numpy pays about
    100 ns per row). The run also yields "garbage": the positions of the buffer that are
    no output (past the output extent, or reading into the next channel), to be dropped
    from results and given zero gradient.
    """
    flat = [math.prod(buffer[i + 1 :]) for i in range(len(buffer))]
    steps = [d * f for d, f in zip(attrs.dilations, flat, strict=True)]
    return [
        sum(k * s for k, s in zip(pos, steps, strict=True))
        for pos in product(*(range(k) for k in attrs.kernel_shape))
    ]


def check_window_buffer(op: str, attrs, buffer_shape: Sequence[int], out_spatial) -> None:
    """Refuse a buffer too small for the tile's windows: numpy and cupy would silently
    clip the strided slices and the error would surface far from its cause."""
    need = tuple(
        (o - 1) * s + (k - 1) * d + 1 if o else 0
        for o, k, s, d in zip(
            out_spatial, attrs.kernel_shape, attrs.strides, attrs.dilations, strict=True
        )
    )
    have = tuple(buffer_shape[2:])
    if any(h < n for h, n in zip(have, need, strict=True)):
        raise ValueError(
            f"{op}: window buffer spatial shape {list(have)} is smaller than the "
            f"{list(need)} that output tile {list(out_spatial)} reads"
        )


def scatter_add(xp, target: Array, indices: Array, values: Array) -> None:
    """``target[indices[k]] += values[k]`` along axis 0, repeated indices accumulating:
    ``add.at`` on numpy and cupy alike (cupy >= 13; its older ``cupyx.scatter_add`` goes
    through ``ndarray.scatter_add``, deprecated since cupy 12, which warns at every call)."""
    xp.add.at(target, indices, values)
