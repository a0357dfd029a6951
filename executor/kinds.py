"""The executor's device and transport choices (no MPI or cupy import: the CLI parses
them before MPI starts)."""

from __future__ import annotations

from enum import Enum


class DeviceKind(Enum):
    CPU = "cpu"
    CUDA = "cuda"


class TransportKind(Enum):
    AUTO = "auto"
    MPI = "mpi"
    MPI_HOST = "mpi-host"
    MPI_CUDA = "mpi-cuda"
    NCCL = "nccl"
