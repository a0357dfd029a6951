"""The plan the in-step calibration runs, and the cost key of each instruction it traces.

``onnx2soap profile`` runs the executor's step on the one-device plan with its tracer and
stores, per cost key, what the tasks took inside the step (``costdb.InStep``);
``ProfiledCost`` reads them back and fits its calibration to the planned model's own.
Both sides must name the same tasks with the same keys, so the names live here, in the
simulator that reads them, and the profiler (``onnx2soap/measure/profiler.py``), which
writes them, imports them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx2soap.ir import Graph
from onnx2soap.sim.costdb import Phase, cost_key, update_key
from onnx2soap.soap import PartitionedGraph, Partitioner, Strategy, analyze
from onnx2soap.soap.partition import ParallelConfig, rect_volume


def calibration_plan(graph: Graph) -> PartitionedGraph:
    """The one-device plan: every op whole on device 0, its tasks among the profile's
    items (``search.baselines.data_parallel`` on one device is the same plan)."""
    space = analyze(graph)
    whole = {op.name: ParallelConfig((1,) * len(space[op.name]), (0,)) for op in graph.ops}
    return Partitioner(graph).partition(Strategy(1, whole))


@dataclass(frozen=True)
class Traced:
    """What one traced instruction of the calibration stands for: the task it is part of
    (a statistics op's partial half, its statistics and its finishing half are one task:
    ``fwd bn``) and that task's key in the cost DB."""

    task: str
    key: tuple[Phase, str]


def calibration_keys(graph: Graph, pg: PartitionedGraph) -> dict[str, Traced]:
    """The tracer's name of every compute instruction of ``pg`` on its one device and of
    every update, to the task it is part of and the task's key."""
    names: dict[str, Traced] = {}
    for op in graph.ops:
        (task,) = pg.tasks[op.name]
        key = cost_key(op, task)
        for tag, phase in (("fwd", Phase.FORWARD), ("bwd", Phase.BACKWARD)):
            traced = Traced(f"{tag} {op.name}", (phase, key))
            for name in (f"{tag} {op.name}[0]", f"{tag} {op.name}[0] partial"):
                names[name] = traced
            names[f"stats {op.name} {tag}"] = traced
        for group in pg.groups[op.name]:
            if group.trainable:
                numel = rect_volume(group.rect)
                traced = Traced(f"update {group.weight}", (Phase.UPDATE, update_key(numel)))
                names[f"update {group.weight}"] = traced
    return names


def one_device_keys(graph: Graph) -> frozenset[tuple[Phase, str]]:
    """The cost keys of ``graph``'s tasks with every op whole on one device (forward,
    backward) and of its weights' updates: those ``onnx2soap profile`` times in the
    executor's step."""
    return frozenset(t.key for t in calibration_keys(graph, calibration_plan(graph)).values())
