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
plus, for each other microbatch its stage holds at once (``held_at_most`` - 1 of them,
between their forward and backward), its output tiles (none for recomputed ops: a
recomputed stage holds its checkpoints), and for each other slot of buffers the
executor makes (``open_at_most`` - 1; ``executor/program.py`` gives a slot to every
microbatch open at once on the rank, from its first instruction, often a receive
posted with the previous stage's forward, to its last: under 1F1B the last stage has
two though it holds one microbatch's activations) the slot's input, gradient and
receive buffers, made once. The step's data rows count once (one microbatch's); the
runtime's Python objects per instruction on CPU ranks count for every microbatch (the
program has every microbatch's instructions), its pieces' once per step.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from onnx2soap.sim.memory import (
    PER_INSTRUCTION,
    OpMemory,
    add_edges,
    batch_bytes,
    order_of,
    total,
)
from onnx2soap.sim.pipeline_schedule import PipelineTiming, StageTimes, time_pipeline
from onnx2soap.sim.simulate import chunks, wakes_of
from onnx2soap.sim.taskgraph import Layout, TaskGraph
from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.pipeline import (
    Pass,
    Pipeline,
    Schedule,
    held_at_most,
    stage_devices,
    stage_order,
)

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
    task's class left out (a resume and a cooling, ``simulate.Wakes``, count waits and
    silences within the class: ``time_pipeline`` counts resumes between passes). The
    graph is read a chunk at a time (``simulate.chunks``), the labels and end times as
    8-byte numbers: the whole graph as lists was 1.5 GB at LLaMA-3-8B's 4.5 M tasks."""
    lab = array("q", np.asarray(label, dtype=np.int64).tobytes())
    end = array("d", bytes(8 * tg.size))
    free = [[0.0] * tg.num_resources for _ in range(count)]
    wakes = [wakes_of(tg) for _ in range(count)]
    span = [0.0] * count
    for chunk in chunks(tg):
        duration, kind, res_ptr, res_idx = chunk.duration, chunk.kind, chunk.res_ptr, chunk.res_idx
        pred_ptr, pred_idx = chunk.pred_ptr, chunk.pred_idx
        i = chunk.first
        for j in range(len(duration)):
            c = lab[i]
            if c < 0:
                i += 1
                continue
            s = 0.0
            for p in pred_idx[pred_ptr[j] : pred_ptr[j + 1]]:
                if lab[p] == c:
                    t = end[p]
                    if t > s:
                        s = t
            ready, turn = s, free[c]
            resources = res_idx[res_ptr[j] : res_ptr[j + 1]]
            for r in resources:
                t = turn[r]
                if t > s:
                    s = t
            e = s + duration[j]
            if (w := wakes[c]) is not None and (
                x := w.extra(ready, kind[j], duration[j], resources, turn)
            ):
                e += x
            end[i] = e
            for r in resources:
                turn[r] = e
            if e > span[c]:
                span[c] = e
            i += 1
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
    tg: TaskGraph,
    lay: Layout,
    slot_of_task: np.ndarray,
    pipeline: Pipeline,
    stage: list[int],
    devices: tuple[tuple[int, ...], ...] = (),
) -> tuple[tuple[StageTimes, ...], PipelineTiming, int]:
    """Each stage's times, the schedule's timing, and the bytes moved in a step (every
    microbatch's transfers and in-pass rings, the tails' rings once); ``devices``: each
    stage's, whose shared cores (``TaskGraph.turns``) its passes hold."""
    count = len(pipeline.stages)
    first, second = slot_labels(lay, stage)
    spans = makespans(tg, first[slot_of_task], count * CLASSES)
    with_tail = makespans(tg, second[slot_of_task], count)
    times = []
    for s in range(count):
        f, b, sf, sb = spans[s * CLASSES : (s + 1) * CLASSES]
        tail = max(0.0, with_tail[s] - b)
        times.append(StageTimes(f, b, sf, sb, tail))
    cores = None
    if tg.turns is not None and devices:
        cores = tuple(frozenset(tg.turns[d] for d in devs) for devs in devices)
    timing = time_pipeline(
        tuple(times), pipeline.microbatches, pipeline.schedule, tg.resume, cores, tg.cores_copy
    )
    tails = first[slot_of_task] < 0  # the weights' and updates' slots
    per_microbatch = int(tg.nbytes[~tails].sum())
    moved = pipeline.microbatches * per_microbatch + int(tg.nbytes[tails].sum())
    return tuple(times), timing, moved


