"""Mixed precision on the executor: values rounded to bf16 or fp16, and fp16's loss scale.

Kernels compute in float32 on values that are representable in the half format: every
float array a kernel makes (outputs, gradients), the data rows and each weight's compute
copy are rounded to the nearest half value, ties to even, as a cast to bfloat16 or
float16 and back would. numpy has no fast half-precision arithmetic, and CuPy no
bfloat16, so this is how both compute; the master weights, the summed weight gradients,
the optimizer's state, losses and statistics stay float32.

``LossScaler`` is torch.amp.GradScaler's dynamic loss scale: the backward starts from
the scale instead of 1, a step whose gradients hold an infinity or NaN on any rank is
skipped and the scale halved, and after ``growth_interval`` good steps it doubles.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx2soap.precision import Precision

_BF16_NAN = 0x7FC00000  # the quiet NaN a bfloat16 cast gives for any NaN (as torch's)


def round_bf16(xp, x) -> None:
    """Round a float32 array to bfloat16 values in place (nearest, ties to even)."""
    bits = x.view(xp.uint32)
    nan = xp.isnan(x)
    odd = (bits >> xp.uint32(16)) & xp.uint32(1)
    rounded = (bits + (odd + xp.uint32(0x7FFF))) & xp.uint32(0xFFFF0000)
    # ``where``, not an indexed store: on a 0-d array the arithmetic gives a scalar.
    bits[...] = xp.where(nan, xp.uint32(_BF16_NAN), rounded)


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
