"""A pipeline plan's step, priced from the task graph of one microbatch.

A pipeline plan's ops are split on the model at the microbatch's batch, so the task
graph of its partitioned graph is one microbatch's training step. Its slots (one per
phase and op or edge, ``taskgraph.py``) fall into each stage's

- forward: its ops' forward tasks and the transfers between them;
- backward: its ops' backward tasks (recomputed forwards first, where the plan says so)
  and the gradient transfers between them;
- moves to the next stage: the forward transfers of the edges leaving the stage (an
  edge that skips a stage counts with its producer's move), and the gradient transfers
  of those edges back, priced as the simulator prices any transfer, over the links
  between the two stages' devices;
- tail: its ops' gradient rings (all-reduce, or ZeRO's reduce-scatter) and updates (and
  ZeRO's all-gathers), once per step after the stage's last backward: what they add
  past the backward when they run with it, as in a plain step (rings start as soon as
  their op's gradient is made).

Each class is timed on its own (``makespans``): its tasks run in program order on their
resources, waiting for their predecessors of the same class, as ``simulate`` runs a
whole step; a task's predecessors in other classes are what ``time_pipeline`` orders.
``time_pipeline`` (``pipeline_schedule.py``) then runs the schedule. A pipeline of one
stage and one microbatch is thus the plain step when the forward of every device ends
before any backward begins (true of data parallelism over equal devices).

Memory per device: the plain model's peak of one microbatch's step (weights, gradients,
optimizer state, ZeRO-aware; one microbatch's activations and everything transient),
plus what each other microbatch its stage holds at once holds (``held_at_most`` - 1 of
them, between their forward and backward; the executor gives each a slot of buffers,
``executor/program.py``): everything the plain model counts for the step but the
weights' share and the activation gradients not yet made: output tiles (none for
recomputed ops), input, gradient and receive buffers (a recomputed stage's checkpoint
among them). The step's data rows count once (one
microbatch's), and so do the runtime's Python objects per instruction on CPU ranks
(the program has every microbatch's instructions: under-counted there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from onnx2soap.sim.memory import OpMemory, _edge_bytes, readers
from onnx2soap.sim.pipeline_schedule import PipelineTiming, StageTimes, time_pipeline
from onnx2soap.sim.taskgraph import Layout, TaskGraph
from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.pipeline import Pipeline, held_at_most, stage_devices

# Per stage, its classes of slots in the first pass (the second times backward and
# tail together: its class is the stage's number).
FORWARD, BACKWARD, SEND_FORWARD, SEND_BACKWARD = range(4)
CLASSES = 4


@dataclass(frozen=True)
class StageReport:
    devices: tuple[int, ...]
    times: StageTimes
    held: int  # microbatches' activations held at once at most
    bubble: float  # the fraction of the step it idles


@dataclass(frozen=True)
class PipelineEvaluation:
    """What ``simulate`` reports of a pipeline plan besides the step and memory."""

    schedule: str
    microbatches: int
    stages: tuple[StageReport, ...]


@dataclass(frozen=True)
class PipelinePrice:
    step_time_s: float
    bytes_moved: int
    peak_memory_bytes: tuple[int, ...]
    report: PipelineEvaluation


def makespans(tg: TaskGraph, label: np.ndarray, count: int) -> list[float]:
    """Per class ``0..count-1``, the makespan of its tasks alone (``label`` per task, -1
    for none): ``simulate``'s pass with every predecessor and resource turn outside the
    task's class left out."""
    n = tg.size
    duration, lab = tg.duration.tolist(), label.tolist()
    res_ptr, res_idx = tg.res_ptr.tolist(), tg.res_idx.tolist()
    pred_ptr, pred_idx = tg.pred_ptr.tolist(), tg.pred_idx.tolist()
    end = [0.0] * n
    free = [[0.0] * tg.num_resources for _ in range(count)]
    span = [0.0] * count
    for i in range(n):
        c = lab[i]
        if c < 0:
            continue
        s = 0.0
        for p in pred_idx[pred_ptr[i] : pred_ptr[i + 1]]:
            if lab[p] == c and end[p] > s:
                s = end[p]
        turn = free[c]
        resources = res_idx[res_ptr[i] : res_ptr[i + 1]]
        for r in resources:
            if turn[r] > s:
                s = turn[r]
        e = s + duration[i]
        end[i] = e
        for r in resources:
            turn[r] = e
        if e > span[c]:
            span[c] = e
    return span


