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

A plan's ``pipeline`` (``Pipeline``) names each stage's ops; every op keeps its SOAP
config, whose devices must lie in its stage's devices (no device in two stages). The
graph a pipeline plan's ops are split on is the model at the microbatch's batch
(``Pipeline.microbatch_size``): a Sample degree counts pieces of a microbatch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from onnx2soap.errors import PlanError
from onnx2soap.ir import Graph
from onnx2soap.soap.partition import ParallelConfig


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


SCHEDULES = tuple(s.value for s in Schedule)


@dataclass(frozen=True)
class Pipeline:
    """A plan's pipeline: its stages' ops (in stage order), microbatches per step and
    the schedule."""

    stages: tuple[tuple[str, ...], ...]
    microbatches: int
    schedule: Schedule = Schedule.ONE_F_ONE_B

    def stage_of(self) -> dict[str, int]:
        return {op: s for s, ops in enumerate(self.stages) for op in ops}

    def microbatch_size(self, batch: int) -> int:
        """The samples of one microbatch of a step of ``batch``; ``PlanError`` where the
        microbatches do not divide the batch."""
        if batch % self.microbatches:
            raise PlanError(
                f"{self.microbatches} microbatches do not divide the batch of {batch} "
                f"(use a divisor of {batch})"
            )
        return batch // self.microbatches


def stage_devices(
    pipeline: Pipeline, configs: Mapping[str, ParallelConfig]
) -> tuple[tuple[int, ...], ...]:
    """Each stage's devices: those its ops' configs name, sorted."""
    return tuple(
        tuple(sorted({d for op in ops for d in configs[op].devices})) for ops in pipeline.stages
    )


def check_pipeline_plan(
    pipeline: Pipeline, graph: Graph, configs: Mapping[str, ParallelConfig], devices: int
) -> None:
    """A pipeline the executor can run and the simulator time: every op of ``graph`` (the
    model at the microbatch's batch) in exactly one stage, stages on disjoint devices,
    and data flowing from a stage only to itself and later ones."""
    check_pipeline(len(pipeline.stages), pipeline.microbatches)
    names = {op.name for op in graph.ops}
    seen: dict[str, int] = {}
    for s, ops in enumerate(pipeline.stages):
        if not ops:
            raise PlanError(f"pipeline.stages[{s}] has no ops (every stage needs at least one)")
        for op in ops:
            if op not in names:
                raise PlanError(f"pipeline.stages[{s}]: '{op}' is not an op of the model")
            if op in seen:
                raise PlanError(f"pipeline.stages[{s}]: op '{op}' is also in stage {seen[op]}")
            seen[op] = s
    missing = [op.name for op in graph.ops if op.name not in seen]
    if missing:
        raise PlanError(f"pipeline: ops in no stage: {missing[:5]} (every op needs one)")
    if len(pipeline.stages) > devices:
        raise PlanError(
            f"pipeline: {len(pipeline.stages)} stages on {devices} devices (at most one "
            "stage per device)"
        )
    owner: dict[int, int] = {}
    for s, devs in enumerate(stage_devices(pipeline, configs)):
        for d in devs:
            if owner.setdefault(d, s) != s:
                raise PlanError(
                    f"pipeline.stages[{s}]: device {d} also runs stage {owner[d]} (stages "
                    "need disjoint devices)"
                )
    producer = {op.output: op.name for op in graph.ops}
    for op in graph.ops:
        for tensor in op.inputs:
            source = producer.get(tensor)
            if source is not None and seen[source] > seen[op.name]:
                raise PlanError(
                    f"pipeline: op '{op.name}' (stage {seen[op.name]}) reads '{tensor}' from "
                    f"a later stage ({seen[source]}); data must flow to later stages"
                )
