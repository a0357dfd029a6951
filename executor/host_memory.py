"""Keep freed host memory for reuse instead of returning it to the OS after every step.

glibc serves large allocations (a tile, an im2col matrix) from fresh ``mmap``s and
returns them on ``free``, so every step faults every page of its temporaries in again:
on the example CNN that was a third of a CPU step. Raising the mmap and trim thresholds
makes freed blocks stay in the heap, where the next step's arrays of the same sizes
find them, much as a caching allocator does on a GPU. The process's resident memory
then stays at its peak, which is what the memory model predicts anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's cap on 64-bit: larger blocks are always mmapped
KEEP = 1 << 30


def keep_freed_memory() -> bool:
    """True when the C library took the settings (glibc); elsewhere a no-op."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
        (M_TRIM_THRESHOLD, KEEP),
        (M_TOP_PAD, 64 << 20),
    )
    return all(mallopt(option, value) == 1 for option, value in settings)
