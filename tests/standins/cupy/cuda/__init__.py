"""cupy.cuda: devices, streams, events, memory, hooks, pinned host memory (and, as a
submodule imported on its own, ``cupy.cuda.nccl``)."""

from __future__ import annotations

from cupy.cuda import memory, memory_hook, pinned_memory, runtime, stream
from cupy.cuda.device import Device
from cupy.cuda.memory import MemoryPointer, MemoryPool
from cupy.cuda.memory_hook import MemoryHook
from cupy.cuda.pinned_memory import PinnedMemoryPointer, alloc_pinned_memory
from cupy.cuda.stream import Event, Stream, get_current_stream, get_elapsed_time

__all__ = [
    "Device",
    "Event",
    "MemoryHook",
    "MemoryPointer",
    "MemoryPool",
    "PinnedMemoryPointer",
    "Stream",
    "alloc_pinned_memory",
    "get_current_stream",
    "get_elapsed_time",
    "is_available",
    "memory",
    "memory_hook",
    "pinned_memory",
    "runtime",
    "stream",
]


def is_available() -> bool:
    try:
        return runtime.getDeviceCount() > 0
    except runtime.CUDARuntimeError:
        return False
