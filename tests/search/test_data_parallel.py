"""Data parallelism by rule: ops computed from weights alone are spread, not left on
device 0 (issue 31, part 4: GPT's data-parallel peak grew with the GPUs)."""

from __future__ import annotations

from pathlib import Path

from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim.memory import peak_memory
from onnx2soap.soap import ParallelConfig, Partitioner, Strategy, analyze
from onnx2soap.soap.dims import DimKind


def _on_device_0(strategy: Strategy, names: list[str], space) -> Strategy:
    """The plan before: ops without a sample dim whole on device 0."""
    for name in names:
        strategy = strategy.replace(name, ParallelConfig((1,) * len(space[name]), (0,)))
    return strategy


def test_ops_computed_from_weights_alone_are_spread_over_the_replicas(export_model) -> None:
    path: Path = export_model("tied", "legacy")
    growth = {}
    for devices in (4, 8):
        graph = load_model(path, batch=2 * devices).graph  # weak scaling, as the suite
        space = analyze(graph)
        dp = data_parallel(graph, space, devices)
        alone = {
            op.name: op.type
            for op in graph.ops
            if not any(d.kind is DimKind.SAMPLE for d in space[op.name])
        }
        # the tied weight's Identity (its readers' one copy); the head reads it
        # transposed (importer/transposed.py), with no Transpose of its own
        assert sorted(alone.values()) == ["Identity"]
        for op in graph.ops:
            config = dp[op.name]
            assert len(set(config.devices)) == devices  # every op on every replica
            if op.name not in alone:  # the rest split by samples, as before
                split = [d for d, k in zip(space[op.name], config.degrees, strict=True) if k > 1]
                assert [d.kind for d in split] == [DimKind.SAMPLE]
        partitioner = Partitioner(graph)
        # a GPU's arrays (a CPU rank's Python objects, per piece, would hide them here)
        new = peak_memory(partitioner.partition(dp), devices, objects=False)
        old = peak_memory(
            partitioner.partition(_on_device_0(dp, alone, space)), devices, objects=False
        )
        # device 0 had sent every replica the weight and received every replica's
        # gradient of it: the largest peak, and the one that grows with the replicas
        assert old[0] == max(old) > max(new)
        growth[devices] = (old[0], max(new))
    assert growth[8][0] - growth[4][0] > 2 * (growth[8][1] - growth[4][1])


def test_a_pipeline_stage_spreads_them_over_its_devices(export_model) -> None:
    """Inside a pipeline stage the rule splits as data parallelism does: the tied
    weight's Identity over the stage's devices, not whole on its first device (which
    then sent the whole weight to every device of the head's stage each microbatch and
    held it a slot each)."""
    from onnx2soap.search.pipeline_rule import pipeline_plan, stage_groups
    from onnx2soap.sim import RooflineCost, make_simulator, resolve_machine

    graph = load_model(export_model("tied", "legacy"), batch=8).graph  # a microbatch's
    space = analyze(graph)
    machine = resolve_machine("dgx-h100:1")  # 8 GPUs: 2 stages of 4
    plan = pipeline_plan(graph, space, make_simulator(machine, RooflineCost()), 2, 2)
    groups = stage_groups(machine.size, 2)
    alone = [
        n for n in plan.strategy.configs if not any(d.kind is DimKind.SAMPLE for d in space[n])
    ]
    assert alone
    for group, names in zip(groups, plan.pipeline.stages, strict=True):
        for name in names:  # every op on every device of its stage
            assert set(plan.strategy[name].devices) == set(group)
    simulator = make_simulator(machine, RooflineCost(), pipeline=plan.pipeline)
    partitioner = Partitioner(graph)
    new = simulator.evaluate(partitioner.partition(plan.strategy)).peak_memory_bytes
    whole = Strategy(machine.size, dict(plan.strategy.configs))
    for name in alone:
        first = next(g[0] for g, ns in zip(groups, plan.pipeline.stages, strict=True) if name in ns)
        whole = whole.replace(name, ParallelConfig((1,) * len(space[name]), (first,)))
    old = simulator.evaluate(partitioner.partition(whole)).peak_memory_bytes
    assert max(old) > max(new)
