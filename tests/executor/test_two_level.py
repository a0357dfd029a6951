"""The MPI transport's two-level all-reduce over ranks on several hosts
(``soap/collectives.py HostRings``): sums equal numpy's, every member gets the same
bits, a rank sends what ``host_ring_bytes_sent`` says, and sizes above
``TWO_LEVEL_MAX_BYTES`` take the flat ring. The hosts are pretended
(``hosts_of(comm, per_host)``: every ``per_host`` consecutive ranks); test_multinode.py
has MPI's own two nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onnx2soap.ir import DType
from onnx2soap.soap.collectives import (
    host_ring_bytes_sent,
    host_rings,
    ring_bytes_sent,
    takes_two_levels,
)
from tests.executor.mpi import MPIEXEC, assert_same_training, make_plan, mpirun, reference

HERE = Path(__file__).parent
pytestmark = pytest.mark.mpi


def test_host_rings_need_several_hosts_with_as_many_ranks_each() -> None:
    assert host_rings((0, 1, 2, 3), (0, 0, 1, 1)).hosts == ((0, 1), (2, 3))
    assert host_rings((0, 1, 2, 3), (0, 0, 1, 1)).across() == ((0, 2), (1, 3))
    assert host_rings((3, 2, 5, 4), (0, 0, 1, 1, 2, 2)).hosts == ((2, 3), (4, 5))
    assert host_rings((0, 1, 2, 3), (0, 0, 0, 0)) is None  # one host
    assert host_rings((0, 2), (0, 0, 1, 1)) is None  # a rank a host: the flat ring
    assert host_rings((0, 1, 2), (0, 0, 1)) is None  # uneven
    assert host_rings((0, 1), None) is None


@pytest.mark.parametrize(("ranks", "per_host"), [(4, 2), (6, 3)])
def test_two_level_sums_equal_numpy_with_the_same_bits_everywhere(
    tmp_path: Path, ranks: int, per_host: int
) -> None:
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    command = [str(MPIEXEC), "-n", str(ranks), sys.executable, str(HERE / "two_level_driver.py")]
    done = subprocess.run(
        [*command, str(per_host), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    docs = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(ranks)]
    hosts = tuple(r - r % per_host for r in range(ranks))
    by_sum: dict[tuple, set[str]] = {}
    for rank, doc in enumerate(docs):
        for row in doc:
            devices, numel = tuple(row["devices"]), row["numel"]
            assert row["close"], f"rank {rank}: {row}"
            rings = host_rings(devices, hosts)
            two_level = rings is not None and takes_two_levels(8 * numel)
            assert row["two_level"] == two_level, f"rank {rank}: {row}"
            k = len(devices)
            want = (
                host_ring_bytes_sent(numel, rings, rank, 8)
                if two_level
                else ring_bytes_sent(numel, k, devices.index(rank), 8)
            )
            assert row["sent"] == want, f"rank {rank}: {row}"
            by_sum.setdefault((devices, numel), set()).add(row["bits"])
    assert any(len(devices) < ranks for devices, _ in by_sum)  # the subset ran too
    assert all(len(bits) == 1 for bits in by_sum.values()), by_sum


@pytest.mark.parametrize("model", ["bnnet", "tied"])
def test_data_parallel_over_pretended_hosts_trains_like_one_device(
    export_model, tmp_path: Path, model: str
) -> None:
    """4 ranks as 2 hosts (``--ranks-per-host 2``): the gradient buckets' and the
    BatchNorms' statistics all-reduces run in two levels; losses and weights equal one
    device's."""
    path = export_model(model)
    plan, one = tmp_path / "four.json", tmp_path / "one.json"
    make_plan(path, plan, 4, 8, "data-parallel")
    make_plan(path, one, 1, 8, "data-parallel")
    losses, weights = reference(one, 3, DType.FLOAT64, 0.05)
    args = ["--steps", "3", "--lr", "0.05", "--dtype", "float64", "--ranks-per-host", "2"]
    run = mpirun(plan, 4, tmp_path, *args, timeout=300)
    assert_same_training(run, losses, weights, rtol=1e-10)
