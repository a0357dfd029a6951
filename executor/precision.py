"""Mixed precision on the executor: half-format storage, rounding, and fp16's loss scale.

Kernels compute in float32, as torch.autocast's do inside. What the step stores between
them is in the half format, 2 bytes an element (``HalfStorage``): output tiles, their
input buffers and gradients, the data rows and each weight's compute copy; a kernel's
result is narrowed to it (round to nearest, ties to even, as a cast to bfloat16 or
float16) and a stored array widened to float32 for the next kernel (exact). numpy has no
fast half-precision arithmetic and CuPy no bfloat16 (its bits are kept in uint16 there),
so this is how both compute. The master weights, weight gradients (rounded to the half
format's values, ``Rounding``, then summed in float32), the optimizer's state, losses,
statistics and partial sums' arithmetic stay float32.

``LossScaler`` is torch.amp.GradScaler's dynamic loss scale: the backward starts from
the scale instead of 1, a step whose gradients hold an infinity or NaN on any rank is
skipped and the scale halved, and after ``growth_interval`` good steps it doubles.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from onnx2soap.ops.base import Released
from onnx2soap.precision import Precision

_BF16_NAN = 0x7FC00000  # the quiet NaN a bfloat16 cast gives for any NaN (as torch's)


def round_bf16(xp, x) -> None:
    """Round a float32 array to bfloat16 values in place (nearest, ties to even)."""
    if xp is np:
        _round_bf16_numpy(x)
        return
    bits = x.view(xp.uint32)
    nan = xp.isnan(x)
    odd = (bits >> xp.uint32(16)) & xp.uint32(1)
    rounded = (bits + (odd + xp.uint32(0x7FFF))) & xp.uint32(0xFFFF0000)
    # ``where``, not an indexed store: on a 0-d array the arithmetic gives a scalar.
    bits[...] = xp.where(nan, xp.uint32(_BF16_NAN), rounded)


def _round_bf16_numpy(x: np.ndarray) -> None:
    """ml_dtypes' cast (nearest, ties to even) and back, in place: 2 bytes an element
    beside the array, where the bit arithmetic CuPy needs holds about 13; NaNs made
    torch's quiet one where there are any (a reduction finds them, no mask made)."""
    nan = _has_nan(x)
    halves = x.astype(ml_dtypes.bfloat16)
    x[...] = halves
    del halves
    if nan:
        x.view(np.uint32)[np.isnan(x)] = _BF16_NAN


def _has_nan(x: np.ndarray) -> bool:
    """Whether a float array holds a NaN, without a mask of its size (max propagates
    NaN)."""
    return x.size > 0 and bool(np.isnan(x.max()))


def round_fp16(xp, x) -> None:
    """Round a float32 array to float16 values in place (past 65504: infinity)."""
    x[...] = x.astype(xp.float16)


@dataclass(frozen=True)
class Rounding:
    """Rounds the arrays a mixed-precision step makes; a no-op in float32 training."""

    xp: object
    precision: Precision

    @property
    def active(self) -> bool:
        return self.precision.mixed

    def __call__(self, x) -> None:
        if not self.active or getattr(x, "dtype", None) != np.float32:
            return
        if self.precision is Precision.BF16:
            round_bf16(self.xp, x)
        else:
            round_fp16(self.xp, x)


@dataclass(frozen=True)
class HalfStorage:
    """How a mixed-precision step stores the arrays between kernels (float32 where the
    run is not mixed: then ``narrow`` and ``widen`` return what they are given)."""

    xp: object
    precision: Precision

    @property
    def active(self) -> bool:
        return self.precision.mixed

    @property
    def dtype(self) -> np.dtype:
        """The stored dtype: float16, bfloat16 (its bits in uint16 on a GPU), or float32."""
        if self.precision is Precision.FP16:
            return np.dtype(np.float16)
        if self.precision is Precision.BF16:
            return np.dtype(ml_dtypes.bfloat16 if self.xp is np else np.uint16)
        return np.dtype(np.float32)

    def empty(self, shape):
        """A stored array for ``narrow`` to fill."""
        return self.xp.empty(shape, dtype=self.dtype)

    def narrow(self, x, into=None):
        """A float32 array (a kernel's result) as a stored array: a new one, or ``into``
        where it has the result's shape (a stored array made before the kernel ran:
        ``Step._stored_tile``); anything else as it is. bfloat16's NaN is the quiet one
        torch's cast gives, whatever its sign."""
        if not self.active or getattr(x, "dtype", None) != np.float32:
            return x
        xp = self.xp
        if into is None or into.shape != x.shape:
            into = self.empty(x.shape)
        if self.precision is Precision.FP16 or xp is np:
            into[...] = x  # the cast ``astype`` makes: nearest, ties to even
            if self.precision is Precision.BF16 and _has_nan(x):  # no mask unless a NaN
                into.view(np.uint16)[np.isnan(x)] = _BF16_NAN >> 16
            return into
        rounded = xp.array(x, dtype=xp.float32)  # bfloat16 bits by hand: CuPy has none
        round_bf16(xp, rounded)
        into[...] = rounded.view(xp.uint32) >> xp.uint32(16)
        return into

    def widen(self, x):
        """A stored array as float32 for a kernel (exact); anything else as it is."""
        if not self.active or getattr(x, "dtype", None) != self.dtype:
            return x
        if isinstance(x, Released):  # its shape, as a float32 array's
            return Released(x.shape, np.dtype(np.float32))
        if self.dtype == np.uint16:
            return (x.astype(self.xp.uint32) << self.xp.uint32(16)).view(self.xp.float32)
        return x.astype(np.float32)

    def widen_all(self, arrays) -> list:
        return [self.widen(x) for x in arrays] if self.active else arrays

    @staticmethod
    def owned(stored, wide) -> tuple[bool, ...]:
        """Per operand, whether ``widen_all`` made a float32 copy of it (``TaskArgs.owned``):
        the kernel's own, nothing else holds it. A released operand's stand-in is none."""
        return tuple(
            w is not x and not isinstance(w, Released) for x, w in zip(stored, wide, strict=True)
        )


@dataclass
class LossScaler:
    """fp16's dynamic loss scale, as torch.amp.GradScaler keeps it (its defaults)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0  # good steps since the scale last changed

    def update(self, found_inf: bool) -> None:
        """After a step: back off on an infinity or NaN, grow after enough good steps."""
        if found_inf:
            self.scale = float(np.float32(self.scale * self.backoff_factor))
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = float(np.float32(self.scale * self.growth_factor))
            if np.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0
