"""cupy.cuda.Device: one GPU by index; ``use`` makes it this thread's."""

from __future__ import annotations

from cupy.cuda import runtime
from cupy.cuda.stream import synchronize_device


class Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = runtime.getDevice() if device is None else int(device)
        self._previous: list[int] = []

    def __int__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return self.id

    def __enter__(self) -> Device:
        self._previous.append(runtime.getDevice())
        runtime.setDevice(self.id)
        return self

    def __exit__(self, *args) -> None:
        runtime.setDevice(self._previous.pop())

    def use(self) -> None:
        runtime.setDevice(self.id)

    def synchronize(self) -> None:
        synchronize_device(self.id)

    @property
    def pci_bus_id(self) -> str:
        return runtime.deviceGetPCIBusId(self.id)

    @property
    def compute_capability(self) -> str:
        props = runtime.getDeviceProperties(self.id)
        return f"{props['major']}{props['minor']}"

    @property
    def mem_info(self) -> tuple[int, int]:
        with self:
            return runtime.memGetInfo()
