"""The simulator's gradient buckets (soap/buckets.py): a bucket's gradients are summed by
one ring per device set, priced as NCCL runs it (sim/collectives.py), which starts once
the bucket's last gradient is made and overlaps the rest of the backward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.collectives import Collective, collective_time, group_shape
from onnx2soap.sim.presets import resolve_machine
from onnx2soap.sim.simulate import simulate
from onnx2soap.soap import Partitioner, analyze

LAYERS, WIDTH = 64, 256  # 64 weights of 256 KiB: 16 MiB of float32 gradients
MACHINE = "dgx-h100:2"  # 16 H100s on two nodes


def chain(path: Path) -> Path:
    """x [B, 256] -> 64 x Gemm(W [256, 256], no bias)."""
    weights = [
        numpy_helper.from_array(np.full((WIDTH, WIDTH), 0.01, np.float32), f"W{k}")
        for k in range(LAYERS)
    ]
    names = ["x", *(f"h{k}" for k in range(1, LAYERS)), "logits"]
    nodes = [
        helper.make_node("Gemm", [names[k], f"W{k}"], [names[k + 1]], name=f"gemm{k}")
        for k in range(LAYERS)
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", WIDTH])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def data_parallel_chain(tmp_path_factory):
    graph = load_model(chain(tmp_path_factory.mktemp("chain") / "m.onnx"), batch=32).graph
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


def test_sixty_four_gradients_in_a_16_mib_bucket_cost_one_16_mib_ring(data_parallel_chain):
    pg, machine = data_parallel_chain
    tg, timeline, rings = _rings(pg, machine, 16)
    every = ",".join(map(str, range(16)))
    assert [tg.names[i] for i in rings] == [f"allreduce bucket 0 on {every}"]
    (ring,) = rings
    assert tg.duration[ring] == _nccl_all_reduce(machine, 16 << 20)
    assert tg.nbytes[ring] == 2 * 15 * (16 << 20)  # what the 16 members send of 16 MiB
    # it waits for the last gradient: the first layer's backward on every device
    last = [i for i, name in enumerate(tg.names) if name.startswith("bwd gemm0[")]
    assert timeline.start[ring] == max(timeline.end[i] for i in last)
    # a ring per weight (a bucket each) costs 15x more: 64 rings of 256 KiB
    tg1, timeline1, rings1 = _rings(pg, machine, 0.25)
    assert len(rings1) == LAYERS
    assert all(tg1.duration[i] == _nccl_all_reduce(machine, 256 << 10) for i in rings1)
    assert tg1.duration[rings1].sum() > 15 * tg.duration[ring]
    assert timeline1.makespan > timeline.makespan


def test_a_full_bucket_rings_while_the_backward_goes_on(data_parallel_chain):
    """At 8 MiB, the last 32 layers' gradients fill the first bucket: its ring starts
    once layer 32's backward is done, while layers 31 to 0 still run theirs, and the
    second bucket's after layer 0's."""
    pg, machine = data_parallel_chain
    tg, timeline, rings = _rings(pg, machine, 8)
    assert len(rings) == 2
    assert all(tg.duration[i] == _nccl_all_reduce(machine, 8 << 20) for i in rings)
    backward = {
        k: max(timeline.end[i] for i, n in enumerate(tg.names) if n.startswith(f"bwd gemm{k}["))
        for k in (32, 0)
    }
    first, second = rings
    assert timeline.start[first] == backward[32] < backward[0]
    assert timeline.start[second] == max(backward[0], timeline.end[first])
