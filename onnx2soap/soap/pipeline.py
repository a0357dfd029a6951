"""Pipeline schedules: the order in which a stage runs its microbatches' passes.

A pipeline splits the ops into ``stages`` (contiguous in topological order, each on its
own devices) and the batch into ``microbatches``. Every stage runs a forward and a
backward pass per microbatch, one pass at a time; the schedule fixes their order, which
the simulator times and the executor follows (one order, both sides):

- GPipe: every forward, then every backward (all ``M`` microbatches' activations held
  at once on every stage).
- 1F1B (PipeDream-Flush, Megatron's default): stage ``s`` of ``S`` runs
  ``min(S - s - 1, M)`` warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards: at most ``min(S - s, M)`` microbatches' activations
  held on stage ``s``; the same bubble as GPipe when the stages take equal time.

Both flush at the end of the step: weights are updated once, after the last backward,
with the gradients summed over the microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from onnx2soap.errors import PlanError


class Schedule(Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


class Pass(Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True, order=True)
class StagePass:
    """One pass of one microbatch (0-based) on a stage."""

    microbatch: int
    kind: Pass

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}"


def stage_order(
    schedule: Schedule, stage: int, stages: int, microbatches: int
) -> tuple[StagePass, ...]:
    """The passes stage ``stage`` (0-based, of ``stages``) runs in a step, in order."""
    check_pipeline(stages, microbatches)
    if not 0 <= stage < stages:
        raise PlanError(f"stage {stage} is outside 0..{stages - 1}")
    forwards = [StagePass(m, Pass.FORWARD) for m in range(microbatches)]
    backwards = [StagePass(m, Pass.BACKWARD) for m in range(microbatches)]
    if schedule is Schedule.GPIPE:
        return (*forwards, *backwards)
    warmup = min(stages - stage - 1, microbatches)
    order = forwards[:warmup]
    for m in range(microbatches - warmup):  # steady state: one forward, one backward
        order += [forwards[warmup + m], backwards[m]]
    return (*order, *backwards[microbatches - warmup :])


def held_at_most(schedule: Schedule, stage: int, stages: int, microbatches: int) -> int:
    """The most microbatches whose activations stage ``stage`` holds at once (forward
    done, backward not yet), read off its order."""
    held = most = 0
    for p in stage_order(schedule, stage, stages, microbatches):
        held += 1 if p.kind is Pass.FORWARD else -1
        most = max(most, held)
    return most


def check_pipeline(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise PlanError(f"a pipeline needs at least one stage, got {stages}")
    if microbatches < 1:
        raise PlanError(f"a pipeline needs at least one microbatch, got {microbatches}")
