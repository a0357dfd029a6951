"""``cupy_module`` says "no GPU" only for the three cases that mean it (cupy not installed,
no driver, no device) and raises for a broken setup; ``--device cpu`` never looks at cupy.
A fake cupy stands in for each case."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from mpi4py import MPI

from executor.device import CpuDevice, cupy_module, open_device
from executor.kinds import DeviceKind


class _CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        super().__init__(f"cudaError {status}")
        self.status = status


def _fake_cupy(count: int | None = None, status: int | None = None) -> ModuleType:
    """A cupy whose getDeviceCount returns ``count`` or raises CUDA error ``status``."""

    def get_device_count() -> int:
        if status is not None:
            raise _CUDARuntimeError(status)
        assert count is not None
        return count

    runtime = SimpleNamespace(CUDARuntimeError=_CUDARuntimeError, getDeviceCount=get_device_count)
    module = ModuleType("cupy")
    module.cuda = SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return module


def test_cupy_not_installed_is_no_gpu(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy: ModuleNotFoundError
    assert cupy_module() is None


@pytest.mark.parametrize("status", [35, 100])  # no driver, no device
def test_no_driver_or_no_device_is_no_gpu(monkeypatch, status: int) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(status=status))
    assert cupy_module() is None


def test_a_gpu_is_cupy(monkeypatch) -> None:
    fake = _fake_cupy(count=2)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert cupy_module() is fake


def test_another_driver_error_is_raised(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(status=803))  # driver mismatch
    with pytest.raises(RuntimeError, match="cudaError 803"):
        cupy_module()


def test_a_cupy_that_fails_to_import_is_raised(monkeypatch, tmp_path: Path) -> None:
    package = tmp_path / "cupy"
    package.mkdir()
    (package / "__init__.py").write_text(
        'raise ImportError("libcudart.so.12: cannot open shared object file")\n'
    )
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="libcudart"):
        cupy_module()
    # --device cpu never imports it
    assert isinstance(open_device(DeviceKind.CPU, MPI.COMM_SELF), CpuDevice)
