"""cupy.cuda.memory: the pool's accounting and array data pointers."""

from __future__ import annotations

from cupy._memory import ALLOCATION_UNIT, MemoryPointer, MemoryPool, get_default_memory_pool

__all__ = ["ALLOCATION_UNIT", "MemoryPointer", "MemoryPool", "get_default_memory_pool"]
