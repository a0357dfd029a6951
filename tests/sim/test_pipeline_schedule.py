"""Pipeline schedules against their definitions and hand-timed steps: GPipe's and
1F1B's pass orders written out, the activations each stage holds (GPipe: every
microbatch; 1F1B: ``min(S - s, M)``), equal stages' step ``(M + S - 1)(f + b)``
(Huang et al., GPipe; Narayanan et al., PipeDream-Flush), and a two-stage step with
moves timed by hand, with and without a resume after a long wait."""

from __future__ import annotations

import pytest

from onnx2soap.errors import PlanError
from onnx2soap.sim.machine import Resume
from onnx2soap.sim.pipeline_schedule import StageTimes, time_pipeline
from onnx2soap.soap.pipeline import Schedule, held_at_most, stage_order


def _names(schedule: Schedule, stage: int, stages: int, microbatches: int) -> str:
    return " ".join(str(p) for p in stage_order(schedule, stage, stages, microbatches))


def test_orders_are_the_schedules() -> None:
    assert _names(Schedule.GPIPE, 1, 3, 3) == "F0 F1 F2 B0 B1 B2"
    # 1F1B on 4 stages, 6 microbatches: 3, 2, 1, 0 warm-up forwards.
    assert _names(Schedule.ONE_F_ONE_B, 0, 4, 6) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert _names(Schedule.ONE_F_ONE_B, 2, 4, 6) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5"
    assert _names(Schedule.ONE_F_ONE_B, 3, 4, 6) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    # Fewer microbatches than stages: the first stage only warms up, then drains.
    assert _names(Schedule.ONE_F_ONE_B, 0, 4, 2) == "F0 F1 B0 B1"


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 8])
def test_activations_held(stages: int, microbatches: int) -> None:
    for s in range(stages):
        assert held_at_most(Schedule.GPIPE, s, stages, microbatches) == microbatches
        want = min(stages - s, microbatches)
        assert held_at_most(Schedule.ONE_F_ONE_B, s, stages, microbatches) == want


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 7])
def test_equal_stages_take_the_textbook_step(schedule, stages: int, microbatches: int) -> None:
    forward, backward = 1.0, 2.5
    timing = time_pipeline((StageTimes(forward, backward),) * stages, microbatches, schedule)
    assert timing.step_s == pytest.approx((microbatches + stages - 1) * (forward + backward))
    # The bubble: (S - 1) / (M + S - 1) of the step on every stage.
    for bubble in timing.bubble:
        assert bubble == pytest.approx((stages - 1) / (microbatches + stages - 1))


@pytest.mark.parametrize("schedule", list(Schedule))
def test_two_stages_with_moves_timed_by_hand(schedule: Schedule) -> None:
    """F = B = 1 s, each move 0.5 s, 2 microbatches. GPipe: stage 0 runs F0 0-1, F1 1-2;
    stage 1 F0 1.5-2.5, F1 2.5-3.5, B0 3.5-4.5, B1 4.5-5.5; stage 0 B0 5-6, B1 6-7.
    1F1B: stage 1 runs F0 1.5-2.5, B0 2.5-3.5, F1 3.5-4.5, B1 4.5-5.5; stage 0 F0, F1,
    then B0 4-5 (its gradient left at 3.5), B1 6-7. Both end at 7 s, plus the tails."""
    first = StageTimes(1.0, 1.0, send_forward_s=0.5, send_backward_s=0.5, tail_s=0.25)
    last = StageTimes(1.0, 1.0, tail_s=2.0)
    timing = time_pipeline((first, last), 2, schedule)
    starts = {(t.stage, str(t.step)): t.start_s for t in timing.passes}
    if schedule is Schedule.GPIPE:
        assert starts == {
            (0, "F0"): 0, (0, "F1"): 1, (0, "B0"): 5, (0, "B1"): 6,
            (1, "F0"): 1.5, (1, "F1"): 2.5, (1, "B0"): 3.5, (1, "B1"): 4.5,
        }  # fmt: skip
    else:
        assert starts == {
            (0, "F0"): 0, (0, "F1"): 1, (0, "B0"): 4, (0, "B1"): 6,
            (1, "F0"): 1.5, (1, "B0"): 2.5, (1, "F1"): 3.5, (1, "B1"): 4.5,
        }  # fmt: skip
    # The last stage's long tail (5.5 + 2) outlasts the first's (7 + 0.25).
    assert timing.step_s == pytest.approx(7.5)
    assert timing.held == ((2, 2) if schedule is Schedule.GPIPE else (2, 1))


def test_a_slow_stage_sets_the_pace() -> None:
    """A bottleneck stage of F + B = 3 s between stages of 1 s. 1F1B: it starts after the
    first stage's F0 (0.5 s), never waits after that (the others keep ahead of it), and
    the step ends with the first stage's B7: 0.5 + 8 x 3 + 0.5 = 25 s. GPipe: after its
    F7 (at 8.5 s) it waits for the last stage's F7 and B0 (1 s) before its B0: 26 s."""
    fast, slow = StageTimes(0.5, 0.5), StageTimes(1.0, 2.0)
    for schedule, step in ((Schedule.ONE_F_ONE_B, 25.0), (Schedule.GPIPE, 26.0)):
        timing = time_pipeline((fast, slow, fast), 8, schedule)
        assert timing.step_s == pytest.approx(step), schedule
        assert timing.bubble[1] == pytest.approx(1 - 24 / step)
    assert time_pipeline((fast, slow, fast), 8, Schedule.ONE_F_ONE_B).held == (3, 2, 1)


