"""The stand-in's GPUs: how many there are, which one this thread uses, and the CUDA
runtime's errors.

There are ``CUPY_STANDIN_DEVICES`` of them (4 unless set), fewer when
``CUDA_VISIBLE_DEVICES`` lists fewer (as CUDA hides the others; an empty list hides all,
and then ``getDeviceCount`` raises ``cudaErrorNoDevice`` as CUDA does). Four lets one
node's four ranks each have a GPU of their own, as NCCL wants.
"""

from __future__ import annotations

import os
import threading

DEFAULT_DEVICES = 4
# cudaError_t values and CUDA's own words for the ones the stand-in raises.
ERRORS = {
    35: ("cudaErrorInsufficientDriver", "CUDA driver version is insufficient for CUDA runtime"),
    100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
}
NO_DEVICE, INVALID_DEVICE, INVALID_HANDLE, ILLEGAL_ADDRESS = 100, 101, 400, 700


class CUDARuntimeError(RuntimeError):
    """As cupy_backends.cuda.api.runtime.CUDARuntimeError: built from the status code."""

    def __init__(self, status: int) -> None:
        self.status = status
        name, text = ERRORS.get(status, (f"cudaError {status}", "unknown error"))
        super().__init__(f"{name}: {text}")

    def __reduce__(self):
        return (type(self), (self.status,))


def device_count() -> int:
    count = int(os.environ.get("CUPY_STANDIN_DEVICES", DEFAULT_DEVICES))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    return count


class _Current(threading.local):
    device = 0


_current = _Current()


def get_device() -> int:
    return _current.device


def set_device(index: int) -> None:
    if not 0 <= index < device_count():
        raise CUDARuntimeError(INVALID_DEVICE)
    _current.device = index


def check_device_count() -> int:
    """The device count, or CUDA's error where there is none."""
    count = device_count()
    if count == 0:
        raise CUDARuntimeError(NO_DEVICE)
    return count
