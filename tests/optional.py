"""Optional imports for tests, narrowed to the failure they mean.

A package that is not installed skips the tests that need it; one that is installed but
fails to import (a missing shared library, a version clash), or a GPU driver that answers
with an error other than "no driver" or "no device", fails them: a broken install must
not pass as a skipped test.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

from executor.device import cupy_module


def require(name: str) -> ModuleType:
    """``import name``, or skip when the package (its top level) is not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or e.name != name.split(".")[0]:
            raise  # the package is there; something it imports is not
        pytest.skip(f"{name} is not installed", allow_module_level=True)


def cupy_or_skip() -> ModuleType:
    """cupy, where it is installed and sees a GPU (the stand-in's count as GPUs);
    skip where it is not installed or there is no GPU."""
    cp = cupy_module()
    if cp is None:
        pytest.skip("needs cupy and a CUDA GPU", allow_module_level=True)
    return cp


def is_standin(cp: ModuleType) -> bool:
    """Whether ``cp`` is the numpy stand-in of tests/standins, not CuPy."""
    return cp.__version__.endswith("+standin")
