"""The executor's device and transport choices (no MPI or cupy import: the CLI parses
them before MPI starts). ``DeviceKind`` is onnx2soap's, shared with the cost database's
fingerprints."""

from __future__ import annotations

from enum import Enum

from onnx2soap.device_kind import DeviceKind

__all__ = ["DeviceKind", "TransportKind"]


class TransportKind(Enum):
    AUTO = "auto"
    MPI = "mpi"
    MPI_HOST = "mpi-host"
    MPI_CUDA = "mpi-cuda"
    NCCL = "nccl"
