"""Several nodes: the executor under ``mpiexec -f HOSTFILE``, on a plan made for a machine
file that describes the nodes, trains like one device (docs/multinode.md's recipe, on
one host).

The hostfile names this host twice, as ``localhost`` and as ``127.0.0.1``, two ranks
each. MPICH's hydra starts one proxy per distinct host name, and MPI takes each proxy's
ranks for a node of its own: shared-memory communicators of two ranks, and messages
between the two "nodes" through the network module, as between real nodes. (Two lines
of ``localhost`` are merged into one node of four ranks.) ``-launcher fork`` starts both
proxies without ssh, which a sandbox or CI runner lacks.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from onnx2soap.cli import main as onnx2soap_main
from onnx2soap.ir import DType
from onnx2soap.sim.machine import load_machine_file
from tests.executor.mpi import MPIEXEC, assert_same_training, make_plan, mpirun, reference

NODES, PER_NODE = 2, 2
RANKS = NODES * PER_NODE
BATCH, STEPS, LR = 8, 3, 0.05
HOSTFILE = "localhost:2\n127.0.0.1:2\n"  # NAME:SLOTS per line; ranks fill hosts in order

pytestmark = pytest.mark.mpi


@functools.cache
def _hydra() -> bool:
    try:
        done = subprocess.run(
            [str(MPIEXEC), "--version"], capture_output=True, text=True, timeout=30
        )
    except OSError:
        return False
    return "HYDRA" in done.stdout


@pytest.fixture
def launch(tmp_path: Path) -> tuple[str, ...]:
    """mpiexec's options for two "nodes" on this host."""
    if not _hydra():
        pytest.skip("the hostfile and -launcher fork are MPICH hydra's options")
    hosts = tmp_path / "hosts"
    hosts.write_text(HOSTFILE)
    return ("-launcher", "fork", "-f", str(hosts))


def machine_yaml(nodes: int, per_node: int) -> str:
    """A machine file of ``nodes`` nodes of ``per_node`` CPU ranks. Devices are numbered
    node by node, as the hostfile places ranks; within a node a message crosses the two
    ranks' shared-memory ports, between nodes the two nodes' NICs as well. Its
    ``nodes`` say which node each rank is on: all-reduces over both are priced in the
    MPI transport's two levels, as the executor, seeing MPI's two nodes, runs them."""
    figures = "peak_flops: 2.0e10, memory_bandwidth: 8.0e9, memory: 2147483648"
    total = nodes * per_node
    of = ", ".join(str(d // per_node) for d in range(nodes * per_node))
    lines = ["name: two-nodes", "transfers_use_compute: true", f"nodes: {{of: [{of}]}}"]
    lines.append("devices:")
    for d in range(total):
        lines.append(f"  - {{name: node{d // per_node}-rank{d % per_node}, {figures}}}")
    lines.append("links:")
    for d in range(total):
        for way in ("out", "in"):
            lines.append(f"  - {{name: shm{d}-{way}, bandwidth: 4.0e9, latency: 2.5e-6}}")
    for n in range(nodes):
        for way in ("out", "in"):
            lines.append(f"  - {{name: nic{n}-{way}, bandwidth: 1.25e9, latency: 1.0e-5}}")
    lines.append("routes:")
    for a in range(total):
        for b in range(total):
            if a == b:
                continue
            hops = [f"shm{a}-out", f"shm{b}-in"]
            if a // per_node != b // per_node:
                hops[1:1] = [f"nic{a // per_node}-out", f"nic{b // per_node}-in"]
            lines.append(f"  - {{src: {a}, dst: {b}, links: [{', '.join(hops)}]}}")
    return "\n".join(lines) + "\n"


def test_the_machine_file_routes_between_nodes_through_their_nics(tmp_path: Path) -> None:
    path = tmp_path / "two-nodes.yaml"
    path.write_text(machine_yaml(NODES, PER_NODE))
    machine = load_machine_file(path)
    names = {pair: [machine.links[i].name for i in machine.route(*pair)] for pair in machine.routes}
    assert names[(0, 1)] == ["shm0-out", "shm1-in"]
    assert names[(1, 2)] == ["shm1-out", "nic0-out", "nic1-in", "shm2-in"]
    assert names[(3, 0)] == ["shm3-out", "nic1-out", "nic0-in", "shm0-in"]
    nodes = [d.name for d in machine.devices]
    assert nodes == ["node0-rank0", "node0-rank1", "node1-rank0", "node1-rank1"]


def test_the_hostfile_makes_two_nodes_and_each_rank_its_gpu_index(
    launch: tuple[str, ...],
) -> None:
    """Ranks 0-1 on the first node and 2-3 on the second, as the machine file numbers
    its devices; each rank's node-local rank, by which ``--device cuda`` picks its GPU
    (``executor/device.py``: node-local rank mod visible GPUs), starts at 0 on each node."""
    script = (
        "import json; from mpi4py import MPI; from executor.device import local_rank\n"
        "c = MPI.COMM_WORLD\n"
        "node = c.Split_type(MPI.COMM_TYPE_SHARED, key=c.Get_rank())\n"
        "seen = c.gather([c.Get_rank(), local_rank(c), node.Get_size()])\n"
        "if c.Get_rank() == 0: print(json.dumps(seen), flush=True)\n"  # one writer
    )
    command = [str(MPIEXEC), *launch, "-n", str(RANKS), sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == [[0, 0, 2], [1, 1, 2], [2, 0, 2], [3, 1, 2]]


def test_a_plan_for_two_nodes_trains_like_one_device(
    example_onnx: Path, tmp_path: Path, launch: tuple[str, ...]
) -> None:
    """Data parallelism planned on the two-node machine file: every gradient bucket is
    summed over all four ranks, in two levels (inside each node, then across: MPI
    reports the ranks' nodes); the losses and final weights equal one device's."""
    machine = tmp_path / "two-nodes.yaml"
    machine.write_text(machine_yaml(NODES, PER_NODE))
    plan = tmp_path / "two-nodes.json"
    args = ["plan", str(example_onnx), "--batch", str(BATCH), "--machine", str(machine)]
    assert onnx2soap_main([*args, "--strategy", "data-parallel", "-o", str(plan), "--quiet"]) == 0
    doc = json.loads(plan.read_text())
    assert doc["devices"] == RANKS and doc["machine"].endswith("two-nodes.yaml")
    one = tmp_path / "one.json"
    make_plan(example_onnx, one, 1, BATCH, "data-parallel")
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    args = ["--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64"]
    run = mpirun(plan, RANKS, tmp_path, *args, launch=launch, timeout=300)
    assert_same_training(run, losses, weights, rtol=1e-10)
    assert all(sent > 0 for sent in run.bytes_sent)


def test_the_probe_describes_the_two_nodes(launch: tuple[str, ...], tmp_path: Path) -> None:
    """``machine probe`` under MPI's two nodes writes which node each rank is on, and a
    route between nodes through the nodes' network links."""
    out = tmp_path / "probed.yaml"
    module = [sys.executable, "-m", "onnx2soap.measure.probe", "-o", str(out), "--seconds", "0.05"]
    command = [str(MPIEXEC), *launch, "-n", str(RANKS), *module]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    machine = load_machine_file(out)
    assert machine.nodes is not None and machine.nodes.of == (0, 0, 1, 1)
    names = [machine.links[i].name for i in machine.route(1, 2)]
    assert names == ["rank1-out", "host-nic0-out", "host-nic1-in", "rank2-in"]
    assert [machine.links[i].name for i in machine.route(0, 1)] == ["rank0-out", "rank1-in"]
