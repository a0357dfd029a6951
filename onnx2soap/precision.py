"""The precision a plan trains in: what the simulator prices and the executor runs.

``FP32`` is plain float32 training (or float64, the executor's ``--dtype``). ``BF16`` and
``FP16`` are mixed precision as torch.autocast does it: forward and backward values in the
half format, float32 master weights, gradients summed and optimizer state kept in
float32; ``FP16`` also scales the loss dynamically (its small range would flush
gradients to zero), as torch.amp's GradScaler does.
"""

from __future__ import annotations

from enum import Enum


class Precision(Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def mixed(self) -> bool:
        """Values in a half format, master weights in float32."""
        return self is not Precision.FP32

    @property
    def scales_loss(self) -> bool:
        return self is Precision.FP16
