"""cupy.cuda.MemoryHook: callbacks on every allocation from and free to the pool,
registered per thread by ``with hook:``, called with CuPy's keyword arguments."""

from __future__ import annotations

from cupy._memory import get_memory_hooks


class MemoryHook:
    name = "MemoryHook"

    def __enter__(self):
        hooks = get_memory_hooks()
        if self.name in hooks:
            raise KeyError(f"memory hook {self.name} already exists")
        hooks[self.name] = self
        return self

    def __exit__(self, *_) -> None:
        del get_memory_hooks()[self.name]

    def alloc_preprocess(self, **kwargs) -> None:
        """Before memory is taken from the device (a pool miss): device_id, mem_size."""

    def alloc_postprocess(self, **kwargs) -> None:
        """After: device_id, mem_size, mem_ptr."""

    def malloc_preprocess(self, **kwargs) -> None:
        """Before memory is taken from the pool: device_id, size, mem_size."""

    def malloc_postprocess(self, **kwargs) -> None:
        """After: device_id, size, mem_size, mem_ptr, pmem_id."""

    def free_preprocess(self, **kwargs) -> None:
        """Before memory goes back to the pool: device_id, mem_size, mem_ptr, pmem_id."""

    def free_postprocess(self, **kwargs) -> None:
        """After: device_id, mem_size, mem_ptr, pmem_id."""
