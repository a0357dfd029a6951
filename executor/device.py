"""Where a rank's arrays live: the CPU (numpy) or one GPU (cupy), and what differs.

The runtime and the kernels are written once on ``xp``; what numpy and cupy spell
differently for the runtime (moving arrays between host and device, page-locked host
buffers, streams and events) is one method here. On the CPU streams and events are
no-ops: work runs in program order and MPI's nonblocking calls give the overlap.

A GPU rank computes on one stream and communicates on another; an ``Event`` recorded
after a producer lets the other stream wait for it without the host waiting.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from executor.kinds import DeviceKind
from onnx2soap.errors import UserError

# cudaError_t codes that mean "no GPU here" rather than a broken setup.
CUDA_NO_DRIVER, CUDA_NO_DEVICE = 35, 100  # cudaErrorInsufficientDriver, cudaErrorNoDevice


def cupy_module():
    """cupy when it is installed and sees a GPU; None when cupy is not installed, or
    CUDA says there is no driver or no device. Anything else is raised: a cupy that is
    installed but fails to import, or a driver that fails otherwise, is a broken setup
    that must fail loudly rather than fall back to the CPU."""
    try:
        import cupy
    except ModuleNotFoundError as e:
        if e.name != "cupy":
            raise  # cupy is there; something it imports is not
        return None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        if getattr(e, "status", None) in (CUDA_NO_DRIVER, CUDA_NO_DEVICE):
            return None
        raise
    return cupy if count > 0 else None


class CpuDevice:
    kind = DeviceKind.CPU
    xp = np
    name = "cpu"

    def compute(self) -> AbstractContextManager:
        return nullcontext()

    def to_device(self, host: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return np.array(host)
        np.copyto(out, host)
        return out

    def to_host(self, array, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return np.asarray(array)
        np.copyto(out, array)
        return out

    def host_empty(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def record(self, stream: Any = None) -> None:
        return None

    def wait_event(self, event: Any, stream: Any = None) -> None:
        return None

    def comm_stream(self) -> Any:
        return None

    def synchronize(self) -> None:
        return None


@dataclass
class CudaDevice:
    """One GPU, chosen by the rank's node-local rank modulo the visible GPUs."""

    cp: Any
    index: int

    kind = DeviceKind.CUDA

    def __post_init__(self) -> None:
        self.cp.cuda.Device(self.index).use()
        self._compute = self.cp.cuda.Stream(non_blocking=True)
        self._comm = self.cp.cuda.Stream(non_blocking=True)

    @property
    def xp(self):
        return self.cp

    @property
    def name(self) -> str:
        props = self.cp.cuda.runtime.getDeviceProperties(self.index)
        return f"cuda:{self.index} ({props['name'].decode()})"

    def compute(self) -> AbstractContextManager:
        """Make the compute stream current: every kernel launched inside runs on it."""
        return self._compute

    def to_device(self, host: np.ndarray, out=None):
        with self._compute:  # every copy in, like every kernel, on the compute stream
            if out is None:
                out = self.cp.empty(host.shape, dtype=host.dtype)
            if host.flags.c_contiguous and out.flags.c_contiguous:
                out.set(host, stream=self._compute)
            else:
                out[...] = self.cp.asarray(host)
        return out

    def to_host(self, array, out: np.ndarray | None = None) -> np.ndarray:
        # get() on the compute stream waits for the kernels that produced ``array``.
        if out is None:
            return array.get(stream=self._compute)
        array.get(stream=self._compute, out=out)
        self._compute.synchronize()
        return out

    def host_empty(self, shape, dtype) -> np.ndarray:
        """Page-locked (pinned) host memory: copies to and from it run at full speed
        and asynchronously."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        memory = self.cp.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
        return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)

    def record(self, stream=None):
        event = self.cp.cuda.Event(disable_timing=True)
        event.record(stream or self._compute)
        return event

    def wait_event(self, event, stream=None) -> None:
        (stream or self._compute).wait_event(event)

    def comm_stream(self):
        return self._comm

    def pci_bus_id(self) -> str:
        return self.cp.cuda.Device(self.index).pci_bus_id

    def synchronize(self) -> None:
        self._comm.synchronize()
        self._compute.synchronize()


Device = CpuDevice | CudaDevice


def local_rank(comm) -> int:
    """This rank's index among the ranks on its node (a shared-memory sub-communicator)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank()
    finally:
        node.Free()


def open_device(kind: DeviceKind | None, comm) -> Device:
    """``kind`` None: GPUs when cupy sees one on every rank, else the CPU (all ranks
    agree: a run never mixes kinds). Each rank takes GPU (node-local rank mod visible
    GPUs), so ranks spread over a node's GPUs."""
    from mpi4py import MPI

    if kind is DeviceKind.CPU:  # cupy is not even looked at
        return CpuDevice()
    cp = cupy_module()
    if kind is None:
        everywhere = comm.allreduce(cp is not None, op=MPI.LAND)
        if not everywhere:
            return CpuDevice()
    if cp is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise UserError(
            f"--device cuda: cupy is not installed or sees no GPU{hint}; use --device cpu"
        )
    count = cp.cuda.runtime.getDeviceCount()
    return CudaDevice(cp, local_rank(comm) % count)


def gpus_per_rank_ok(comm, device: Device) -> bool:
    """True on every rank when every rank has a GPU and no two ranks of a node share one
    (NCCL refuses that). Collective over ``comm``: all ranks get the same answer, so they
    all pick the same transport. GPUs are told apart by PCI bus id, since a launcher
    that gives each rank its own CUDA_VISIBLE_DEVICES makes every index 0."""
    from mpi4py import MPI

    bus = device.pci_bus_id() if device.kind is DeviceKind.CUDA else None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        ids = node.allgather(bus)
    finally:
        node.Free()
    local_ok = None not in ids and len(set(ids)) == len(ids)
    return bool(comm.allreduce(local_ok, op=MPI.LAND))
