"""Assemble a task's input buffer from tiles, and cut gradients back into tiles.

These are pure helpers over soap's ``Region``/``Rect``: which rects to copy is decided by
soap's partition math, never here.
"""

from __future__ import annotations

from onnx2soap.ops.base import Array
from onnx2soap.soap.partition import Rect, Region, rect_shape


def local_slices(rect: Rect, origin: Rect) -> tuple[slice, ...]:
    """Where ``rect`` lies inside a buffer whose global extent is ``origin``."""
    return tuple(slice(lo - olo, hi - olo) for (lo, hi), (olo, _) in zip(rect, origin, strict=True))


def empty_buffer(xp, region: Region, dtype) -> Array:
    """A buffer for ``region`` holding the pad value outside the data (zeros if none)."""
    shape = rect_shape(region.buffer)
    if region.pad_value is None or region.buffer == region.data:
        return xp.zeros(shape, dtype=dtype)
    return xp.full(shape, region.pad_value, dtype=dtype)


def slice_from_full(xp, full: Array, region: Region) -> Array:
    """A task's buffer cut from a whole tensor that is present in full (data input,
    labels, or the one-device reference)."""
    buf = empty_buffer(xp, region, full.dtype)
    buf[local_slices(region.data, region.buffer)] = full[global_slices(region.data)]
    return buf


def global_slices(rect: Rect) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in rect)
