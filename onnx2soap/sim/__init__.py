"""The execution simulator: machine model, cost models, task graph, simulation, memory.

ev = Simulator(machine, RooflineCost()).evaluate(partitioned_graph)
ev.step_time_s, ev.peak_memory_bytes, ev.bytes_moved, ev.fits
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from onnx2soap.precision import Precision
from onnx2soap.sim.achieved import AchievedCost
from onnx2soap.sim.costs import CostModel, RooflineCost
from onnx2soap.sim.heap import collector_paused
from onnx2soap.sim.machine import Machine
from onnx2soap.sim.memory import memory_key, peak_memory
from onnx2soap.sim.pipeline_price import PipelineEvaluation, price_pipeline, task_repeats
from onnx2soap.sim.precision_cost import with_precision
from onnx2soap.sim.presets import resolve_machine
from onnx2soap.sim.simulate import simulate
from onnx2soap.sim.taskgraph import Costs, Memo, TaskGraph, build_with_slots
from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.buckets import DEFAULT_BUCKET_MB
from onnx2soap.soap.pipeline import Pipeline
from onnx2soap.soap.zero import NO_ZERO, Zero, ZeroStage

__all__ = [
    "AchievedCost",
    "CostModel",
    "Evaluation",
    "Machine",
    "PipelineEvaluation",
    "RooflineCost",
    "Simulator",
    "make_simulator",
    "resolve_machine",
]


@dataclass(frozen=True)
class Evaluation:
    step_time_s: float
    peak_memory_bytes: tuple[int, ...]
    bytes_moved: int
    fits: bool  # every device's peak memory within its capacity
    # a pipeline plan's stages: pass times, moves, tails, bubbles, held microbatches
    pipeline: PipelineEvaluation | None = None


def make_simulator(
    machine: Machine,
    cost: CostModel,
    optimizer_slots: int = 0,
    precision: Precision = Precision.FP32,
    zero: Zero | ZeroStage = ZeroStage.NONE,
    pipeline: Pipeline | None = None,
    recompute: tuple[str, ...] | frozenset[str] = (),
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> Simulator:
    """A simulator of training in ``precision``: its costs (``precision_cost``) and its
    memory both follow it; ``zero``: the plan's ZeRO stages (soap/zero.py); ``pipeline``
    and ``recompute``: the plan's (``pipeline_price.py``; ops whose activations the
    backward recomputes); ``bucket_mb``: its gradient buckets (soap/buckets.py)."""
    return Simulator(
        machine,
        _priced(cost, machine, precision, optimizer_slots),
        optimizer_slots=optimizer_slots,
        precision=precision,
        zero=zero,
        pipeline=pipeline,
        recompute=frozenset(recompute),
        bucket_mb=bucket_mb,
    )


def _priced(
    cost: CostModel, machine: Machine, precision: Precision, optimizer_slots: int
) -> CostModel:
    """``cost`` under ``precision``: native kernels' rates where it is the achieved
    model of devices it knows (sim/achieved.py); else the executor's way of running
    mixed precision on top (``precision_cost``), the roofline standing in for devices
    the achieved model does not know."""
    if isinstance(cost, AchievedCost):
        if all(cost.knows(d) for d in machine.devices):
            return replace(cost, precision=precision, optimizer_slots=optimizer_slots)
        cost = cost.roofline
    return with_precision(cost, precision, host=machine.transfers_use_compute)


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
    # Mixed precision: its memory here; its time in the cost model (``make_simulator``).
    precision: Precision = Precision.FP32
    # ZeRO: sharded groups' rings, updates and memory (soap/zero.py); one ``Zero`` per
    # simulator, since its memo keeps durations and memory under it (a stage is read as
    # every weight's)
    zero: Zero = NO_ZERO
    # A pipeline plan's stages (then ``evaluate`` takes the microbatch's partitioned graph
    # and prices the whole step); its recomputed ops, pipeline or not. One plan's.
    pipeline: Pipeline | None = None
    recompute: frozenset[str] = frozenset()
    bucket_mb: float = DEFAULT_BUCKET_MB  # gradient buckets' MiB (soap/buckets.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "zero", Zero.of(self.zero))

    @property
    def shard_slots(self) -> int:
        """Arrays a trainable shard holds besides itself and its gradient: the
        optimizer's state, and mixed precision's half-format copy of the weight."""
        return self.optimizer_slots + (1 if self.precision.mixed else 0)

    @property
    def stored_itemsize(self) -> int:
        """Bytes an element of what the executor stores between kernels: the half
        format's 2 under mixed precision (``executor/precision.py``), else ``itemsize``."""
        return 2 if self.precision.mixed else self.itemsize

    @property
    def rounding_bytes(self) -> int:
        """Temporaries per element of rounding an array to the half format: a half
        copy (numpy's casts, on CPU ranks; fp16 anywhere), or for bf16 on a GPU a NaN
        mask and two uint32 arrays (CuPy has no bfloat16: the bits by hand)."""
        if self.precision is Precision.BF16 and not self.host_objects:
            return 9
        return 2 if self.precision.mixed else 0

    @property
    def host_objects(self) -> bool:
        """Whether a device's memory also holds the runtime's Python objects: on CPU ranks
        (whose cores copy messages), not on GPUs."""
        return self.machine.transfers_use_compute

    def costs(self) -> Costs:
        return Costs(
            self.machine,
            self.cost,
            self.itemsize,
            self.memo,
            self.zero,
            self.recompute,
            self.stored_itemsize,
            self.bucket_mb,
        )

    def task_graph(self, pg: PartitionedGraph, names: bool = False) -> TaskGraph:
        """One step's task graph; a pipeline plan's: one microbatch's."""
        return build_with_slots(pg, self.costs(), names)[0]

    def repeats(self, pg: PartitionedGraph) -> np.ndarray | None:
        """Per task of ``task_graph(pg)``, how many times a step runs it; None without a
        pipeline (every task once)."""
        if self.pipeline is None:
            return None
        _, lay, slots = build_with_slots(pg, self.costs())
        stage_of = self.pipeline.stage_of()
        stage = [stage_of[op.name] for op in pg.graph.ops]
        return task_repeats(lay, slots, self.pipeline, stage)

    def evaluate(self, pg: PartitionedGraph) -> Evaluation:
        with collector_paused():  # sim/heap.py: millions of long-lived tuples, no cycles
            return self._evaluate(pg)

    def _evaluate(self, pg: PartitionedGraph) -> Evaluation:
        tg, lay, slots = build_with_slots(pg, self.costs())  # binds the memo to pg's graph
        memory = peak_memory(
            pg,
            self.machine.size,
            self.itemsize,
            self.memo.memory,
            self.shard_slots,
            self.host_objects,
            self.rounding_bytes,
            self.zero,
            self.optimizer_slots,
            self.recompute,
            self.stored_itemsize,
            self.bucket_mb,
        )
        if self.pipeline is None:
            step, moved, report = simulate(tg).makespan, int(tg.nbytes.sum()), None
        else:
            memo = self.memo.memory
            ops = {
                op.name: memo[memory_key(op.name, pg.strategy[op.name], pg.sums[op.name])]
                for op in pg.graph.ops
            }
            price = price_pipeline(
                pg,
                self.pipeline,
                tg,
                lay,
                slots,
                memory,
                ops,
                self.itemsize,
                self.host_objects,
                self.recompute,
                self.stored_itemsize,
            )
            step, moved, memory = price.step_time_s, price.bytes_moved, price.peak_memory_bytes
            report = price.report
        fits = all(m <= d.memory for m, d in zip(memory, self.machine.devices, strict=False))
        return Evaluation(step, memory, moved, fits, report)
