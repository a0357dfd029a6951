"""The achieved compute model (sim/achieved.py) against costs worked by hand from its
published rates: a product's waves of tiles, fused attention at its share of the peak,
streaming kernels at the achieved bandwidth, a fused update; other devices by the
roofline; and which model ``--costs`` picks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.precision import Precision
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim import AchievedCost, RooflineCost, make_simulator
from onnx2soap.sim.presets import H100, cpu, preset
from onnx2soap.soap import Partitioner, analyze

BF16 = AchievedCost(Precision.BF16)
MAMF = 792.1e12 / 989e12  # stas00/ml-engineering's H100 SXM measurement
BANDWIDTH = 3.35e12 * 0.90
OVERHEAD = 4e-6  # H100's kernel_overhead


def _save(path: Path, nodes, inputs, outputs, initializers, opset: int = 17) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


def _tasks(path: Path):
    graph = load_model(path).graph
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))
    return {op.type: (op, pg.tasks[op.name][0]) for op in graph.ops}


def _matmul(tmp_path: Path, m: int, k: int, n: int):
    w = numpy_helper.from_array(np.zeros((k, n), np.float32), "w")
    path = _save(
        tmp_path / f"mm{m}.onnx",
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [w],
    )
    return _tasks(path)["MatMul"]


def test_a_large_product_runs_at_the_measured_rate_in_waves_of_tiles(tmp_path: Path) -> None:
    op, task = _matmul(tmp_path, 8192, 4096, 8192)
    # 256 x 128 tiles: 32 x 64 = 2,048 tiles, 16 waves of 132 SMs (the last not full)
    rate = 989e12 * MAMF
    wave = 132 * 2 * 256 * 128 * 4096 / rate
    assert BF16.forward(op, task, H100, 4) == pytest.approx(16 * wave + OVERHEAD)
    # 2,048 / (16 x 132) of the rate: 97 % of the measured best shape
    assert 2 * 8192 * 4096 * 8192 / (16 * wave) / rate == pytest.approx(2048 / (16 * 132))
    # backward: dX [8192, 4096] = 32 x 32 tiles (8 waves, depth 8192); dW [4096, 8192] = 16 x
    # 64 tiles (8 waves, depth 8192)
    dx = 8 * 132 * 2 * 256 * 128 * 8192 / rate
    assert BF16.backward(op, task, H100, 4) == pytest.approx(2 * dx + OVERHEAD)
    # float32: the FP32 peak at 85 %, 128 x 128 tiles: 64 x 64 = 4,096 tiles, 32 waves
    fp32 = AchievedCost().forward(op, task, H100, 4)
    assert fp32 == pytest.approx(32 * 132 * 2 * 128 * 128 * 4096 / (67e12 * 0.85) + OVERHEAD)


def test_a_skinny_product_pays_whole_tiles_or_its_bytes(tmp_path: Path) -> None:
    op, task = _matmul(tmp_path, 16, 4096, 4096)
    # 1 x 32 tiles, each depth split in 4 (132 // 32) to fill the SMs: one wave of tiles
    # 1,024 deep, as long as a full tile of 256 rows
    wave = 132 * 2 * 256 * 128 * 1024 / (989e12 * MAMF)
    moved = (16 * 4096 + 4096 * 4096 + 16 * 4096) * 2 / BANDWIDTH  # bf16: weights dominate
    assert BF16.forward(op, task, H100, 4) == pytest.approx(max(wave, moved) + OVERHEAD)
    # 6 % of the measured rate, bound by reading its weight, as decoding is
    assert 2 * 16 * 4096 * 4096 / max(wave, moved) / (989e12 * MAMF) < 0.07


def test_attention_at_flash_attentions_share_of_the_peak(tmp_path: Path) -> None:
    b, h, s, e = 1, 8, 1024, 64
    q = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [b, h, s, e]) for n in "qkv"]
    path = _save(
        tmp_path / "att.onnx",
        [helper.make_node("Attention", ["q", "k", "v"], ["y"], name="att")],
        q,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, h, s, e])],
        [],
        opset=23,
    )
    op, task = _tasks(path)["Attention"]
    flops = op.nest.work_points(task.box) * op.nest.flops_per_point
    assert BF16.forward(op, task, H100, 4) == pytest.approx(flops / (989e12 * 0.35) + OVERHEAD)
    backward = 2.5 * flops / (989e12 * 0.30) + OVERHEAD
    assert BF16.backward(op, task, H100, 4) == pytest.approx(backward)


def test_elementwise_ops_stream_and_the_update_is_one_fused_pass(tmp_path: Path) -> None:
    path = _save(
        tmp_path / "relu.onnx",
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024, 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024, 1024])],
        [],
    )
    op, task = _tasks(path)["Relu"]
    elements = 2 * 1024 * 1024  # read and written
    assert BF16.forward(op, task, H100, 4) == pytest.approx(elements * 2 / BANDWIDTH + OVERHEAD)
    assert AchievedCost().forward(op, task, H100, 4) == pytest.approx(
        elements * 4 / BANDWIDTH + OVERHEAD
    )
    assert BF16.backward(op, task, H100, 4) == pytest.approx(
        2 * elements * 2 / BANDWIDTH + OVERHEAD
    )
    # Adam under bf16: master and gradient read, master written (12 B), two moments read
    # and written (16 B), the 16-bit copy written (2 B)
    adam = AchievedCost(Precision.BF16, optimizer_slots=2)
    assert adam.update(10**6, H100, 4) == pytest.approx(10**6 * 30 / BANDWIDTH + OVERHEAD)


def test_devices_without_published_rates_are_priced_by_the_roofline(tmp_path: Path) -> None:
    op, task = _matmul(tmp_path, 64, 64, 64)
    rank = cpu(1).devices[0]
    assert not AchievedCost.knows(rank)
    roofline = RooflineCost()
    assert BF16.forward(op, task, rank, 4) == roofline.forward(op, task, rank, 4)
    assert BF16.update(100, rank, 4) == roofline.update(100, rank, 4)
    # a simulator of CPU ranks keeps the executor's rounding passes for bf16
    sim = make_simulator(cpu(2), AchievedCost(), 0, Precision.BF16)
    assert not isinstance(sim.cost, AchievedCost)
    gpus = make_simulator(preset("dgx-h100:1"), AchievedCost(), 2, Precision.BF16)
    assert gpus.cost == AchievedCost(Precision.BF16, optimizer_slots=2)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "onnx2soap", *args], capture_output=True, text=True, check=False
    )


def test_costs_auto_picks_the_published_rates_for_gpus_only(tmp_path: Path) -> None:
    op_path = tmp_path / "mm.onnx"
    _matmul(tmp_path, 64, 64, 64)
    (tmp_path / "mm64.onnx").rename(op_path)
    plan = tmp_path / "plan.json"
    done = _cli("plan", str(op_path), "--machine", "dgx-h100:1", "--batch", "64", "-o", str(plan))
    assert done.returncode == 0, done.stderr
    gpu = _cli("simulate", str(plan), "--machine", "dgx-h100:1", "--json")
    assert json.loads(gpu.stdout)["costs"] == "achieved"
    roofline = _cli(
        "simulate", str(plan), "--machine", "dgx-h100:1", "--json", "--costs", "roofline"
    )
    assert json.loads(roofline.stdout)["costs"] == "roofline"
    refused = _cli("simulate", str(plan), "--machine", "cpu:8", "--costs", "achieved")
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0
    assert "no published kernel rates for device rank0" in refused.stderr
    assert math.isfinite(json.loads(gpu.stdout)["step_time_s"])
