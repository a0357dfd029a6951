"""Achieved compute: what a GPU's kernels reach, not its datasheet peaks.

The roofline (``costs.RooflineCost``) prices every task at the device's peak: right for
the executor's numpy kernels on CPU ranks, which ``machine probe`` measures, and far
from what a GPU's libraries run. ``AchievedCost`` prices a task as the kernels a
production stack launches for it (cuBLAS, FlashAttention, fused multi-tensor
optimizers, PyTorch's eager elementwise kernels), from published measurements:

- **Products** (MatMul, Gemm, Conv as an implicit GEMM): the best-shape GEMM rate
  (``KernelRates.gemm`` of the tensor cores' peak under mixed precision, ``gemm_fp32``
  of the FP32 peak in float32) and NVIDIA's wave quantization: the output is cut into
  ``GEMM_TILE`` tiles, one wave runs one tile per SM, and a wave costs what a full one
  does, so a product whose tiles leave a wave part empty runs below the rate; one with
  fewer tiles than SMs splits its depth among more of them (split-K). The backward is
  two products (the input's gradient and the weight's), each priced the same way.
- **Fused attention** (the Attention op): its FLOPs at a published share of the
  peak, the forward and the backward (2.5x the forward's FLOPs, FlashAttention-2's
  five products against two) each at their own.
- **Everything else** is memory-bound: bytes over the achieved bandwidth, at the
  stored width (2 bytes under mixed precision: native half kernels, none of the
  executor's rounding passes).
- **The update** is one fused multi-tensor pass over the master weight, its
  gradient and the optimizer's state.

Every kernel adds the device's ``kernel_overhead``. A device the table does not know
(CPU ranks, the papers' V100s and P100s, a machine file's device that names no GPU
``model``) is priced by the roofline; a profiled cost DB
(``profile``) replaces this model where a GPU is at hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from onnx2soap.ir import Op
from onnx2soap.precision import Precision
from onnx2soap.sim.costs import RooflineCost, task_bytes, task_flops
from onnx2soap.sim.machine import ComputeDevice
from onnx2soap.soap.partition import Task

PRODUCTS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})
ATTENTION = "Attention"
# FlashAttention-2's backward runs five products to the forward's two.
ATTENTION_BACKWARD_FLOPS = 2.5
# cuBLAS's large tensor-core tile (NVIDIA's "Matrix Multiplication Background User's
# Guide": 256x128 tiles on A100 and H100); FP32 SGEMM's 128x128.
GEMM_TILE = {True: (256, 128), False: (128, 128)}
SPLIT_K_DEPTH = 256  # the least depth a split-K part is given
COLUMNS = "co"  # the products' output-column dim (ops/defs: matmul, gemm, conv)


@dataclass(frozen=True)
class KernelRates:
    """What one GPU model's kernels reach, each figure with its source."""

    sms: int  # streaming multiprocessors: one tile each per wave
    gemm: float  # best-shape GEMM rate / the tensor cores' peak (16-bit inputs)
    gemm_fp32: float  # best-shape SGEMM rate / the FP32 peak
    attention_forward: float  # fused attention's FLOP rate / the 16-bit peak
    attention_backward: float
    bandwidth: float  # achieved / datasheet memory bandwidth (streaming kernels)
    source: str


_H100 = KernelRates(
    132,
    792.1 / 989,
    0.85,
    0.35,
    0.30,
    0.90,
    "GEMM: 792.1 of 989 TFLOPS, stas00/ml-engineering compute/accelerator README, "
    "'Maximum Achievable Matmul FLOPS comparison table' (H100 SXM, CUDA 12.1); attention: "
    "FlashAttention-2 reaches 35 % of the H100's peak (Shah et al. 2024, FlashAttention-3, "
    "arXiv 2407.08608, abstract), PyTorch SDPA 288-304 TFLOPS forward at head dim 128 "
    "(pytorch/benchmark PR 2296); its backward runs slower than its forward: 30 % assumed; "
    "SGEMM and streaming bandwidth: assumed 85 % and 90 %",
)
_A100 = KernelRates(
    108,
    267.9 / 312,
    0.85,
    0.60,
    0.50,
    0.90,
    "GEMM: 267.9 of 312 TFLOPS (stas00/ml-engineering, the same table, A100 SXM); "
    "attention: FlashAttention-2 reaches 50-73 % of the A100's peak forward (Dao 2023, "
    "arXiv 2307.08691), 60 % and 50 % backward taken; SGEMM and bandwidth assumed as H100's",
)
# By ``ComputeDevice.model``. Only GPUs with a published GEMM measurement: the papers'
# V100s and P100s stay on the roofline, which the suite's comparisons with FlexFlow and
# Alpa were made with, rather than on shares assumed for them.
RATES = {"H100 SXM": _H100, "A100 SXM": _A100}


