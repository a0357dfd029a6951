"""What mixed precision costs on top of a cost model, as the executor runs it.

The executor (``executor/precision.py``) computes in float32 on values rounded to the
half format: every array a kernel makes is rounded in a pass of its own (fp16, and
bf16 on CPU ranks: a cast there and back, bf16's after a reduction that looks for NaNs;
bf16 on a GPU: about ten float32-sized passes of bit arithmetic, CuPy having none),
and after every update each weight's half-format copy is remade. On a device with a
float16 peak above its float32 one (``ComputeDevice.peak_flops_half``: a GPU's tensor
cores), fp16's MatMul, Gemm and Attention multiply in float16: the analytic model prices their
products at that peak, plus the casts of their operands. Profiled costs timed float32
kernels, so only the rounding passes are added to them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from onnx2soap.ir import Op
from onnx2soap.precision import Precision
from onnx2soap.sim.costs import CostModel, RooflineCost
from onnx2soap.sim.machine import ComputeDevice
from onnx2soap.soap.partition import Task, rect_volume

# Bytes moved per element to round a float32 array in place (executor/precision.py):
# a cast to the half format and back reads 4 + 2 and writes 2 + 4; bf16's NaN check
# reads 4 more; CuPy's bf16 bit arithmetic moves about ten float32 passes.
ROUNDING_BYTES = {Precision.BF16: 40, Precision.FP16: 12}
HOST_ROUNDING_BYTES = {Precision.BF16: 16, Precision.FP16: 12}  # numpy's casts
# kernels with a float16 product (GPUs, fp16)
HALF_PRODUCTS = frozenset({"MatMul", "Gemm", "Attention"})


@dataclass(frozen=True)
class MixedPrecisionCost:
    base: CostModel
    precision: Precision
    host: bool = False  # CPU ranks: numpy rounds (``HOST_ROUNDING_BYTES``)

    def _rounding(self, elements: int, device: ComputeDevice) -> float:
        table = HOST_ROUNDING_BYTES if self.host else ROUNDING_BYTES
        return elements * table[self.precision] / device.memory_bandwidth

    def _half_device(self, op: Op, device: ComputeDevice) -> ComputeDevice | None:
        """The device as an fp16 product sees it, where the analytic model can say."""
        faster = device.peak_flops_half and device.peak_flops_half > device.peak_flops
        if (
            self.precision is Precision.FP16
            and op.type in HALF_PRODUCTS
            and faster
            and isinstance(self.base, RooflineCost)
        ):
            return replace(device, peak_flops=device.peak_flops_half)
        return None

    def _casts(self, task: Task, device: ComputeDevice) -> float:
        """The operands copied to float16 and the product back (4 + 2 bytes each way)."""
        elements = sum(rect_volume(r.buffer) for r in task.inputs) + rect_volume(task.output)
        return elements * 6 / device.memory_bandwidth

    def forward(self, op: Op, task: Task, device: ComputeDevice, itemsize: int) -> float:
        half = self._half_device(op, device)
        seconds = self.base.forward(op, task, half or device, itemsize)
        if half is not None:
            seconds += self._casts(task, device)
        return seconds + self._rounding(rect_volume(task.output), device)

    def backward(self, op: Op, task: Task, device: ComputeDevice, itemsize: int) -> float:
        half = self._half_device(op, device)
        seconds = self.base.backward(op, task, half or device, itemsize)
        if half is not None:
            seconds += 2 * self._casts(task, device)
        grads = sum(rect_volume(r.buffer) for r in task.inputs)  # at most one per input
        return seconds + self._rounding(grads, device)

    def update(self, numel: int, device: ComputeDevice, itemsize: int) -> float:
        copy = 2 * numel * itemsize / device.memory_bandwidth  # the master to its copy
        return self.base.update(numel, device, itemsize) + copy + self._rounding(numel, device)


def with_precision(cost: CostModel, precision: Precision, host: bool = False) -> CostModel:
    """``cost`` as a mixed-precision run pays it (itself in float32 training); ``host``:
    on CPU ranks, whose numpy rounds by casts."""
    return MixedPrecisionCost(cost, precision, host) if precision.mixed else cost
