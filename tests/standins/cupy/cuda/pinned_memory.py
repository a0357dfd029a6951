"""Page-locked host memory: ordinary host bytes here, with CuPy's ``ptr`` and ``size``;
numpy reads and writes them in place (``numpy.frombuffer``), as it does CuPy's."""

from __future__ import annotations

import numpy as np


class PinnedMemoryPointer(bytearray):
    """The buffer of ``alloc_pinned_memory``: ``size`` bytes at ``ptr`` (they never
    move: the buffer is exported for as long as it lives)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._view = np.frombuffer(self, dtype=np.uint8)  # pins the bytes in place
        self.size = size

    @property
    def ptr(self) -> int:
        return self._view.ctypes.data

    def __int__(self) -> int:
        return self.ptr


def alloc_pinned_memory(size: int) -> PinnedMemoryPointer:
    return PinnedMemoryPointer(int(size))