def open_at_most(schedule: Schedule, stage: int, stages: int, microbatches: int) -> int:
    """The most microbatches open at once on ``stage``'s ranks: the slots of buffers the
    executor makes there (``executor/program.py``'s ``_with_lifetimes``). Passes run in
    ``pass_order``'s global order (each stage as far as it can go, in turn); a
    microbatch opens on a stage with its first instruction, the receive of its input
    posted in the previous stage's forward pass (or its own forward on the first stage),
    and closes after its backward on the stage (its gradient's receive comes earlier,
    with the next stage's backward). Stages that only a skip edge links are not seen."""
    orders = [stage_order(schedule, s, stages, microbatches) for s in range(stages)]
    cursor, done = [0] * stages, set()
    opened: set[int] = set()
    most = 0
    while any(c < len(o) for c, o in zip(cursor, orders, strict=True)):
        progressed = False
        for s in range(stages):
            while cursor[s] < len(orders[s]):
                p = orders[s][cursor[s]]
                before = s - 1 if p.kind is Pass.FORWARD else s + 1
                if 0 <= before < stages and (before, p) not in done:
                    break
                done.add((s, p))
                cursor[s] += 1
                progressed = True
                if p.kind is Pass.FORWARD and s in (stage, stage - 1):
                    opened.add(p.microbatch)  # the stage's receive, or its own forward
                    most = max(most, len(opened))
                elif p.kind is Pass.BACKWARD and s == stage:
                    opened.discard(p.microbatch)
        if not progressed:
            raise AssertionError(f"the {schedule.value} schedule waits on itself")
    return most


@dataclass(frozen=True)
class Held:
    """Per device, what one more microbatch the stage holds adds (its ``activations``:
    output tiles) and what one more slot of buffers adds (``buffers``)."""

    activations: list[int]
    buffers: list[int]


def held_activations(
    pg: PartitionedGraph,
    memory: Mapping[str, OpMemory],
    itemsize: int,
    devices: int,
    objects: bool,
    recompute: frozenset[str] = frozenset(),
    stored: int = 0,
) -> Held:
    """Per device, what one microbatch holds between its forward and its backward: the
    tiles and input buffers its ops' backwards read, the tiles a reader keeps in place or
    a send holds, and the losses (executor/lifetimes.py; nothing for recomputed ops but
    their inputs); and what its slot of buffers holds: all the plain model holds for the
    step (``OpMemory.held`` and the edges' buffers) but the weights' share, their
    gradients included (``OpMemory.weights``), and the losses: the receive buffers, rows
    and staging copies (executor/program.py)."""
    outputs, held = [0] * devices, [0] * devices
    edges = add_edges(held, pg, itemsize, objects, recompute, stored)
    for i, op in enumerate(pg.graph.ops):
        m = memory[op.name]
        until = edges.until.get(i, {})
        for d, n in (*m.outputs, *m.kept_tiles, *m.kept_inputs, *edges.kept_inputs.get(i, ())):
            outputs[d] += n
        for d, n in m.read_tiles:
            outputs[d] += n if d in until else 0
        for _, d, n in edges.shared_to_backward.get(i, ()):  # a shared buffer a later
            outputs[d] += n  # reader keeps
        for pieces, sign in (
            (m.held, 1),
            (m.weights, -1),
            (m.outputs, -1),
        ):
            for d, n in pieces:
                held[d] += sign * n
    return Held(outputs, held)


def later_microbatch(
    pg: PartitionedGraph,
    memory: Mapping[str, OpMemory],
    itemsize: int,
    devices: int,
    objects: bool,
    recompute: frozenset[str] = frozenset(),
    stored: int = 0,
) -> tuple[int, ...]:
    """Per device, the plain model's peak of a step's microbatch after the first: every
    weight gradient is made already (the first microbatch's backward made them; later
    ones are summed into them), so none is left out of its passes as not yet made, and
    each backward kernel's fresh weight gradient is a temporary, summed, then dropped
    (``executor/step.py``'s ``_weight_grad``)."""
    held = batch_bytes(pg, devices, itemsize)
    ops = []
    for op in pg.graph.ops:
        m = memory[op.name]
        for d, n in m.held:
            held[d] += n
        backward = dict(m.backward)
        for d, n in m.grads:  # made already: the kernel's fresh one, summed, then dropped
            backward[d] = backward.get(d, 0) + n
        ops.append(replace(m, grads=(), backward=tuple(backward.items())))
    edges = add_edges(held, pg, itemsize, objects, recompute, stored)
    return total(held, ops, order_of(pg.graph), edges)