def slot_labels(lay: Layout, stage: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per slot, its class in the first pass (stage * CLASSES + FORWARD..SEND_BACKWARD;
    tails -1) and in the second (the stage's backward and tail: the stage; else -1)."""
    first = np.full(lay.size, -1, dtype=np.int64)
    second = np.full(lay.size, -1, dtype=np.int64)
    for i, s in enumerate(stage):
        first[lay.forward[i]] = s * CLASSES + FORWARD
        first[lay.backward[i]] = s * CLASSES + BACKWARD
        second[[lay.backward[i], lay.weights[i], lay.updates[i]]] = s
    for j, (p, c, _) in enumerate(lay.edges):
        s = stage[p]
        if stage[c] == s:
            first[lay.edge_forward[j]] = s * CLASSES + FORWARD
            first[lay.edge_backward[j]] = s * CLASSES + BACKWARD
            second[lay.edge_backward[j]] = s
        else:
            first[lay.edge_forward[j]] = s * CLASSES + SEND_FORWARD
            first[lay.edge_backward[j]] = s * CLASSES + SEND_BACKWARD
    return first, second


def task_repeats(
    lay: Layout, slot_of_task: np.ndarray, pipeline: Pipeline, stage: list[int]
) -> np.ndarray:
    """Per task of one microbatch's task graph, how many times a step runs it: every
    microbatch's passes and moves, the tails (weights' rings and updates) once."""
    first, _ = slot_labels(lay, stage)
    return np.where(first[slot_of_task] < 0, 1, pipeline.microbatches)


def price_time(
    tg: TaskGraph, lay: Layout, slot_of_task: np.ndarray, pipeline: Pipeline, stage: list[int]
) -> tuple[tuple[StageTimes, ...], PipelineTiming, int]:
    """Each stage's times, the schedule's timing, and the bytes moved in a step (every
    microbatch's transfers and in-pass rings, the tails' rings once)."""
    count = len(pipeline.stages)
    first, second = slot_labels(lay, stage)
    spans = makespans(tg, first[slot_of_task], count * CLASSES)
    with_tail = makespans(tg, second[slot_of_task], count)
    times = []
    for s in range(count):
        f, b, sf, sb = spans[s * CLASSES : (s + 1) * CLASSES]
        tail = max(0.0, with_tail[s] - b)
        times.append(StageTimes(f, b, sf, sb, tail))
    timing = time_pipeline(tuple(times), pipeline.microbatches, pipeline.schedule)
    tails = first[slot_of_task] < 0  # the weights' and updates' slots
    per_microbatch = int(tg.nbytes[~tails].sum())
    moved = pipeline.microbatches * per_microbatch + int(tg.nbytes[tails].sum())
    return tuple(times), timing, moved


def held_activations(
    pg: PartitionedGraph,
    memory: Mapping[str, OpMemory],
    itemsize: int,
    devices: int,
    objects: bool,
) -> list[int]:
    """Per device, what one microbatch holds between its forward and its backward: all
    the plain model holds for the step (``OpMemory.held`` and the edges' buffers) but the
    weights' share (``OpMemory.weights``) and the activations' gradients its backward
    has yet to make: its output tiles (none for recomputed ops) and the input, gradient
    and receive buffers of the slot the executor gives each microbatch a rank holds at
    once (executor/program.py)."""
    held = [0] * devices
    for op in pg.graph.ops:
        m = memory[op.name]
        for pieces, sign in ((m.held, 1), (m.weights, -1), (m.grads, -1), (m.weight_grads, 1)):
            for d, n in pieces:
                held[d] += sign * n
    count = readers(pg.edges)
    for edge in pg.edges:
        ptasks, ctasks = pg.tasks[edge.producer], pg.tasks[edge.consumer]
        sole = count[edge.tensor] == 1
        for d, n in _edge_bytes(pg.graph, edge, ptasks, ctasks, itemsize, sole, objects):
            held[d] += n
    return held


def price_memory(
    pg: PartitionedGraph,
    pipeline: Pipeline,
    plain: tuple[int, ...],
    memory: Mapping[str, OpMemory],
    itemsize: int,
    objects: bool,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(peak per device, held microbatches per stage): the plain peak of one
    microbatch's step plus what the other microbatches held at once hold."""
    count, m = len(pipeline.stages), pipeline.microbatches
    held = tuple(held_at_most(pipeline.schedule, s, count, m) for s in range(count))
    configs = {op.name: pg.strategy[op.name] for op in pg.graph.ops}
    extra = held_activations(pg, memory, itemsize, len(plain), objects)
    peak = list(plain)
    for s, devs in enumerate(stage_devices(pipeline, configs)):
        for d in devs:
            peak[d] += (held[s] - 1) * extra[d]
    return tuple(peak), held


def price_pipeline(
    pg: PartitionedGraph,
    pipeline: Pipeline,
    tg: TaskGraph,
    lay: Layout,
    slot_of_task: np.ndarray,
    plain_memory: tuple[int, ...],
    memory: Mapping[str, OpMemory],
    itemsize: int,
    objects: bool = False,
) -> PipelinePrice:
    """The step, bytes moved, per-device peak and per-stage report of a pipeline plan
    (``memory``: each op's ``OpMemory`` under the plan, by op name; ``objects``: the
    runtime's Python objects count, as ``peak_memory`` counts them)."""
    stage_of = pipeline.stage_of()
    stage = [stage_of[op.name] for op in pg.graph.ops]
    times, timing, moved = price_time(tg, lay, slot_of_task, pipeline, stage)
    peak, held = price_memory(pg, pipeline, plain_memory, memory, itemsize, objects)
    configs = {op.name: pg.strategy[op.name] for op in pg.graph.ops}
    stages = tuple(
        StageReport(devs, t, h, bubble)
        for devs, t, h, bubble in zip(
            stage_devices(pipeline, configs), times, held, timing.bubble, strict=True
        )
    )
    report = PipelineEvaluation(pipeline.schedule.value, pipeline.microbatches, stages)
    return PipelinePrice(timing.step_s, moved, peak, report)
