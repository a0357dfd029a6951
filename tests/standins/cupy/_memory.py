"""Device memory: every allocation a stand-in array owns, counted as CuPy's memory pool
counts it, and found again by its address (NCCL is handed raw pointers).

An allocation is the numpy array that owns the bytes, on the device current when it was
made. CuPy rounds every allocation up to 512 bytes and keeps freed blocks cached in its
pool: ``used_bytes`` is what live arrays hold, ``total_bytes`` adds the cached blocks
(here, a freed block is cached under its size and reused by an allocation of the same
rounded size; CuPy also splits larger blocks, which the stand-in does not). Memory hooks
(``cupy.cuda.MemoryHook``) hear every allocation and free as CuPy calls them.

An allocation is freed when its last array goes (CPython frees at once): NCCL calls
still queued on a stream hold its numpy bytes alive but not the allocation, so a queued
send whose array the program dropped is caught when the stream reaches it (on a GPU the
pool would have handed those bytes to the next kernel).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import Counter, OrderedDict

import numpy as np

from cupy import _devices

ALLOCATION_UNIT = 512  # cupy.cuda.memory's rounding


def rounded(nbytes: int) -> int:
    return -(-nbytes // ALLOCATION_UNIT) * ALLOCATION_UNIT


class _Hooks(threading.local):
    def __init__(self) -> None:
        self.registered: OrderedDict[str, object] = OrderedDict()


_hooks = _Hooks()


def get_memory_hooks() -> OrderedDict:
    """This thread's registered hooks by name (CuPy keeps them per thread)."""
    return _hooks.registered


def _call_hooks(method: str, **kwargs) -> None:
    for hook in list(_hooks.registered.values()):
        getattr(hook, method)(**kwargs)


class Allocation:
    """One block of device memory: the numpy array owning its bytes."""

    __slots__ = ("__weakref__", "device", "owner", "ptr", "size")

    def __init__(self, owner: np.ndarray, device: int) -> None:
        self.owner, self.device = owner, device
        self.ptr = owner.__array_interface__["data"][0]
        self.size = rounded(owner.nbytes)
        _registry.add(self)

    def __del__(self) -> None:
        registry = _registry
        if registry is not None:  # None only while the interpreter shuts down
            registry.remove(self)


class _Registry:
    """Live allocations by owner and by address, and the pool's counts per device."""

    def __init__(self) -> None:
        self.by_owner: dict[int, weakref.ref] = {}
        self.starts: list[int] = []  # sorted addresses of live allocations
        self.at: dict[int, weakref.ref] = {}
        self.used: Counter[int] = Counter()  # device -> bytes held by live arrays
        self.cached: dict[int, Counter[int]] = {}  # device -> {block size: free blocks}
        self.lock = threading.Lock()

    def add(self, a: Allocation) -> None:
        if a.size == 0:  # CuPy hands out a null pointer for 0 bytes, outside the pool
            return
        _call_hooks("malloc_preprocess", device_id=a.device, size=a.owner.nbytes, mem_size=a.size)
        with self.lock:
            cache = self.cached.setdefault(a.device, Counter())
            hit = cache[a.size] > 0
            if hit:
                cache[a.size] -= 1
        if not hit:
            _call_hooks("alloc_preprocess", device_id=a.device, mem_size=a.size)
            _call_hooks("alloc_postprocess", device_id=a.device, mem_size=a.size, mem_ptr=a.ptr)
        with self.lock:
            self.used[a.device] += a.size
            self.by_owner[id(a.owner)] = weakref.ref(a)
            if a.ptr not in self.at:
                bisect.insort(self.starts, a.ptr)
            self.at[a.ptr] = weakref.ref(a)
        _call_hooks(
            "malloc_postprocess",
            device_id=a.device,
            size=a.owner.nbytes,
            mem_size=a.size,
            mem_ptr=a.ptr,
            pmem_id=id(a),
        )

    def remove(self, a: Allocation) -> None:
        if a.size == 0:
            return
        kwargs = {"device_id": a.device, "mem_size": a.size, "mem_ptr": a.ptr, "pmem_id": id(a)}
        _call_hooks("free_preprocess", **kwargs)
        with self.lock:
            self.used[a.device] -= a.size
            self.cached.setdefault(a.device, Counter())[a.size] += 1
            self.by_owner.pop(id(a.owner), None)
            ref = self.at.get(a.ptr)
            if ref is not None and ref() in (a, None):
                del self.at[a.ptr]
                i = bisect.bisect_left(self.starts, a.ptr)
                if i < len(self.starts) and self.starts[i] == a.ptr:
                    del self.starts[i]
        _call_hooks("free_postprocess", **kwargs)

    def owning(self, owner: np.ndarray) -> Allocation | None:
        ref = self.by_owner.get(id(owner))
        a = ref() if ref is not None else None
        return a if a is not None and a.owner is owner else None

    def containing(self, ptr: int, nbytes: int) -> Allocation | None:
        """The live allocation holding bytes [ptr, ptr + nbytes), if one does."""
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i < 0:
            return None
        ref = self.at.get(self.starts[i])
        a = ref() if ref is not None else None
        if a is None or ptr + nbytes > a.ptr + a.owner.nbytes:
            return None
        return a


_registry: _Registry | None = _Registry()


def registry() -> _Registry:
    assert _registry is not None
    return _registry


def adopt(array: np.ndarray, device: int | None = None) -> Allocation:
    """The allocation holding ``array``'s bytes: the one it is a view of, or a new one
    for a freshly made array (which then becomes device memory)."""
    owner = array
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    found = registry().owning(owner)
    if found is not None:
        return found
    if owner.base is not None:
        raise ValueError("stand-in: device memory must own its bytes (copy host buffers in)")
    return Allocation(owner, _devices.get_device() if device is None else device)


class MemoryPointer:
    """cupy.cuda.MemoryPointer: where an array's first element lies on its device."""

    def __init__(self, mem: Allocation, ptr: int) -> None:
        self.mem, self.ptr, self.device_id = mem, ptr, mem.device

    def __int__(self) -> int:
        return self.ptr


class MemoryPool:
    """cupy.cuda.MemoryPool's accounting of the current device's memory."""

    def used_bytes(self) -> int:
        return registry().used[_devices.get_device()]

    def free_bytes(self) -> int:
        cache = registry().cached.get(_devices.get_device(), Counter())
        return sum(size * count for size, count in cache.items())

    def total_bytes(self) -> int:
        return self.used_bytes() + self.free_bytes()

    def n_free_blocks(self) -> int:
        return sum(registry().cached.get(_devices.get_device(), Counter()).values())

    def free_all_blocks(self, stream=None) -> None:
        registry().cached.pop(_devices.get_device(), None)


_default_pool = MemoryPool()


def get_default_memory_pool() -> MemoryPool:
    return _default_pool
