"""benchmarks/fidelity.py's summary of one model on one machine, against figures worked
out by hand: the step errors, Kendall's tau, and what trusting the model gets a user."""

from __future__ import annotations

import pytest

from benchmarks.fidelity import Result, memory_errors, over_fastest, summary


def _result(plan: str, predicted_ms: float, measured_ms: float) -> Result:
    seconds = measured_ms * 1e-3
    return Result(plan, predicted_ms * 1e-3, seconds, (seconds, seconds), (100,), (100,), (0,))


RESULTS = [
    _result("single-device", 3.0, 3.6),  # predicted as fast as the searched plan
    _result("searched", 3.0, 3.0),
    _result("data-parallel", 6.0, 2.4),  # the fastest measured, predicted slowest
]


def test_errors_and_tau_as_worked_out_by_hand() -> None:
    s = summary(RESULTS)
    # |3.0-3.6|/3.6, 0, |6.0-2.4|/2.4 -> (1/6 + 0 + 1.5) / 3
    assert s["step_error"] == pytest.approx((1 / 6 + 1.5) / 3)
    # pairs: (single, searched) tied in prediction; (single, dp) and (searched, dp)
    # discordant: tau-b = (0 - 2) / sqrt((2 + 1) * 2)
    assert s["tau"] == pytest.approx(-2 / 6**0.5)


def test_the_pick_is_the_mean_of_the_plans_predicted_fastest_against_the_fastest() -> None:
    s = summary(RESULTS)
    assert s["pick_over_fastest"] == pytest.approx((3.6 + 3.0) / 2 / 2.4)
    assert s["searched_over_fastest"] == pytest.approx(3.0 / 2.4)


def test_without_a_searched_plan_there_is_no_searched_figure() -> None:
    assert summary(RESULTS[::2])["searched_over_fastest"] is None
    assert over_fastest(None) == "-"
    assert over_fastest(1.0) == "fastest"
    assert over_fastest(1.25) == "+25 %"


def test_identical_plans_are_timed_once_whatever_they_predicted(tmp_path) -> None:
    import json

    from benchmarks.fidelity import distinct, same_plans

    def plan(name: str, devices: list[int], predicted: float, search: dict | None) -> tuple:
        doc = {"format": "onnx2soap.plan", "ops": [{"name": "a", "devices": devices}]}
        doc |= {"predicted": {"step_time_s": predicted}, "search": search}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        return name, path

    made = [
        plan("single-device", [0], 1.0, None),
        plan("data-parallel", [0, 1], 0.6, None),
        plan("searched", [0], 0.9, {"method": "mcmc"}),  # the one-device plan, found
    ]
    assert same_plans(made) == {
        "single-device": "single-device",
        "data-parallel": "data-parallel",
        "searched": "single-device",
    }
    assert [label for label, _ in distinct(made, same_plans(made))] == [
        "single-device",
        "data-parallel",
    ]


def test_the_searched_plan_is_also_compared_round_by_round() -> None:
    from dataclasses import replace

    from benchmarks.fidelity import by_round, over_fastest_by_round

    # Round 2 was a slow spell for every plan: the searched plan's rounds (3.0-4.8 ms)
    # overlap the fastest plan's (2.0-4.0 ms), but each round it took 1.2x or 1.5x.
    def ms(*values: float) -> tuple[float, ...]:
        return tuple(v * 1e-3 for v in values)

    results = [
        replace(RESULTS[0], rounds=ms(3.6, 7.0, 3.5)),
        replace(RESULTS[1], rounds=ms(3.0, 4.8, 3.0)),
        replace(RESULTS[2], rounds=ms(2.0, 4.0, 2.5)),  # the fastest: 2.4 ms measured
    ]
    low, median, high = summary(results)["searched_by_round"]
    assert (low, median, high) == pytest.approx((1.2, 1.2, 1.5))
    assert over_fastest_by_round((low, median, high)) == " (rounds +20 %, +20 to +50 %)"
    assert over_fastest_by_round((0.75, 1.04, 1.73)) == " (rounds +4 %, -25 to +73 %)"
    # The fastest plan is not set against itself; without rounds (or of unequal
    # counts) there is nothing to pair.
    assert by_round(results[2], results) is None
    assert summary(RESULTS)["searched_by_round"] is None
    assert by_round(results[1], [results[1], replace(results[2], rounds=ms(2.0))]) is None
    assert over_fastest_by_round(None) == ""


def test_memory_errors_per_rank_and_idle_ranks_apart() -> None:
    # A one-device plan on 3 ranks of a GPU: the idle ranks' pools hold nothing.
    one = Result("single-device", 1e-3, 1e-3, (1e-3, 1e-3), (110, 8, 8), (100, 0, 0), (0,))
    assert memory_errors(one) == ["+10%", "idle", "idle"]
    spread = Result("data-parallel", 1e-3, 1e-3, (1e-3, 1e-3), (95, 50), (100, 0), (0, 1))
    assert memory_errors(spread) == ["-5%", "none measured"]
