"""Host memory between steps: freed memory kept for reuse, and the Python heap settled.

Keep freed host memory for reuse instead of returning it to the OS after every step.

glibc serves large allocations (a tile, an im2col matrix) from fresh ``mmap``s and
returns them on ``free``, so every step faults every page of its temporaries in again:
on the example CNN that was a third of a CPU step. Raising the mmap and trim thresholds
makes freed blocks stay in the heap, where the next step's arrays of the same sizes
find them, much as a caching allocator does on a GPU. The process's resident memory
then stays at its peak, which is what the memory model predicts anyway.

The mmap threshold stops at 32 MiB, though: a larger block was still mmapped afresh and
faulted in page by page at every step. A GPT's logits and their gradient (1024 tokens
by a 50,257-word vocabulary: 206 MB each) and its tied embedding's gradient (103 MB)
are such blocks; faulting them in cost a GPT-2 step (width 512, 4 layers, batch 2)
about a third of its time, as much as the vocabulary's matrix products. No mmap at
all (``M_MMAP_MAX`` 0) serves them from the heap too, which keeps them when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4  # malloc.h
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's cap on 64-bit: larger blocks are mmapped if any is
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
        # no block mmapped, whatever its size: blocks over the threshold's cap too are
        # kept for reuse (a non-main arena's block too large for its heaps falls back
        # to the main arena, as glibc retries where an arena fails)
        (M_MMAP_MAX, 0),
    )
    return all(mallopt(option, value) == 1 for option, value in settings)


def settle_python_heap() -> None:
    """Move every Python object alive now out of the garbage collector's reach.

    Call it once the first step has made what the run keeps (the program, buffers,
    pools). Python's cyclic collector otherwise rescans those objects, hundreds of
    thousands of them, whenever enough new ones are allocated: on resnet18 (one CPU
    rank) about a hundred collections in a dozen steps, 20-50 ms in all, one of them a
    30 ms full collection inside a step. Under MPI a pause on one rank stalls every rank
    that next waits for it. Frozen, the collector looks only at what later steps make
    (a dozen quick collections in the same run). Automatic collection stays on: a
    step's own cycles are still freed. ``release_python_heap`` undoes it when the steps
    are over (a process that trains again, as tests do, would otherwise never collect
    the cycles it dropped)."""
    gc.collect()
    gc.freeze()


def release_python_heap() -> None:
    """Hand the objects ``settle_python_heap`` froze back to the collector."""
    gc.unfreeze()
