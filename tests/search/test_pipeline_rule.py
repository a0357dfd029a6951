"""The pipeline rule: its stages against the best of every cut (simulated), its device
groups, its default shape and its refusals."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnx2soap.errors import UserError
from onnx2soap.importer import load_model
from onnx2soap.ir import Graph
from onnx2soap.search.megatron import node_size
from onnx2soap.search.pipeline_rule import (
    check_shape,
    default_microbatches,
    default_shape,
    full_recompute,
    pipeline_plan,
    stage_groups,
)
from onnx2soap.search.replicas import replica_config
from onnx2soap.sim import RooflineCost, make_simulator, resolve_machine
from onnx2soap.soap import Partitioner, Strategy, analyze
from onnx2soap.soap.pipeline import Pipeline, Schedule
from tests.sim.tiny import round_machine

WIDTHS = (8, 24, 4, 40, 16, 4)  # a chain of Gemms and Relus of uneven cost


def chain(path: Path) -> Path:
    """x [B, 8] -> (Gemm -> Relu) per width -> cross-entropy: 11 ops and the loss."""
    nodes, weights, prev, width = [], [], "x", 8
    for i, w in enumerate(WIDTHS):
        weights.append(numpy_helper.from_array(np.ones((width, w), np.float32), f"W{i}"))
        out = "logits" if i == len(WIDTHS) - 1 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"W{i}"], [f"g{i}"], name=f"gemm{i}"))
        if i < len(WIDTHS) - 1:
            nodes.append(helper.make_node("Relu", [f"g{i}"], [out], name=f"relu{i}"))
        else:
            nodes[-1] = helper.make_node("Gemm", [prev, f"W{i}"], [out], name=f"gemm{i}")
        prev, width = out, w
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", width])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture
def graph(tmp_path: Path) -> Graph:
    return load_model(chain(tmp_path / "chain.onnx"), batch=12).graph


def _slowest_stage(graph: Graph, space, machine, groups, cut: tuple[int, ...]) -> float:
    """Simulate the plan that cuts the ops at ``cut`` (data parallel inside each stage):
    its slowest stage's forward and backward of a microbatch."""
    bounds = (0, *cut, len(graph.ops))
    configs, stages = {}, []
    for group, (a, b) in zip(groups, itertools.pairwise(bounds), strict=True):
        ops = graph.ops[a:b]
        configs |= {op.name: replica_config(space[op.name], group) for op in ops}
        stages.append(tuple(op.name for op in ops))
    pipeline = Pipeline(tuple(stages), 2, Schedule.ONE_F_ONE_B)
    sim = make_simulator(machine, RooflineCost(), pipeline=pipeline)
    ev = sim.evaluate(Partitioner(graph).partition(Strategy(machine.size, configs)))
    return max(s.times.forward_s + s.times.backward_s for s in ev.pipeline.stages)


@pytest.mark.parametrize(("devices", "stages"), [(4, 2), (4, 4), (6, 3), (2, 2)])
def test_the_rule_cuts_where_the_best_of_every_cut_is(graph, devices, stages) -> None:
    """Equal groups: a stage's pass is the sum of its ops' (data parallelism inside a
    stage moves nothing between them), so the rule's cut is the best of every cut."""
    machine = round_machine(devices)
    space = analyze(graph)
    groups = stage_groups(devices, stages)
    plan = pipeline_plan(graph, space, make_simulator(machine, RooflineCost()), stages, 2)
    sizes = [len(ops) for ops in plan.pipeline.stages]
    cut = tuple(itertools.accumulate(sizes))[:-1]
    n = len(graph.ops)
    best = min(
        _slowest_stage(graph, space, machine, groups, c)
        for c in itertools.combinations(range(1, n), stages - 1)
    )
    assert _slowest_stage(graph, space, machine, groups, cut) == pytest.approx(best, rel=1e-12)
    # every op in its stage's group, split by samples over all of it
    for s, ops in enumerate(plan.pipeline.stages):
        for name in ops:
            assert plan.strategy[name].devices == groups[s]
    assert plan.pipeline.microbatches == 2 and plan.pipeline.schedule is Schedule.ONE_F_ONE_B


@pytest.mark.parametrize("devices", [1, 4])
def test_one_stage_holds_every_op_split_over_every_device(graph, devices) -> None:
    """Gradient accumulation's pipeline of one stage: no ops' times to balance."""
    machine = round_machine(devices)
    space = analyze(graph)
    plan = pipeline_plan(graph, space, make_simulator(machine, RooflineCost()), 1, 3)
    assert plan.pipeline.stages == (tuple(op.name for op in graph.ops),)
    group = tuple(range(devices))
    assert plan.strategy.configs == {
        op.name: replica_config(space[op.name], group) for op in graph.ops
    }


def test_device_groups_are_whole_nodes_where_stages_divide_them() -> None:
    machine = resolve_machine("dgx-h100:4")  # 4 nodes of 8 GPUs
    node = node_size(machine)
    assert node == 8
    for stages in (2, 4):
        for group in stage_groups(32, stages):
            assert group[0] % node == 0 and len(group) % node == 0
    assert stage_groups(5, 2) == ((0, 1, 2), (3, 4))  # contiguous, as even as can be
    with pytest.raises(UserError, match="3 pipeline stages on 2 devices"):
        stage_groups(2, 3)


def test_default_shape() -> None:
    # a stage per node (presets count nodes of 8 GPUs), up to 4 microbatches per stage
    # that still fill a stage's devices
    assert default_shape(resolve_machine("dgx-h100:8"), 512, 1000) == (8, 32)
    assert default_shape(resolve_machine("dgx-h100:8"), 64, 1000) == (8, 8)
    assert default_shape(resolve_machine("alpa-v100:2"), 64, 1000) == (2, 8)
    assert default_shape(resolve_machine("cpu:4"), 8, 15) == (2, 4)  # one node: 2 stages
    assert default_shape(resolve_machine("cpu:1"), 8, 15) is None  # no second stage
    assert default_shape(resolve_machine("cpu:4"), 1, 15) is None  # no sample for 2 devices
    # given the stages: 4 stages of one device take up to 16 microbatches of one sample
    assert default_microbatches(4, 16, 4) == 16 and default_microbatches(4, 12, 2) == 6
    assert default_microbatches(8, 2, 2) is None  # 4 devices a stage, 2 samples


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4, 8, 12, 5, 2), "--stages 5: the machine has 4 devices"),
        ((4, 8, 3, 4, 2), "--stages 4: the model has 3 ops"),
        ((4, 8, 12, 2, 3), "--microbatches 3 does not divide the batch of 8"),
        ((4, 8, 12, 2, 8), "a microbatch of 1 samples cannot be split over a stage's 2 devices"),
    ],
)
def test_refusals(args, message) -> None:
    with pytest.raises(UserError, match=message):
        check_shape(*args)
    check_shape(4, 8, 12, 2, 4)  # 2 samples a microbatch over 2 devices a stage


def test_full_recompute_keeps_sqrt_n_checkpoints_evenly_spaced(graph) -> None:
    """The chain has no repeated block (its widths differ): 11 ops but the loss, so
    round(sqrt(11)) = 3 checkpoints; by op count (no simulator) ops 3, 6 and 9 (1-based)
    reach 1/4, 2/4, 3/4 of the total, and everything else but the loss is recomputed."""
    names = full_recompute(graph)
    ops = [op.name for op in graph.ops]
    kept = [op for op in ops if op not in names]
    assert graph.loss_op is not None and graph.loss_op.name in kept
    assert kept == [ops[2], ops[5], ops[8], graph.loss_op.name]
