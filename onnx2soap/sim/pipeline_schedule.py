"""Time a pipeline's schedule from its stages' pass times and their transfers.

Each stage runs its passes one at a time in ``soap.pipeline.stage_order``'s order. A
forward of microbatch ``m`` on stage ``s > 0`` waits for stage ``s - 1``'s forward of
``m`` and the move of its activations; a backward on a stage before the last waits for
the next stage's backward of ``m`` and the move of the gradient. Moves between two
stages go one at a time in each direction (the link is shared by the microbatches) and
overlap with compute. After its last pass a stage pays its tail: the gradient sync over
its replicas and the update, once per step. The step ends when the last stage's tail
does; the bubble is the part of the step a stage spends neither computing nor in its
tail. On a machine with a resume cost (``Machine.resume``), a pass that waited past
``resume.after`` for its input runs ``resume.cost`` longer (its ranks slept; at most
``resume.slowdown`` times the pass). Where CPU ranks share cores, a pass holds the
cores its stage's ranks run on (``cores``): two stages on the same cores take turns,
as the operating system gives them the cores, instead of running at once (their tails
too, in the order their last passes end). Where cores copy messages (``cores_copy``:
CPU ranks), a move holds its sending stage and its cores until it ends, instead of
overlapping with the stage's next pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx2soap.errors import PlanError
from onnx2soap.sim.machine import Resume
from onnx2soap.soap.pipeline import Pass, Schedule, StagePass, held_at_most, stage_order


@dataclass(frozen=True)
class StageTimes:
    """One stage's costs: a microbatch's forward and backward, the moves of a
    microbatch's activations to the next stage and of their gradient back from it (zero
    on the last stage), and the step's tail (gradient sync and update)."""

    forward_s: float
    backward_s: float
    send_forward_s: float = 0.0
    send_backward_s: float = 0.0
    tail_s: float = 0.0


@dataclass(frozen=True)
class TimedPass:
    stage: int
    step: StagePass
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PipelineTiming:
    step_s: float
    passes: tuple[TimedPass, ...]  # in start order per stage
    held: tuple[int, ...]  # per stage: the most microbatches' activations held at once
    busy_s: tuple[float, ...]  # per stage: passes and tail

    @property
    def bubble(self) -> tuple[float, ...]:
        """Per stage, the fraction of the step it idles."""
        return tuple(1 - busy / self.step_s if self.step_s else 0.0 for busy in self.busy_s)


def time_pipeline(
    stages: tuple[StageTimes, ...],
    microbatches: int,
    schedule: Schedule,
    resume: Resume | None = None,
    cores: tuple[frozenset[int], ...] | None = None,
    cores_copy: bool = False,
) -> PipelineTiming:
    count = len(stages)
    orders = [stage_order(schedule, s, count, microbatches) for s in range(count)]
    ends: dict[tuple[int, StagePass], float] = {}
    arrivals: dict[tuple[int, StagePass], float] = {}  # when a pass's input reached it
    link_free = {Pass.FORWARD: [0.0] * count, Pass.BACKWARD: [0.0] * count}
    stage_free, cursor, timed = [0.0] * count, [0] * count, []
    on_cores = cores or (frozenset(),) * count
    core_free = dict.fromkeys(set().union(*on_cores), 0.0)
    while any(cursor[s] < len(orders[s]) for s in range(count)):
        progressed = False
        for s in range(count):
            while cursor[s] < len(orders[s]):
                step = orders[s][cursor[s]]
                ready = _input_ready(s, step, count, arrivals, ends)
                if ready is None:
                    break
                start = max(ready, stage_free[s], *(core_free[c] for c in on_cores[s]))
                end = start + (
                    stages[s].forward_s if step.kind is Pass.FORWARD else stages[s].backward_s
                )
                if resume is not None and ready - stage_free[s] > resume.after:
                    end += min(resume.cost, resume.slowdown * (end - start))
                ends[(s, step)] = stage_free[s] = end
                for c in on_cores[s]:
                    core_free[c] = end
                timed.append(TimedPass(s, step, start, end))
                sent = _send(s, step, end, stages, count, link_free, arrivals)
                if cores_copy and sent is not None:  # the sender's cores copy the move
                    stage_free[s] = sent
                    for c in on_cores[s]:
                        core_free[c] = sent
                cursor[s] += 1
                progressed = True
        if not progressed:  # no schedule of soap.pipeline's waits on itself; guard anyway
            raise PlanError(f"the {schedule.value} schedule deadlocks over {count} stages")
    finish = [0.0] * count
    for s in sorted(range(count), key=lambda s: stage_free[s]):  # tails in turn on cores
        start = max((stage_free[s], *(core_free[c] for c in on_cores[s])))
        finish[s] = start + stages[s].tail_s
        for c in on_cores[s]:
            core_free[c] = finish[s]
    busy = tuple(microbatches * (t.forward_s + t.backward_s) + t.tail_s for t in stages)
    held = tuple(held_at_most(schedule, s, count, microbatches) for s in range(count))
    return PipelineTiming(max(finish), tuple(timed), held, busy)


def _input_ready(s, step: StagePass, count: int, arrivals, ends) -> float | None:
    """When the pass's input is on stage ``s``; None while it is not yet produced."""
    if step.kind is Pass.FORWARD and s == 0:
        return 0.0
    if step.kind is Pass.BACKWARD and s == count - 1:
        return ends.get((s, StagePass(step.microbatch, Pass.FORWARD)))
    return arrivals.get((s, step))


def _send(s, step: StagePass, end: float, stages, count: int, link_free, arrivals) -> float | None:
    """Move a pass's result to the stage that needs it next, in the link's turn; when
    it ends (None: nothing to move)."""
    if step.kind is Pass.FORWARD and s < count - 1:
        to, cost = s + 1, stages[s].send_forward_s
    elif step.kind is Pass.BACKWARD and s > 0:
        to, cost = s - 1, stages[s - 1].send_backward_s
    else:
        return None
    links = link_free[step.kind]
    start = max(end, links[min(s, to)])
    links[min(s, to)] = start + cost
    arrivals[(to, step)] = start + cost
    return start + cost