@pytest.mark.parametrize(("stages", "microbatches"), [(0, 4), (2, 0)])
def test_an_empty_pipeline_is_refused(stages: int, microbatches: int) -> None:
    with pytest.raises(PlanError, match="at least one"):
        stage_order(Schedule.GPIPE, 0, stages, microbatches)


def test_a_stage_that_slept_through_its_wait_resumes_slowly() -> None:
    """``Machine.resume`` (0.1 s past a wait of over 0.4 s) on the GPipe step above:
    stage 1's F0 waited 1.5 s for its input (2.6 s, not 2.5), stage 0's B0 3.1 s for
    its gradient (5.1-6.2); F1 and B1 found their input ready or waited 0.1 s at most,
    and pay nothing. Stage 1 ends at 5.6 + its 2 s tail: the step is 7.6 s."""
    first = StageTimes(1.0, 1.0, send_forward_s=0.5, send_backward_s=0.5, tail_s=0.25)
    last = StageTimes(1.0, 1.0, tail_s=2.0)
    timing = time_pipeline((first, last), 2, Schedule.GPIPE, Resume(after=0.4, cost=0.1))
    spans = {
        (t.stage, str(t.step)): (round(t.start_s, 9), round(t.end_s, 9)) for t in timing.passes
    }
    assert spans == {
        (0, "F0"): (0, 1), (0, "F1"): (1, 2), (0, "B0"): (5.1, 6.2), (0, "B1"): (6.2, 7.2),
        (1, "F0"): (1.5, 2.6), (1, "F1"): (2.6, 3.6), (1, "B0"): (3.6, 4.6),
        (1, "B1"): (4.6, 5.6),
    }  # fmt: skip
    assert timing.step_s == pytest.approx(7.6)
    # Waits that never pass ``after`` cost nothing.
    calm = time_pipeline((first, last), 2, Schedule.GPIPE, Resume(after=3.5, cost=0.1))
    assert calm.step_s == pytest.approx(7.5)


def test_stages_on_one_core_take_turns() -> None:
    """Both stages' ranks on core 0: the GPipe step above with every pass in turn.
    Stage 0 runs F0 0-1, F1 1-2; stage 1 F0 2-3, F1 3-4, B0 4-5, B1 5-6; stage 0 B0
    (its gradient landed at 5.5) 6-7, B1 7-8; then the tails in the order the stages'
    last passes ended: stage 1's 8-10, stage 0's 10-10.25. The step is 10.25 s: every
    pass and tail one after the other."""
    first = StageTimes(1.0, 1.0, send_forward_s=0.5, send_backward_s=0.5, tail_s=0.25)
    last = StageTimes(1.0, 1.0, tail_s=2.0)
    one = (frozenset({0}), frozenset({0}))
    timing = time_pipeline((first, last), 2, Schedule.GPIPE, cores=one)
    starts = {(t.stage, str(t.step)): t.start_s for t in timing.passes}
    assert starts == {
        (0, "F0"): 0, (0, "F1"): 1, (0, "B0"): 6, (0, "B1"): 7,
        (1, "F0"): 2, (1, "F1"): 3, (1, "B0"): 4, (1, "B1"): 5,
    }  # fmt: skip
    assert timing.step_s == pytest.approx(10.25)
    # A core each: as the test above, 7.5 s.
    apart = (frozenset({0}), frozenset({1}))
    assert time_pipeline((first, last), 2, Schedule.GPIPE, cores=apart).step_s == 7.5


def test_moves_hold_their_sender_where_cores_copy() -> None:
    """CPU ranks copy their messages (``cores_copy``): a move holds its sending stage.
    The GPipe step above: stage 0 sends F0's output 1-1.5 and runs F1 at 1.5 (not 1);
    stage 1 runs F0 1.5-2.5, F1 when it lands (3), B0 4-5, sends its gradient 5-5.5,
    B1 5.5-6.5, sends 6.5-7, then its 2 s tail: 9 s. Stage 0's B0 5.5-6.5, B1 7-8."""
    first = StageTimes(1.0, 1.0, send_forward_s=0.5, send_backward_s=0.5, tail_s=0.25)
    last = StageTimes(1.0, 1.0, tail_s=2.0)
    timing = time_pipeline((first, last), 2, Schedule.GPIPE, cores_copy=True)
    starts = {(t.stage, str(t.step)): t.start_s for t in timing.passes}
    assert starts == {
        (0, "F0"): 0, (0, "F1"): 1.5, (0, "B0"): 5.5, (0, "B1"): 7,
        (1, "F0"): 1.5, (1, "F1"): 3, (1, "B0"): 4, (1, "B1"): 5.5,
    }  # fmt: skip
    assert timing.step_s == pytest.approx(9.0)