@dataclass(frozen=True)
class GemmShape:
    """One product as cuBLAS sees it: ``rows`` x ``cols`` outputs, each a sum of
    ``depth`` products (batch dims folded into the rows)."""

    rows: int
    cols: int
    depth: int

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.cols * self.depth


def gemm_shape(op: Op, task: Task) -> GemmShape | None:
    """The task's product: columns the ``co`` dim, depth every reduction dim, rows the
    rest of the output; None where the op has no ``co`` dim."""
    nest = op.nest
    names = [d.name for d in nest.dims]
    if COLUMNS not in names:
        return None
    extents = [hi - lo for lo, hi in task.box]
    out = {i for i in nest.out_dims if i is not None}
    c = names.index(COLUMNS)
    depth = math.prod(extents[i] for i in range(len(names)) if i not in out)
    rows = math.prod(extents[i] for i in out if i != c)
    return GemmShape(rows, extents[c], depth)


@dataclass(frozen=True)
class AchievedCost:
    """Task seconds as a GPU's libraries run them (module doc); other devices by the
    roofline. ``precision``: mixed precision's products on the tensor cores and 2-byte
    storage; ``optimizer_slots``: the optimizer's arrays a weight (its update's bytes)."""

    precision: Precision = Precision.FP32
    optimizer_slots: int = 0
    roofline: RooflineCost = field(default_factory=RooflineCost)

    @staticmethod
    def knows(device: ComputeDevice) -> bool:
        return device.model in RATES

    def forward(self, op: Op, task: Task, device: ComputeDevice, itemsize: int) -> float:
        rates = RATES.get(device.model or "")
        if rates is None:
            return self.roofline.forward(op, task, device, itemsize)
        shape = gemm_shape(op, task) if op.type in PRODUCTS else None
        if shape is not None:
            seconds = self._gemm(shape, rates, device)
        elif op.type == ATTENTION:
            seconds = task_flops(op, task) / (self._peak(device) * rates.attention_forward)
        else:
            seconds = task_flops(op, task) / device.peak_flops
        moved = task_bytes(task, self._itemsize(itemsize)) / (
            device.memory_bandwidth * rates.bandwidth
        )
        return max(seconds, moved) + device.kernel_overhead

    def backward(self, op: Op, task: Task, device: ComputeDevice, itemsize: int) -> float:
        rates = RATES.get(device.model or "")
        if rates is None:
            return self.roofline.backward(op, task, device, itemsize)
        shape = gemm_shape(op, task) if op.type in PRODUCTS else None
        if shape is not None:  # dX = dY Wᵀ, and dW = Xᵀ dY
            dx = GemmShape(shape.rows, shape.depth, shape.cols)
            dw = GemmShape(shape.depth, shape.cols, shape.rows)
            seconds = self._gemm(dx, rates, device) + self._gemm(dw, rates, device)
        elif op.type == ATTENTION:
            flops = task_flops(op, task) * ATTENTION_BACKWARD_FLOPS
            seconds = flops / (self._peak(device) * rates.attention_backward)
        else:
            seconds = 2 * task_flops(op, task) / device.peak_flops
        nbytes = 2 * task_bytes(task, self._itemsize(itemsize))
        moved = nbytes / (device.memory_bandwidth * rates.bandwidth)
        return max(seconds, moved) + device.kernel_overhead

    def update(self, numel: int, device: ComputeDevice, itemsize: int) -> float:
        rates = RATES.get(device.model or "")
        if rates is None:
            return self.roofline.update(numel, device, itemsize)
        # float32 master and gradient read, master written; each state array read and
        # written; under mixed precision the 16-bit copy written
        per_element = 12 + 8 * self.optimizer_slots + (2 if self.precision.mixed else 0)
        seconds = numel * per_element / (device.memory_bandwidth * rates.bandwidth)
        return seconds + device.kernel_overhead

    def _itemsize(self, itemsize: int) -> int:
        return 2 if self.precision.mixed else itemsize

    def _peak(self, device: ComputeDevice) -> float:
        """The products' peak: the tensor cores' in 16 bits, else FP32's."""
        half = device.peak_flops_half
        return half if self.precision.mixed and half else device.peak_flops

    def _gemm(self, shape: GemmShape, rates: KernelRates, device: ComputeDevice) -> float:
        """Waves of tiles, each wave as long as a full one at the best-shape rate."""
        tensor = self.precision.mixed and bool(device.peak_flops_half)
        efficiency = rates.gemm if tensor else rates.gemm_fp32
        rate = self._peak(device) * efficiency
        tm, tn = GEMM_TILE[tensor]
        tiles = math.ceil(shape.rows / tm) * math.ceil(shape.cols / tn)
        # fewer tiles than SMs: cuBLAS splits the depth among more of them (split-K)
        split = max(1, min(rates.sms // tiles, shape.depth // SPLIT_K_DEPTH))
        waves = math.ceil(tiles * split / rates.sms)
        return waves * rates.sms * 2 * tm * tn * math.ceil(shape.depth / split) / rate
