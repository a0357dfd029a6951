"""The executor's compute kernels, one per op type (see ``base.Kernel``).

kernel = kernel_for(op.type)
y = kernel.forward(xp, op.attrs, buffers, TaskArgs(out_shape, valid))
"""

from __future__ import annotations

from executor.kernels.base import Kernel, TaskArgs
from executor.kernels.conv import ConvKernel
from executor.kernels.elementwise import AddKernel, IdentityKernel, ReluKernel
from executor.kernels.layout import ConcatKernel, ReshapeKernel
from executor.kernels.loss import MeanSquaredErrorKernel, SoftmaxCrossEntropyKernel
from executor.kernels.matmul import GemmKernel, MatMulKernel
from executor.kernels.pool import (
    AveragePoolKernel,
    GlobalAveragePoolKernel,
    MaxPoolKernel,
    ReduceMeanKernel,
)
from onnx2soap.errors import ModelError
from onnx2soap.ir import OpType

__all__ = ["KERNELS", "Kernel", "TaskArgs", "kernel_for"]

KERNELS: dict[OpType, Kernel] = {
    OpType.GEMM: GemmKernel(),
    OpType.MATMUL: MatMulKernel(),
    OpType.ADD: AddKernel(),
    OpType.RELU: ReluKernel(),
    OpType.IDENTITY: IdentityKernel(),
    OpType.CONV: ConvKernel(),
    OpType.MAXPOOL: MaxPoolKernel(),
    OpType.AVERAGEPOOL: AveragePoolKernel(),
    OpType.GLOBALAVERAGEPOOL: GlobalAveragePoolKernel(),
    OpType.REDUCE_MEAN: ReduceMeanKernel(),
    OpType.FLATTEN: ReshapeKernel(),
    OpType.RESHAPE: ReshapeKernel(),
    OpType.CONCAT: ConcatKernel(),
    OpType.SOFTMAX_CROSS_ENTROPY: SoftmaxCrossEntropyKernel(),
    OpType.MSE_LOSS: MeanSquaredErrorKernel(),
}


def kernel_for(op_type: OpType) -> Kernel:
    """The kernel of ``op_type``; a ``ModelError`` naming the supported types otherwise."""
    kernel = KERNELS.get(op_type) if isinstance(op_type, OpType) else None
    if kernel is None:
        supported = ", ".join(sorted(t.value for t in KERNELS))
        raise ModelError(f"the executor has no kernel for op type {op_type!r}; it has: {supported}")
    return kernel
