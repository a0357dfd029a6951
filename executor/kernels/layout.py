"""Flatten, Reshape and Concat: pure data movement.

A reshaping op reads whole samples (the importer maps every non-batch axis ``Whole``), so
a C-order reshape of the local buffer is the reshape of the tensor's rows. Concat tasks
receive, per input, the part of it their box covers, which is empty (zero extent along
the axis) for inputs the box does not reach.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from executor.kernels.base import Array, TaskArgs
from onnx2soap.ir import ConcatAttrs


@dataclass(frozen=True)
class ReshapeKernel:
    """Flatten (axis=1) and Reshape alike. Copies, so outputs never alias inputs."""

    def forward(self, xp, attrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        return inputs[0].reshape(args.out_shape).copy()

    def backward(self, xp, attrs, inputs, output, grad_output, args):
        return (grad_output.reshape(inputs[0].shape).copy(),)


@dataclass(frozen=True)
class ConcatKernel:
    def forward(self, xp, attrs: ConcatAttrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        return xp.concatenate(list(inputs), axis=attrs.axis)

    def backward(self, xp, attrs: ConcatAttrs, inputs, output, grad_output, args):
        grads, offset = [], 0
        for x in inputs:
            size = x.shape[attrs.axis]
            index = [slice(None)] * grad_output.ndim
            index[attrs.axis] = slice(offset, offset + size)
            grads.append(grad_output[tuple(index)].copy())
            offset += size
        return tuple(grads)
