"""The kernel interface: forward and backward of one op on one task's local buffers.

A kernel never sees global coordinates. It receives, per operand, the task's assembled
buffer (for window operands: halo included and the op's pad value where the window
reaches past the tensor) and returns the task's output tile. Kernels are written against
an array module ``xp`` (numpy or cupy), so one implementation serves CPU and GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Array = Any  # numpy.ndarray or cupy.ndarray
Interval = tuple[int, int]


@dataclass(frozen=True)
class TaskArgs:
    """Per-task facts a kernel may need besides its buffers.

    out_shape:  the shape of the task's output tile (``()`` for a loss).
    valid:      per operand, where the tensor's data lies inside the buffer (buffer-local
                half-open intervals per axis); the rest of the buffer is padding.
    loss_scale: losses only: the divisor of a mean over the *whole* batch (the number of
                labels not equal to ignore_index, or the element count for MSE); 1 for sum.
    """

    out_shape: tuple[int, ...]
    valid: tuple[tuple[Interval, ...], ...]
    loss_scale: float = 1.0


class Kernel(Protocol):
    def forward(self, xp, attrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        """The task's output tile, of shape ``args.out_shape``."""
        ...

    def backward(
        self,
        xp,
        attrs,
        inputs: Sequence[Array],
        output: Array,
        grad_output: Array,
        args: TaskArgs,
    ) -> tuple[Array | None, ...]:
        """Gradients w.r.t. every input buffer (same shapes as the buffers, padding
        included); None for inputs that need none (labels)."""
        ...
