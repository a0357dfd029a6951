"""The simulator runs every device's compute tasks in the executor's program order."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from executor.program import Compute, Partial, Phase, compile_program
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import random_strategy
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.presets import resolve_machine
from onnx2soap.sim.simulate import simulate
from onnx2soap.sim.taskgraph import TaskKind
from onnx2soap.soap import Partitioner, analyze

MODELS = ("mlp", "cnn", "spatial", "bnnet", "branches", "tokens", "tied")


def executor_order(pg, rank: int) -> list[tuple]:
    ops = pg.graph.ops
    out = []
    for ins in compile_program(pg, rank).instructions:
        if isinstance(ins, Compute | Partial):
            tag = "fwd" if ins.phase is Phase.FORWARD else "bwd"
            partial = " partial" if isinstance(ins, Partial) else ""
            out.append(f"{tag} {ops[ins.op].name}[{ins.task}]{partial}")
    return out


def simulated_order(pg, machine, rank: int) -> list[str]:
    """Compute tasks of the device by start time; ties (zero-length tasks) by number."""
    tg = Simulator(machine, RooflineCost()).task_graph(pg, names=True)
    timeline = simulate(tg)
    compute = (int(TaskKind.FORWARD), int(TaskKind.BACKWARD))
    mine = [
        i
        for i in range(tg.size)
        if tg.kind[i] in compute
        and tg.res_idx[tg.res_ptr[i]] == rank
        and not tg.names[i].startswith("sum ")  # gates of no duration: no instruction
    ]
    ordered = sorted(mine, key=lambda i: (timeline.start[i], i))
    for a, b in itertools.pairwise(ordered):
        assert timeline.end[a] <= timeline.start[b]  # one task at a time per device
    return [tg.names[i] for i in ordered]


@pytest.mark.parametrize("name", MODELS)
def test_compute_order_matches_executor(export_model, name: str) -> None:
    graph = load_model(export_model(name), batch=8).graph
    space = analyze(graph)
    partitioner = Partitioner(graph)
    rng = np.random.default_rng(7)
    for devices in (2, 4):
        machine = resolve_machine("flexflow-p100:1" if devices == 4 else "cpu:2")
        for _ in range(4):
            pg = partitioner.partition(random_strategy(graph, space, devices, rng))
            for rank in range(devices):
                assert simulated_order(pg, machine, rank) == executor_order(pg, rank)
