"""The MPI transport's all-reduces over ranks taken for several hosts: ``mpiexec -n N
python two_level_driver.py PER_HOST OUT`` sums float64 arrays of many sizes (empty
chunks included) over every rank and over a subset, and writes per rank to
OUT/rank-R.json whether each sum equals numpy's and its bits, whether it ran in two
levels, and the bytes the rank sent (run by tests/executor/test_two_level.py)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from executor.device import CpuDevice
from executor.transport import MpiTransport, _Chain, hosts_of
from onnx2soap.soap.collectives import TWO_LEVEL_MAX_BYTES

SIZES = (1, 3, 7, 64, 1001, TWO_LEVEL_MAX_BYTES // 8, TWO_LEVEL_MAX_BYTES // 8 + 1)


def values(rank: int, numel: int) -> np.ndarray:
    return np.random.default_rng([rank, numel]).standard_normal(numel)


def main() -> None:
    per_host, out = int(sys.argv[1]), Path(sys.argv[2])
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    transport = MpiTransport(comm, CpuDevice(), hosts=hosts_of(comm, per_host))
    every = tuple(range(ranks))
    # the first rank of each host left out: still several hosts, one rank fewer each
    some = tuple(r for r in every if r % per_host != 0)
    transport.make_groups([every, some])
    found = []
    for devices in (every, some):
        if rank not in devices:
            continue
        for numel in SIZES:
            array = values(rank, numel)
            before = transport.bytes_sent
            pending = transport.allreduce(array, devices)
            transport.wait(pending)
            transport.end_step()
            want = sum(values(r, numel) for r in devices)
            found.append(
                {
                    "devices": list(devices),
                    "numel": numel,
                    "close": bool(np.allclose(array, want, rtol=1e-12, atol=1e-12)),
                    "bits": hashlib.sha256(array.tobytes()).hexdigest(),
                    "two_level": isinstance(pending.ring, _Chain),
                    "sent": transport.bytes_sent - before,
                }
            )
    transport.close()
    (out / f"rank-{rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
