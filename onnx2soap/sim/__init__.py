"""The execution simulator: machine model, cost models, task graph, simulation, memory.

ev = Simulator(machine, RooflineCost()).evaluate(partitioned_graph)
ev.step_time_s, ev.peak_memory_bytes, ev.bytes_moved, ev.fits
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onnx2soap.sim.costs import CostModel, RooflineCost
from onnx2soap.sim.machine import Machine
from onnx2soap.sim.memory import peak_memory
from onnx2soap.sim.presets import resolve_machine
from onnx2soap.sim.simulate import Timeline, simulate
from onnx2soap.sim.taskgraph import Memo, TaskGraph, build_task_graph
from onnx2soap.soap import PartitionedGraph

__all__ = [
    "CostModel",
    "Evaluation",
    "Machine",
    "RooflineCost",
    "Simulator",
    "resolve_machine",
]


@dataclass(frozen=True)
class Evaluation:
    step_time_s: float
    peak_memory_bytes: tuple[int, ...]
    bytes_moved: int
    fits: bool  # every device's peak memory within its capacity


@dataclass(frozen=True)
class Simulator:
    """Evaluates partitioned graphs on one machine. It remembers task durations between
    calls (they depend only on the machine and the cost model), which is what makes a
    search's thousands of evaluations cheap."""

    machine: Machine
    cost: CostModel
    itemsize: int = 4
    optimizer_slots: int = 0  # optimizer arrays per trainable shard (memory.OPTIMIZER_SLOTS)
    memo: Memo = field(default_factory=Memo, compare=False, repr=False)

    @property
    def host_objects(self) -> bool:
        """Whether a device's memory also holds the runtime's Python objects: on CPU ranks
        (whose cores copy messages), not on GPUs."""
        return self.machine.transfers_use_compute

    def task_graph(self, pg: PartitionedGraph, names: bool = False) -> TaskGraph:
        return build_task_graph(pg, self.machine, self.cost, self.itemsize, names, self.memo)

    def evaluate(self, pg: PartitionedGraph) -> Evaluation:
        tg = self.task_graph(pg)  # binds the memo to pg's graph
        timeline: Timeline = simulate(tg)
        memory = peak_memory(
            pg,
            self.machine.size,
            self.itemsize,
            self.memo.memory,
            self.optimizer_slots,
            self.host_objects,
        )
        fits = all(m <= d.memory for m, d in zip(memory, self.machine.devices, strict=False))
        return Evaluation(timeline.makespan, memory, int(tg.nbytes.sum()), fits)
