"""Cost models: how long a task takes on a device. Stateless; handed to the simulator.

``CostModel`` is the interface; ``RooflineCost`` the analytic model for hardware we don't
have (FLOPs over peak or bytes over memory bandwidth, whichever is larger, plus a fixed
per-task overhead). A profiled model (measured kernels in a cost DB) implements the same
interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from onnx2soap.ir import Op
from onnx2soap.sim.machine import ComputeDevice
from onnx2soap.soap.partition import Task, rect_volume


class CostModel(Protocol):
    """Seconds a task takes on a device, its tensors ``itemsize`` bytes an element."""

    def forward(self, op: Op, task: Task, device: ComputeDevice, itemsize: int) -> float: ...

    def backward(self, op: Op, task: Task, device: ComputeDevice, itemsize: int) -> float: ...

    def update(self, numel: int, device: ComputeDevice, itemsize: int) -> float: ...


def task_flops(op: Op, task: Task) -> int:
    return op.nest.work_points(task.box) * op.nest.flops_per_point


def task_bytes(task: Task, itemsize: int) -> int:
    """Bytes a task's kernel touches: its input buffers and its output tile."""
    moved = sum(rect_volume(r.buffer) for r in task.inputs) + rect_volume(task.output)
    return moved * itemsize


@dataclass(frozen=True)
class RooflineCost:
    """Backward costs twice the forward (gradients for inputs and for weights)."""

    backward_factor: float = 2.0

    def _time(self, flops: float, nbytes: float, device: ComputeDevice) -> float:
        compute = flops / device.peak_flops
        memory = nbytes / device.memory_bandwidth
        return max(compute, memory) + device.kernel_overhead

    def forward(self, op: Op, task: Task, device: ComputeDevice, itemsize: int) -> float:
        return self._time(task_flops(op, task), task_bytes(task, itemsize), device)

    def backward(self, op: Op, task: Task, device: ComputeDevice, itemsize: int) -> float:
        f = self.backward_factor
        flops, nbytes = task_flops(op, task) * f, task_bytes(task, itemsize) * f
        return self._time(flops, nbytes, device)

    def update(self, numel: int, device: ComputeDevice, itemsize: int) -> float:
        # SGD reads the weight and its gradient and writes the weight.
        return self._time(2 * numel, 3 * numel * itemsize, device)
