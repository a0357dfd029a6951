"""``--trace measured.json``: every rank's measured timeline, in the simulator's names.

Each instruction a rank runs is timed (on a GPU the rank waits for the device after each
one while tracing, so a task's time is its own) and named as the simulator names the
task it stands for (``fwd conv[2]``, ``bwd conv[2] partial``, ``stats bn fwd``,
``send x 0->1``, ``allreduce bucket 0 on 0,1``, ``update w``...), so ``onnx2soap compare`` can set
the two timelines side by side. Steps 2 to ``1 + TRACED_STEPS`` are kept (the first warms
up), each rank's times relative to the start of its step; rank 0 writes one
Chrome/Perfetto JSON file: one process per rank, a compute row and a communication row.

While tracing, each rank also records the peak of the memory it allocates, for the
memory model's check: on the CPU with tracemalloc (which numpy reports to), the peak of
the first traced step (``MEMORY_STEP``, named in the file's ``otherData``), a steady one:
what the rank holds as it begins, counted from just before the rank builds its runtime,
and what the step allocates. The first step's one-time objects are left out (what
building the rank's program left for the garbage collector, first calls' caches: 50-130
KB a rank here, up to a tenth of the tiny test models' peaks). Tracing then
stops, since it slows every allocation: that step is no clean one, and ``onnx2soap
compare`` leaves it out of the step's median when later steps were traced. On a GPU,
the same step's peak of the bytes cupy's memory pool hands out (``used_bytes`` as the
step begins, then every allocation and free the pool makes during it, heard by a
``cupy.cuda.MemoryHook``): the pool's ``total_bytes`` would count the blocks it keeps
cached for reuse, which no array holds (the first step's temporaries among them).
"""

from __future__ import annotations

import json
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executor.program import (
    AllReduce,
    Close,
    Compute,
    GatherWeight,
    Partial,
    Phase,
    Recv,
    ReduceScatter,
    ReduceStats,
    Reopen,
    Send,
    ShareGrad,
    SumOutputs,
    Wait,
    WaitWeight,
)
from onnx2soap.files import write_atomic
from onnx2soap.soap.buckets import ring_name, scatter_name
from onnx2soap.soap.stats_batches import StatsRing

TRACED_STEPS = 10
# The first traced step runs under tracemalloc, which slows every allocation: its times
# are kept (its memory is the peak), but a step's time is the median of the later ones.
MEMORY_STEP = 2
COMPUTE_ROW, COMMUNICATION_ROW = 0, 1
COMPUTE_KINDS = frozenset({"forward", "backward", "update"})


def task_name(pg, ins) -> tuple[str, str]:
    """(the simulator's name of the task, its kind) for one instruction."""
    graph = pg.graph
    if isinstance(ins, Reopen | Close):
        return f"{type(ins).__name__.lower()} microbatch {ins.microbatch}", "memory"
    if isinstance(ins, ReduceStats):
        tag = "fwd" if ins.phase is Phase.FORWARD else "bwd"
        ring = StatsRing(ins.devices, ins.members)
        return ring.name(lambda i: graph.ops[i].name, tag), "allreduce"
    if isinstance(ins, Compute | Partial):
        tag = "fwd" if ins.phase is Phase.FORWARD else "bwd"
        op = graph.ops[ins.op].name
        half = " partial" if isinstance(ins, Partial) else ""
        return f"{tag} {op}[{ins.task}]{half}", "forward" if tag == "fwd" else "backward"
    if isinstance(ins, SumOutputs):
        return f"partial sums {graph.ops[ins.op].name} fwd", "allreduce"
    if isinstance(ins, ShareGrad):
        return f"partial sums {graph.ops[ins.op].name} bwd", "allreduce"
    if isinstance(ins, AllReduce):
        return ring_name(ins.bucket, ins.devices), "allreduce"
    if isinstance(ins, ReduceScatter):
        return scatter_name(ins.bucket, ins.devices), "allreduce"
    if isinstance(ins, GatherWeight | WaitWeight):
        weight = pg.groups[graph.ops[ins.op].name][ins.group].weight
        tag = "fwd" if ins.phase is Phase.FORWARD else "bwd"
        what = "all-gather" if isinstance(ins, GatherWeight) else "wait all-gather"
        return f"{what} {weight} {tag}", "allreduce"
    t = ins.transfer
    tensor = graph.ops[t.producer[0]].output
    verb = "send" if t.phase is Phase.FORWARD else "grad"
    what = {Send: "", Recv: "post ", Wait: "wait "}[type(ins)]
    return f"{what}{verb} {tensor} {t.src}->{t.dst}", "transfer"


