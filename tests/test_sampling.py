"""tests/sampling.py: the seeded samples of the heavy parametrizations are reproducible,
keep what they promise (every group, every covered value) and run whole under ``all``."""

from __future__ import annotations

import pytest

from tests.sampling import SAMPLE_ENV, SKIP_REASON, seeded_sample

CASES = [(model, exporter) for model in "abcdefg" for exporter in ("legacy", "dynamo")]


def _kept(params: list) -> list[tuple]:
    return [p.values for p in params if not p.marks]


def _skipped(params: list) -> list[tuple]:
    for p in params:
        if p.marks:
            (mark,) = p.marks
            assert mark.name == "skip" and mark.kwargs["reason"] == SKIP_REASON
    return [p.values for p in params if p.marks]


def test_every_case_stays_a_param_in_its_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SAMPLE_ENV, raising=False)
    params = seeded_sample(CASES, "salt", 3)
    assert [p.values for p in params] == CASES
    assert len(_kept(params)) == 3 and len(_skipped(params)) == len(CASES) - 3
    assert [p.values for p in seeded_sample(["x", "y"], "salt")] == [("x",), ("y",)]


def test_unset_is_seed_0_and_reproducible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SAMPLE_ENV, raising=False)
    unset = _kept(seeded_sample(CASES, "salt", 4))
    assert unset == _kept(seeded_sample(CASES, "salt", 4))
    monkeypatch.setenv(SAMPLE_ENV, "0")
    assert _kept(seeded_sample(CASES, "salt", 4)) == unset


def test_seeds_and_salts_draw_other_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    samples = set()
    for seed in ("0", "1", "2", "3"):
        monkeypatch.setenv(SAMPLE_ENV, seed)
        samples.add(tuple(_kept(seeded_sample(CASES, "salt", 4))))
        samples.add(tuple(_kept(seeded_sample(CASES, "other", 4))))
    assert len(samples) > 1


def test_all_runs_every_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SAMPLE_ENV, "all")
    assert _kept(seeded_sample(CASES, "salt", 1, per=lambda c: c[0])) == CASES


@pytest.mark.parametrize("seed", ["0", "1", "17", "ci"])
def test_per_group_and_cover(monkeypatch: pytest.MonkeyPatch, seed: str) -> None:
    monkeypatch.setenv(SAMPLE_ENV, seed)
    kept = _kept(seeded_sample(CASES, "salt", per=lambda c: c[0], cover=(lambda c: c[1],)))
    assert sorted(model for model, _ in kept) == list("abcdefg")  # one a model
    assert {exporter for _, exporter in kept} == {"legacy", "dynamo"}


def test_a_fraction_is_rounded_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SAMPLE_ENV, raising=False)
    assert len(_kept(seeded_sample(CASES, "salt", 0.2))) == 3  # 2.8 of 14
    with pytest.raises(ValueError):
        seeded_sample(CASES, "salt", 0.0)


def test_a_cover_no_sample_meets_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SAMPLE_ENV, raising=False)
    with pytest.raises(ValueError, match="covers"):
        seeded_sample(CASES, "salt", 1, cover=(lambda c: c[1],))  # one case, two exporters
