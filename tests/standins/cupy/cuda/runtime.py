"""cupy.cuda.runtime: the device count, the current device, device properties."""

from __future__ import annotations

from cupy._devices import (
    CUDARuntimeError,
    check_device_count,
    device_count,
    get_device,
    set_device,
)
from cupy.cuda.stream import STREAM_LEGACY as streamLegacy
from cupy.cuda.stream import STREAM_PER_THREAD as streamPerThread
from cupy.cuda.stream import synchronize_device

TOTAL_MEMORY = 16 << 30  # what each stand-in GPU says it has
RUNTIME_VERSION = 12080  # CUDA 12.8, as cudaRuntimeGetVersion encodes it

__all__ = [
    "CUDARuntimeError",
    "deviceGetPCIBusId",
    "deviceSynchronize",
    "driverGetVersion",
    "getDevice",
    "getDeviceCount",
    "getDeviceProperties",
    "memGetInfo",
    "runtimeGetVersion",
    "setDevice",
    "streamLegacy",
    "streamPerThread",
]


def getDeviceCount() -> int:
    return check_device_count()


def getDevice() -> int:
    check_device_count()
    return get_device()


def setDevice(device: int) -> None:
    set_device(int(device))


def _valid(device: int) -> int:
    if not 0 <= device < device_count():
        raise CUDARuntimeError(101)
    return device


def getDeviceProperties(device: int) -> dict:
    _valid(device)
    return {
        "name": b"cupy stand-in (numpy)",
        "totalGlobalMem": TOTAL_MEMORY,
        "multiProcessorCount": 1,
        "major": 9,
        "minor": 0,
        "pciDomainID": 0,
        "pciBusID": 0x10 + device,
        "pciDeviceID": 0,
    }


def deviceGetPCIBusId(device: int) -> str:
    return f"0000:{0x10 + _valid(device):02X}:00.0"


def runtimeGetVersion() -> int:
    return RUNTIME_VERSION


def driverGetVersion() -> int:
    return RUNTIME_VERSION


def deviceSynchronize() -> None:
    synchronize_device(getDevice())


def memGetInfo() -> tuple[int, int]:
    from cupy._memory import registry

    used = registry().used[getDevice()]
    return TOTAL_MEMORY - used, TOTAL_MEMORY
