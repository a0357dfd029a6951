"""Sliding windows shared by Conv, ConvTranspose and the pools: attribute checks, pads,
output sizes and the affine access maps of a window."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from onnx2soap.ir import Affine
from onnx2soap.ops.context import NodeContext, text


@dataclass(frozen=True)
class Window:
    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]


def int_list(ctx: NodeContext, name: str, value, rank: int, default: int, least: int):
    """An int-list attribute of ``rank`` entries, each at least ``least``."""
    values = tuple(int(v) for v in value) if value is not None else (default,) * rank
    if len(values) != rank:
        raise ctx.fail(f"{name} must have {rank} entries for this input, got {list(values)}")
    if any(v < least for v in values):
        raise ctx.fail(f"{name} must be >= {least}, got {list(values)}")
    return values


def window(
    ctx: NodeContext,
    in_sizes: Sequence[int],
    kernel: Sequence[int],
    *,
    strides,
    dilations,
    pads,
    auto_pad,
) -> Window:
    """Checked attributes of a window op over spatial sizes ``in_sizes``."""
    rank = len(in_sizes)
    kernel = int_list(ctx, "kernel_shape", kernel, rank, 1, 1)
    strides = int_list(ctx, "strides", strides, rank, 1, 1)
    dilations = int_list(ctx, "dilations", dilations, rank, 1, 1)
    auto_pad = text(auto_pad)
    if auto_pad in ("NOTSET", ""):
        flat = int_list(ctx, "pads", pads, 2 * rank, 0, 0)
        return Window(kernel, strides, dilations, flat[:rank], flat[rank:])
    if auto_pad == "VALID":
        return Window(kernel, strides, dilations, (0,) * rank, (0,) * rank)
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise ctx.fail(f"auto_pad '{auto_pad}' is not one of NOTSET, VALID, SAME_UPPER, SAME_LOWER")
    begin, end = [], []
    for size, k, s, d in zip(in_sizes, kernel, strides, dilations, strict=True):
        out = -(-size // s)
        total = max(0, (out - 1) * s + d * (k - 1) + 1 - size)
        small, big = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else big)
        end.append(big if auto_pad == "SAME_UPPER" else small)
    return Window(kernel, strides, dilations, tuple(begin), tuple(end))


def window_outputs(
    ctx: NodeContext, sizes: Sequence[int], w: Window, ceil_mode: bool
) -> tuple[int, ...]:
    """Output sizes of a sliding window (ONNX Conv/pool, PyTorch's ceil_mode rule: a last
    window that would start in the end padding is dropped)."""
    out = []
    for size, k, s, d, b, e in zip(
        sizes, w.kernel_shape, w.strides, w.dilations, w.pads_begin, w.pads_end, strict=True
    ):
        span = size + b + e - d * (k - 1) - 1
        if span < 0:
            raise ctx.fail(f"the window ({k} with dilation {d}) is larger than the padded input")
        n = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (n - 1) * s >= size + b:
            n -= 1
        out.append(n)
    return tuple(out)


def window_axes(first_out: int, first_kernel: int, w: Window) -> tuple[Affine, ...]:
    """Input index ``out * stride + k * dilation - pad_begin`` per spatial axis."""
    return tuple(
        Affine(((first_out + i, s), (first_kernel + i, d)), -p)
        for i, (s, d, p) in enumerate(zip(w.strides, w.dilations, w.pads_begin, strict=True))
    )
