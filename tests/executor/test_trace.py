"""``--trace``: every rank's measured timeline, named as the simulator names its tasks.

On a random 3-rank plan of a BatchNorm model, the traced file holds steps 2 to 3 for every
rank; every compute task the executor times is a task of the simulated step with the
same name, on the same device, and every simulated compute task of a device is timed on
its rank once per step; each rank reports a positive peak memory.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from onnx2soap.importer import load_model
from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
from onnx2soap.sim.taskgraph import TaskKind
from onnx2soap.soap import Partitioner, analyze, load_plan
from tests.executor.mpi import make_plan, mpirun

pytestmark = pytest.mark.mpi
RANKS, BATCH = 3, 4


def test_measured_timeline_uses_the_simulators_task_names(export_model, tmp_path: Path):
    model = export_model("bnnet")
    plan_path = tmp_path / "plan.json"
    make_plan(model, plan_path, RANKS, BATCH, "random", seed=6)
    measured = tmp_path / "measured.json"
    run = mpirun(plan_path, RANKS, tmp_path, "--steps", "3", "--trace", str(measured))
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(measured.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["step"] for e in events} == {2, 3}
    assert len(doc["otherData"]["peak_memory_bytes"]) == RANKS
    assert all(b > 0 for b in doc["otherData"]["peak_memory_bytes"])

    plan = load_plan(plan_path)
    graph = load_model(model, BATCH).graph
    pg = Partitioner(graph).partition(plan.strategy(graph, analyze(graph)))
    tg = Simulator(resolve_machine(f"cpu:{RANKS}"), RooflineCost()).task_graph(pg, names=True)
    compute = (TaskKind.FORWARD, TaskKind.BACKWARD)
    simulated = Counter()
    for i in range(tg.size):
        if TaskKind(int(tg.kind[i])) in compute and tg.duration[i] > 0:
            device = int(tg.res_idx[tg.res_ptr[i]])
            simulated[(device, tg.names[i])] += 1
    timed = Counter(
        (e["pid"], e["name"])
        for e in events
        if e["cat"] in ("forward", "backward") and e["args"]["step"] == 2
    )
    assert timed == simulated
