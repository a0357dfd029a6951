"""The profiler (``measure/profiler.py``): every timing it would take runs with the
executor's kernels, and its in-step calibration names the one-device plan's tasks."""

from __future__ import annotations

import numpy as np
import pytest

from onnx2soap.importer import load_model
from onnx2soap.measure.profiler import (
    MAX_CLEAN_STEPS,
    MIN_CLEAN_STEPS,
    Target,
    _in_step_seconds,
    clean_steps,
    in_step_times,
    measure,
    numpy_kernels,
    profile_items,
)
from onnx2soap.sim.calibration_plan import Traced, calibration_keys, calibration_plan
from onnx2soap.sim.costdb import Phase
from onnx2soap.soap import Partitioner


@pytest.mark.parametrize("name", ["bnnet", "tied"])
def test_every_item_runs_with_the_executors_kernels(export_model, name: str) -> None:
    """Statistics (BatchNorm's halves), Dropout's random key, ids below their bound,
    partial sums: every timing the profile would take runs, in-process."""
    graph = load_model(export_model(name), batch=4).graph
    target = Target(graph, Partitioner(graph), numpy_kernels(np.float32))
    for item in profile_items(graph, 2, 4):
        timing = measure(target, item, repeat=1, min_s=0.0)
        assert 0 < timing.seconds < 1 and timing.key == item.key


def _step_events(step: int, instructions: list[tuple[str, float, float]]) -> list[dict]:
    """A traced step: (name, idle before it, duration) in microseconds, back to back."""
    events, clock = [], 0.0
    for name, idle, dur in instructions:
        clock += idle
        events.append({"name": name, "ts": clock, "dur": dur, "args": {"step": step}})
        clock += dur
    return events


def test_in_step_seconds_add_a_tasks_instructions_and_reach_the_median_step() -> None:
    """A statistics op's three instructions are one task (20 us here, not their mean of
    6.7); tasks of one key are averaged; the medians are scaled to the untraced step
    given (63 us, while the tasks' medians add up to 42: each step one task was slow;
    the traced steps' median, 72 us, holds the tracer's own time); the tracemalloc step
    is left out."""
    k_bn, k_relu = (Phase.FORWARD, "BatchNormalization k"), (Phase.FORWARD, "Relu k")
    names = {
        "fwd bn[0] partial": Traced("fwd bn", k_bn),
        "stats bn fwd": Traced("fwd bn", k_bn),
        "fwd bn[0]": Traced("fwd bn", k_bn),
        "fwd r1[0]": Traced("fwd r1", k_relu),
        "fwd r2[0]": Traced("fwd r2", k_relu),
    }

    def step(n: int, finish: float = 5, r2: float = 10) -> list[dict]:
        return _step_events(
            n,
            [
                ("fwd bn[0] partial", 0, 10),
                ("stats bn fwd", 2, 3),
                ("fwd bn[0]", 0, finish),
                ("fwd r1[0]", 2, 8),
                ("fwd r2[0]", 0, r2),
                ("wait allreduce", 0, 2),  # in the step, in no task
            ],
        )

    events = step(2, finish=900, r2=900) + step(3, r2=40) + step(4, finish=35) + step(5)
    skew = 63 / 42
    got = _in_step_seconds(events, names, 63e-6)
    assert got.keys() == {k_bn, k_relu}
    assert got[k_bn] == pytest.approx(20e-6 * skew)
    assert got[k_relu] == pytest.approx(10e-6 * skew)


def test_the_calibration_runs_a_second_of_steps_within_bounds() -> None:
    assert clean_steps(0.01) == 100
    assert clean_steps(1.0) == MIN_CLEAN_STEPS  # a slow step: still a median of several
    assert clean_steps(1e-6) == MAX_CLEAN_STEPS  # a trivial model: not a million steps


@pytest.mark.parametrize("name", ["bnnet", "tied"])
def test_in_step_times_cover_the_one_device_plan(export_model, name: str) -> None:
    """The executor's runtime in-process: every task of the one-device plan (statistics
    halves included) and every update gets an in-step time under a key the profile
    times."""
    model = load_model(export_model(name), batch=4)
    graph = model.graph
    times = in_step_times(model, np.dtype(np.float32))
    wanted = {t.key for t in calibration_keys(graph, calibration_plan(graph)).values()}
    assert set(times) == wanted
    assert wanted <= {(x.phase, x.key) for x in profile_items(graph, 2, 4)}
    assert all(0 < s < 1 for s in times.values())
