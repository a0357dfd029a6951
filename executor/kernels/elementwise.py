"""Add (numpy broadcasting), Relu and Identity.

Forward outputs and gradients are always fresh arrays, never views of an input: the
executor may accumulate into them in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from executor.kernels._common import unbroadcast
from executor.kernels.base import Array, TaskArgs


@dataclass(frozen=True)
class AddKernel:
    def forward(self, xp, attrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        a, b = inputs
        return a + b

    def backward(self, xp, attrs, inputs, output, grad_output, args):
        # A Broadcast operand axis has a size-1 buffer: its gradient sums the tile's axis.
        return tuple(unbroadcast(xp, grad_output, x.shape) for x in inputs)


@dataclass(frozen=True)
class ReluKernel:
    def forward(self, xp, attrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        return xp.maximum(inputs[0], 0)

    def backward(self, xp, attrs, inputs, output, grad_output, args):
        # The subgradient at 0 is 0 (as in PyTorch and ORT training).
        return (grad_output * (inputs[0] > 0),)


@dataclass(frozen=True)
class IdentityKernel:
    def forward(self, xp, attrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        return inputs[0].copy()

    def backward(self, xp, attrs, inputs, output, grad_output, args):
        return (grad_output.copy(),)
