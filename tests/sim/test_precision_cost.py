"""What mixed precision costs in the simulator, computed by hand: a rounding pass over
every array a kernel makes, fp16 products at a device's float16 peak, a half-format copy
of every trainable weight in memory; and the plan file keeps the precision."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from onnx2soap.errors import PlanError
from onnx2soap.importer import load_model
from onnx2soap.precision import Precision
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim import RooflineCost, make_simulator
from onnx2soap.sim.machine import ComputeDevice
from onnx2soap.sim.precision_cost import MixedPrecisionCost
from onnx2soap.sim.presets import cpu
from onnx2soap.soap import Partitioner, analyze, load_plan

# 1 GFLOP/s and 1 GB/s, no overhead: a task's time is its FLOPs or its bytes, in ns.
SLOW = ComputeDevice("slow", 1e9, 1e9, 1 << 30, 0.0)
TENSOR = ComputeDevice("tensor", 1e9, 1e9, 1 << 30, 0.0, peak_flops_half=8e9)


def _matmul(tmp_path: Path):
    """x[4, 8] @ W[8, 16]: 4*16*8 = 512 points of 2 FLOPs; one task."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.zeros((8, 16), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
        [w],
    )
    path = tmp_path / "mm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    graph = load_model(path).graph
    op = graph.ops[0]
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))
    return op, pg.tasks[op.name][0]


def test_rounding_passes_and_fp16_products_by_hand(tmp_path: Path) -> None:
    op, task = _matmul(tmp_path)
    assert op.type == "MatMul"
    flops, elements = 2 * 4 * 16 * 8, 4 * 8 + 8 * 16 + 4 * 16  # inputs and output
    roofline = RooflineCost()
    # float32: max(1024 FLOPs / 1e9, 224 elements * 4 B / 1e9) = 1024 ns
    assert roofline.forward(op, task, SLOW, 4) == pytest.approx(flops / 1e9)
    bf16 = MixedPrecisionCost(roofline, Precision.BF16)
    # + rounding the 64-element output: 64 * 40 B / 1e9
    assert bf16.forward(op, task, SLOW, 4) == pytest.approx((flops + 64 * 40) / 1e9)
    # backward: twice the work, + rounding both gradients (x's 32 and W's 128 elements)
    assert bf16.backward(op, task, SLOW, 4) == pytest.approx((2 * flops + 160 * 40) / 1e9)
    fp16 = MixedPrecisionCost(roofline, Precision.FP16)
    # no faster float16 peak: the float32 product, + rounding (12 B an element)
    assert fp16.forward(op, task, SLOW, 4) == pytest.approx((flops + 64 * 12) / 1e9)
    # tensor cores: max(1024 / 8e9, 896 B / 1e9) = 896 ns (now memory bound), + the
    # casts to float16 and back (6 B an element of operands and product), + rounding
    forward = (elements * 4 + elements * 6 + 64 * 12) / 1e9
    assert fp16.forward(op, task, TENSOR, 4) == pytest.approx(forward)
    backward = (2 * elements * 4 + 2 * elements * 6 + 160 * 12) / 1e9
    assert fp16.backward(op, task, TENSOR, 4) == pytest.approx(backward)
    # update: SGD's 3 passes, + the copy (2 passes) and its rounding
    assert bf16.update(100, SLOW, 4) == pytest.approx((1200 + 800 + 4000) / 1e9)
    # on CPU ranks numpy rounds bf16 by a cast there and back after a NaN check: 16 B
    host = MixedPrecisionCost(roofline, Precision.BF16, host=True)
    assert host.forward(op, task, SLOW, 4) == pytest.approx((flops + 64 * 16) / 1e9)


def test_mixed_precision_memory_holds_a_copy_of_every_weight(tmp_path: Path) -> None:
    _matmul(tmp_path)
    graph = load_model(tmp_path / "mm.onnx").graph
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))
    machine = cpu(1)
    fp32 = make_simulator(machine, RooflineCost()).evaluate(pg).peak_memory_bytes[0]
    fp16 = make_simulator(machine, RooflineCost(), 0, Precision.FP16).evaluate(pg)
    bf16 = make_simulator(machine, RooflineCost(), 0, Precision.BF16).evaluate(pg)
    copy = 8 * 16 * 2
    # the 16-bit copy, and rounding's temporaries at the widest moment (the backward's
    # largest gradient, W's 128 elements, while its fresh gradients are held); the
    # backward widens no copy of W (W's gradient reads x alone; x takes none). On CPU
    # ranks both formats round through a 2-byte copy (numpy's casts); on a GPU, bf16's
    # bits are rounded by hand (CuPy has no bfloat16): 9 bytes an element, not 2, which
    # outgrow the backward's other temporaries at W's rounding
    assert fp16.peak_memory_bytes[0] >= fp32 + copy
    assert bf16.peak_memory_bytes[0] == fp16.peak_memory_bytes[0]
    gpu = replace(machine, transfers_use_compute=False)
    on_gpu = {
        p: make_simulator(gpu, RooflineCost(), 0, p).evaluate(pg).peak_memory_bytes[0]
        for p in (Precision.FP16, Precision.BF16)
    }
    assert on_gpu[Precision.BF16] > on_gpu[Precision.FP16]


def test_the_plan_file_keeps_its_precision(tmp_path: Path, example_onnx: Path) -> None:
    from onnx2soap.cli import main

    plan = tmp_path / "p.json"
    argv = ["plan", str(example_onnx), "--batch", "4", "--devices", "2"]
    assert main([*argv, "--strategy", "data-parallel", "--precision", "bf16", "-o", str(plan)]) == 0
    assert load_plan(plan).precision is Precision.BF16
    doc = json.loads(plan.read_text())
    del doc["precision"]  # plans from before it: float32
    plan.write_text(json.dumps(doc))
    assert load_plan(plan).precision is Precision.FP32
    doc["precision"] = "fp8"
    plan.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="'precision': must be one of"):
        load_plan(plan)