def microbatch_instructions(
    pg: PartitionedGraph, memory: Mapping[str, OpMemory], devices: int, objects: bool
) -> list[int]:
    """Per device, the Python objects of one microbatch's instructions on CPU ranks
    (``memory.PER_INSTRUCTION`` each): the program has every microbatch's own (ops'
    computes, statistics and partial sums, ``OpMemory.instructions``; a crossing piece's
    Send, Recv and Wait each way), the weight gradients' all-reduces once."""
    out = [0] * devices
    if not objects:
        return out
    for op in pg.graph.ops:
        for d, n in memory[op.name].instructions:
            out[d] += n
    for edge in pg.edges:
        grad = pg.graph.differentiable(edge.tensor)
        ptasks, ctasks = pg.tasks[edge.producer], pg.tasks[edge.consumer]
        for o in edge.overlaps:
            p, c = ptasks[o.src_task].device, ctasks[o.dst_task].device
            if p != c:
                out[c] += (3 if grad else 2) * PER_INSTRUCTION
                out[p] += (3 if grad else 1) * PER_INSTRUCTION
    return out


def price_memory(
    pg: PartitionedGraph,
    pipeline: Pipeline,
    plain: tuple[int, ...],
    memory: Mapping[str, OpMemory],
    itemsize: int,
    objects: bool,
    recompute: frozenset[str] = frozenset(),
    stored: int = 0,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(peak per device, held microbatches per stage): the plain peak of one
    microbatch's step (of a later one's, which finds every weight gradient made), the
    other slots' buffers and microbatches' instructions, and the output tiles of the
    other microbatches the stage holds at once. A closed microbatch holds nothing: the
    transport lets each sent piece go once its send completes (executor/transport.py),
    not at the step's end."""
    count, m, schedule = len(pipeline.stages), pipeline.microbatches, pipeline.schedule
    held = tuple(held_at_most(schedule, s, count, m) for s in range(count))
    slots = tuple(open_at_most(schedule, s, count, m) for s in range(count))
    configs = {op.name: pg.strategy[op.name] for op in pg.graph.ops}
    extra = held_activations(pg, memory, itemsize, len(plain), objects, recompute, stored)
    peak = list(plain)
    instructions = microbatch_instructions(pg, memory, len(plain), objects)
    if m > 1:
        later = later_microbatch(pg, memory, itemsize, len(plain), objects, recompute, stored)
        peak = [max(a, b) for a, b in zip(plain, later, strict=True)]
    for s, devs in enumerate(stage_devices(pipeline, configs)):
        for d in devs:
            peak[d] += (held[s] - 1) * extra.activations[d]
            peak[d] += (slots[s] - 1) * extra.buffers[d]
            peak[d] += (m - 1) * instructions[d]
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
    recompute: frozenset[str] = frozenset(),
    stored: int = 0,
) -> PipelinePrice:
    """The step, bytes moved, per-device peak and per-stage report of a pipeline plan
    (``memory``: each op's ``OpMemory`` under the plan, by op name; ``objects``: the
    runtime's Python objects count, as ``peak_memory`` counts them)."""
    stage_of = pipeline.stage_of()
    stage = [stage_of[op.name] for op in pg.graph.ops]
    configs = {op.name: pg.strategy[op.name] for op in pg.graph.ops}
    devices = stage_devices(pipeline, configs)
    times, timing, moved = price_time(tg, lay, slot_of_task, pipeline, stage, devices)
    peak, held = price_memory(
        pg, pipeline, plain_memory, memory, itemsize, objects, recompute, stored
    )
    stages = tuple(
        StageReport(devs, t, h, bubble)
        for devs, t, h, bubble in zip(devices, times, held, timing.bubble, strict=True)
    )
    report = PipelineEvaluation(pipeline.schedule.value, pipeline.microbatches, stages)
    return PipelinePrice(timing.step_s, moved, peak, report)
