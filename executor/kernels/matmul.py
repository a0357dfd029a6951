"""Gemm and MatMul.

The reduction dim (``ci``) is never split, so every buffer holds whole rows/columns of the
contraction and a task's product is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from executor.kernels._common import unbroadcast
from executor.kernels.base import Array, TaskArgs
from onnx2soap.ir import GemmAttrs, NoAttrs


@dataclass(frozen=True)
class GemmKernel:
    """Y = alpha * A' @ B' + beta * C, with A' = A.T if trans_a, B' = B.T if trans_b."""

    def forward(self, xp, attrs: GemmAttrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        a, b = inputs[0], inputs[1]
        a = a.T if attrs.trans_a else a
        b = b.T if attrs.trans_b else b
        y = xp.matmul(a, b)
        if attrs.alpha != 1.0:
            y *= attrs.alpha
        if len(inputs) > 2:
            y += attrs.beta * inputs[2]
        return y

    def backward(self, xp, attrs: GemmAttrs, inputs, output, grad_output, args):
        a, b = inputs[0], inputs[1]
        g = grad_output * attrs.alpha if attrs.alpha != 1.0 else grad_output
        ta = a.T if attrs.trans_a else a  # A' (M, K)
        tb = b.T if attrs.trans_b else b  # B' (K, N)
        # dA' = g B'^T, dB' = A'^T g; a transposed operand takes the transposed product,
        # computed directly so that the result is contiguous in the buffer's layout.
        grad_a = xp.matmul(tb, g.T) if attrs.trans_a else xp.matmul(g, tb.T)
        grad_b = xp.matmul(g.T, ta) if attrs.trans_b else xp.matmul(ta.T, g)
        grads = [grad_a, grad_b]
        if len(inputs) > 2:
            grads.append(unbroadcast(xp, grad_output * attrs.beta, inputs[2].shape))
        return tuple(grads)


@dataclass(frozen=True)
class MatMulKernel:
    """numpy.matmul semantics for operands of rank >= 2 (the importer refuses rank 1):
    batch axes broadcast, and an operand may have fewer of them than the output."""

    def forward(self, xp, attrs: NoAttrs, inputs: Sequence[Array], args: TaskArgs) -> Array:
        a, b = inputs
        return xp.matmul(a, b)

    def backward(self, xp, attrs: NoAttrs, inputs, output, grad_output, args):
        a, b = inputs
        grad_a = xp.matmul(grad_output, xp.swapaxes(b, -1, -2))
        grad_b = xp.matmul(xp.swapaxes(a, -1, -2), grad_output)
        return unbroadcast(xp, grad_a, a.shape), unbroadcast(xp, grad_b, b.shape)