@dataclass
class Tracer:
    """Collects one rank's events for the traced steps."""

    rank: int
    pg: object
    device: object
    records: list[tuple[str, str, float, float, int]] = field(default_factory=list)
    step: int = 0
    origin: float = 0.0
    peak_bytes: int = 0
    traced_steps: int = TRACED_STEPS  # kept from MEMORY_STEP on
    _pool_peak: Any = None  # on a GPU: the hook counting MEMORY_STEP's pool bytes

    def __post_init__(self) -> None:
        if self.device.xp.__name__ == "numpy":
            if not tracemalloc.is_tracing():
                tracemalloc.start()
            tracemalloc.reset_peak()  # what came before (reading the plan) is not the run's

    @property
    def active(self) -> bool:
        return MEMORY_STEP <= self.step < MEMORY_STEP + self.traced_steps

    def begin_step(self, step: int) -> None:
        self.step = step
        # The peak of a steady step: what the rank holds as it begins (weights,
        # optimizer state, buffers) and what the step allocates. The first step's
        # one-time objects (see the module's docstring) are not every step's.
        if step == MEMORY_STEP and tracemalloc.is_tracing():
            tracemalloc.reset_peak()
        elif step == MEMORY_STEP and self.device.xp.__name__ != "numpy":
            self._pool_peak = pool_peak_hook(self.device.xp)
            self._pool_peak.__enter__()
        self.origin = time.perf_counter()

    def end_step(self) -> None:
        if self._pool_peak is not None:
            self._pool_peak.__exit__(None, None, None)
            self.peak_bytes, self._pool_peak = self._pool_peak.peak, None
        elif tracemalloc.is_tracing() and self.step >= MEMORY_STEP:
            self.peak_bytes = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()

    def record(self, name: str, kind: str, start: float, end: float) -> None:
        """One timed instruction of the current step. A tuple, made into the file's event
        by ``events``: the traced run pays as little per instruction as it can, so its
        steps take what untraced ones take (ops run a few microseconds each)."""
        if self.active:
            self.records.append((name, kind, start - self.origin, end - start, self.step))

    @property
    def events(self) -> list[dict]:
        """The recorded instructions as Perfetto events (built on every read)."""
        return [
            {
                "name": name,
                "cat": kind,
                "ph": "X",
                "pid": self.rank,
                "tid": COMPUTE_ROW if kind in COMPUTE_KINDS else COMMUNICATION_ROW,
                "ts": offset * 1e6,
                "dur": seconds * 1e6,
                "args": {"step": step},
            }
            for name, kind, offset, seconds, step in self.records
        ]


def pool_peak_hook(cp) -> Any:
    """A ``cupy.cuda.MemoryHook`` whose ``peak`` is the most bytes the current device's
    memory pool had handed out at once since it was made (from ``used_bytes`` then):
    every allocation from the pool and every return to it moves the count, so a kernel's
    short-lived workspace counts as it did on the device."""

    class PoolPeak(cp.cuda.MemoryHook):
        name = "onnx2soap.trace.PoolPeak"

        def __init__(self, held: int) -> None:
            self.now = self.peak = held

        def malloc_postprocess(self, **kwargs) -> None:
            if not kwargs["mem_ptr"]:  # the allocation failed (cupy then raises)
                return
            self.now += kwargs["mem_size"]
            self.peak = max(self.peak, self.now)

        def free_postprocess(self, **kwargs) -> None:
            self.now -= kwargs["mem_size"]

    return PoolPeak(int(cp.get_default_memory_pool().used_bytes()))


def write_measured(
    path: Path, per_rank: list[tuple[list[dict], int]], plan: Path, plan_sha256: str
) -> None:
    """Rank 0: every rank's events and peak memory in one Perfetto file."""
    events = []
    for rank, (rank_events, _) in enumerate(per_rank):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        for tid, row in ((COMPUTE_ROW, "compute"), (COMMUNICATION_ROW, "communication")):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": row}}
            )
        events += rank_events
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "plan": str(plan),
            "plan_sha256": plan_sha256,
            "measured": True,
            "peak_memory_bytes": [peak for _, peak in per_rank],
            "memory_step": MEMORY_STEP,
        },
    }
    write_atomic(path, json.dumps(doc))
