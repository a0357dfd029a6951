"""A tiny model and machines with round numbers, so step times can be computed by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.ir import Graph
from onnx2soap.sim.machine import ComputeDevice, Machine
from onnx2soap.sim.presets import cpu

GFLOP = 1e9  # device peak: 1 FLOP takes 1 ns
LINK_BW = 1e6  # 1 byte takes 1 us
LINK_LATENCY = 1e-6


def gemm_model(path: Path, hidden: int = 4, relu: bool = False) -> Path:
    """x [B, 8] -> Gemm(W [8, hidden], no bias) [-> Relu]; cross-entropy is attached."""
    w = numpy_helper.from_array(np.ones((8, hidden), np.float32), "W")
    nodes = [helper.make_node("Gemm", ["x", "W"], ["y" if relu else "logits"], name="gemm")]
    if relu:
        nodes.append(helper.make_node("Relu", ["y"], ["logits"], name="relu"))
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", hidden])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


def tiny_graph(tmp_path: Path, batch: int = 4, **kw) -> Graph:
    return load_model(gemm_model(tmp_path / "tiny.onnx", **kw), batch=batch).graph


def round_machine(devices: int, memory: int = 1 << 30, use_compute: bool = False) -> Machine:
    """Compute-bound devices (memory traffic free), no per-task overhead, slow links;
    transfers use only links unless ``use_compute`` (then they hold both end devices)."""
    device = ComputeDevice("dev", GFLOP, 1e30, memory, 0.0)
    machine = cpu(devices, device, LINK_BW, LINK_LATENCY)
    return replace(machine, transfers_use_compute=use_compute)
