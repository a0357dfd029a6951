"""The cupy stand-in (tests/standins) refuses what CuPy refuses, counts memory as CuPy's
pool does, and runs NCCL's calls in stream order between ranks: what the GPU tests rely
on it for. Each expectation is CuPy's documented behaviour (its exception type and
words), or NCCL's. Runs in ``make test``'s stand-in pass only (marked ``gpu``; skipped
where ``cupy`` is not the stand-in).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.executor.mpi import MPIEXEC
from tests.optional import cupy_or_skip, is_standin

cp = cupy_or_skip()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not is_standin(cp), reason="tests the stand-in, not CuPy"),
]
ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("cupy_standin_driver.py")


def test_no_implicit_conversion_to_the_host() -> None:
    x = cp.arange(3.0)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(x)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.testing.assert_allclose(x, [0.0, 1.0, 2.0])
    assert cp.asnumpy(x).tolist() == [0.0, 1.0, 2.0] and float(x.sum()) == 3.0


def test_no_implicit_conversion_to_the_device() -> None:
    x, host = cp.arange(3.0), np.ones(3)
    for mixed in (lambda: x + host, lambda: host + x, lambda: cp.exp(host)):
        with pytest.raises(TypeError, match=re.escape("Unsupported type <class 'numpy.ndarray'>")):
            mixed()
    with pytest.raises(TypeError, match="incorrect type"):
        cp.ascontiguousarray(host)
    with pytest.raises(ValueError, match=r"non-scalar numpy\.ndarray cannot"):
        x[...] = host
    x[[0, 2]] = np.array([5.0, 7.0])  # advanced indexing copies host values over
    x[1] = np.float64(6.0)  # so does a scalar
    assert cp.asnumpy(x).tolist() == [5.0, 6.0, 7.0] and (x * np.float32(2)).dtype == x.dtype


def test_asarray_copies_host_data() -> None:
    host = np.zeros(2)
    device = cp.asarray(host)
    host[0] = 1.0
    assert cp.asnumpy(device).tolist() == [0.0, 0.0] and cp.asarray(device) is device


def test_set_and_get_check_what_cupy_checks() -> None:
    x = cp.zeros((2, 3))
    with pytest.raises(TypeError, match="float32 array cannot be set to float64 array"):
        x.set(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="Shape mismatch"):
        x.set(np.zeros(6))
    with pytest.raises(TypeError, match=r"Only numpy\.ndarray can be set"):
        x.set([[0.0] * 3] * 2)
    with pytest.raises(ValueError, match="Shape mismatch"):
        x.get(out=np.empty((3, 2)))


def test_reductions_give_device_arrays_and_numpy_functions_dispatch() -> None:
    x = cp.arange(6.0).reshape(2, 3)
    total = np.sum(x)  # __array_function__: cupy.sum
    assert isinstance(total, cp.ndarray) and total.shape == () and float(total) == 15.0
    assert isinstance(np.exp(x), cp.ndarray)  # __array_ufunc__: cupy.exp
    assert isinstance(x.max(axis=0), cp.ndarray)


def test_an_array_of_another_gpu_is_refused() -> None:
    with cp.cuda.Device(1):
        elsewhere = cp.zeros(3)
    with pytest.raises(ValueError, match=r"resides \(1\) is different from the current device"):
        elsewhere + 1.0


def test_the_pool_counts_live_bytes_and_keeps_freed_blocks() -> None:
    pool = cp.get_default_memory_pool()
    used, total = pool.used_bytes(), pool.total_bytes()
    x = cp.zeros(1000, dtype=cp.uint8)  # 1000 bytes: two of the pool's 512-byte units
    assert pool.used_bytes() == used + 1024
    del x
    # the block is kept for reuse (it may have come from the cache already)
    assert pool.used_bytes() == used and pool.free_bytes() >= 1024
    assert pool.total_bytes() == pool.used_bytes() + pool.free_bytes() >= total
    seen: list[tuple[str, int]] = []

    class Hook(cp.cuda.MemoryHook):
        name = "test"

        def malloc_postprocess(self, **kwargs) -> None:
            seen.append(("malloc", kwargs["mem_size"]))

        def free_postprocess(self, **kwargs) -> None:
            seen.append(("free", kwargs["mem_size"]))

    with Hook():
        y = cp.ones(100)  # 800 bytes
        view = y[10:]  # a view allocates nothing
        del y, view
    assert seen == [("malloc", 1024), ("free", 1024)]


def _two_ranks(case: str, folder: Path, **env: str) -> list[dict]:
    """What each rank of the driver's case wrote (a rank killed once the other left
    with its error writes nothing)."""
    done = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, str(DRIVER), case, str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "CUPY_STANDIN_STALL_S": "3", **env},
    )
    docs = [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]
    assert docs, done.stderr[-2000:]
    return docs


@pytest.mark.mpi
def test_nccl_moves_data_in_stream_order(tmp_path: Path) -> None:
    docs = _two_ranks("exchange", tmp_path)
    assert len(docs) == 2
    assert [d["before"] for d in docs] == [[0.0] * 4] * 2  # not landed before its wait
    assert docs[0]["after"] == [10.0, 11.0, 12.0, 13.0] and docs[1]["after"] == [0.0, 1.0, 2.0, 3.0]
    assert [d["summed"] for d in docs] == [[3.0] * 3] * 2


@pytest.mark.mpi
def test_ranks_that_both_send_first_hang_as_on_nccl(tmp_path: Path) -> None:
    docs = _two_ranks("crossed", tmp_path)
    assert any("NCCL would hang here" in d["error"] for d in docs), docs


@pytest.mark.mpi
def test_two_ranks_on_one_gpu_are_refused_as_by_nccl(tmp_path: Path) -> None:
    docs = _two_ranks("same-gpu", tmp_path, CUPY_STANDIN_DEVICES="1")
    assert any("Duplicate GPU detected" in d["error"] for d in docs), docs


@pytest.mark.mpi
def test_a_send_freed_before_it_runs_is_refused(tmp_path: Path) -> None:
    docs = _two_ranks("freed", tmp_path)
    assert "freed while the call was queued" in docs[0]["error"], docs
