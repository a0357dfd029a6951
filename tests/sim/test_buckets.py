"""The simulator's gradient buckets (soap/buckets.py): a bucket's gradients are summed by
one ring per device set, priced as NCCL runs it (sim/collectives.py), which starts once
the bucket's last gradient is made and overlaps the rest of the backward."""

from __future__ import annotations

import pytest

from benchmarks.buckets import LAYERS, write_chain
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.collectives import Collective, collective_time, group_shape
from onnx2soap.sim.presets import resolve_machine
from onnx2soap.sim.simulate import simulate
from onnx2soap.soap import Partitioner, analyze

MACHINE = "dgx-h100:2"  # 16 H100s on two nodes


@pytest.fixture(scope="module")
def data_parallel_chain(tmp_path_factory):
    path = write_chain(tmp_path_factory.mktemp("chain") / "m.onnx")
    graph = load_model(path, batch=32).graph
    machine = resolve_machine(MACHINE)
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), machine.size))
    return pg, machine


def _rings(pg, machine, bucket_mb: float):
    """(task graph, timeline, the weight rings' task numbers)."""
    tg = Simulator(machine, RooflineCost(), bucket_mb=bucket_mb).task_graph(pg, names=True)
    rings = [i for i, name in enumerate(tg.names) if name.startswith("allreduce bucket")]
    return tg, simulate(tg), rings


def _nccl_all_reduce(machine, nbytes: int) -> float:
    shape = group_shape(machine, range(machine.size))
    return collective_time(shape, Collective.ALL_REDUCE, nbytes).seconds


def test_sixty_four_gradients_in_16_mib_buckets_cost_two_rings(data_parallel_chain):
    """DDP's first bucket of 1 MiB (the last 4 layers' gradients), then one of the 60
    others' 15 MiB: two rings, against 64 of 256 KiB with a bucket a weight."""
    pg, machine = data_parallel_chain
    tg, timeline, rings = _rings(pg, machine, 16)
    every = ",".join(map(str, range(16)))
    assert [tg.names[i] for i in rings] == [f"allreduce bucket {b} on {every}" for b in (0, 1)]
    first, second = rings
    assert tg.duration[first] == _nccl_all_reduce(machine, 1 << 20)
    assert tg.duration[second] == _nccl_all_reduce(machine, 15 << 20)
    assert tg.nbytes[rings].sum() == 2 * 15 * (16 << 20)  # what 16 members send of 16 MiB
    # each waits for its last gradient: layer 60's backward, then layer 0's
    for ring, layer in ((first, 60), (second, 0)):
        last = [i for i, name in enumerate(tg.names) if name.startswith(f"bwd gemm{layer}[")]
        assert timeline.start[ring] == max(timeline.end[i] for i in last)
    # a ring per weight (a bucket each) costs over 10x more: 64 rings of 256 KiB
    tg1, timeline1, rings1 = _rings(pg, machine, 0.25)
    assert len(rings1) == LAYERS
    assert all(tg1.duration[i] == _nccl_all_reduce(machine, 256 << 10) for i in rings1)
    assert tg1.duration[rings1].sum() > 10 * tg.duration[rings].sum()
    assert timeline1.makespan > timeline.makespan


def test_a_full_bucket_rings_while_the_backward_goes_on(data_parallel_chain):
    """At 8 MiB, after DDP's first bucket of 1 MiB (layers 63-60), layers 59-28's
    gradients fill the next: its ring starts once layer 28's backward is done, while
    layers 27 to 0 still run theirs, and the last bucket's (7 MiB) after layer 0's."""
    pg, machine = data_parallel_chain
    tg, timeline, rings = _rings(pg, machine, 8)
    assert len(rings) == 3
    sizes = [_nccl_all_reduce(machine, mib << 20) for mib in (1, 8, 7)]
    assert [tg.duration[i] for i in rings] == sizes
    backward = {
        k: max(timeline.end[i] for i, n in enumerate(tg.names) if n.startswith(f"bwd gemm{k}["))
        for k in (60, 28, 0)
    }
    first, second, third = rings
    assert timeline.start[first] == backward[60]
    assert timeline.start[second] == max(backward[28], timeline.end[first]) < backward[0]
    assert timeline.start[third] == max(backward[0], timeline.end[second])
