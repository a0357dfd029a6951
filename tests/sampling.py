"""Seeded samples of the heaviest parametrizations.

The whole suite must fit CI's 20 minutes, and most of it is spent in a few
parametrizations that repeat one check (a random plan under mpiexec trains like one
device) over cases that add little each: the same model from its other exporter, a family
that shares another's ops. ``seeded_sample`` keeps such a parametrization whole, so that
every case keeps its id and still shows in the report, and marks the cases outside this
run's sample as skipped.

The sample is drawn from ``ONNX2SOAP_TEST_SAMPLE``: unset it is ``0``, so every run (CI's
included) runs the same cases and a failure reproduces; ``all`` runs every case; any other
value draws another sample, so that runs under different values cover the other cases::

    ONNX2SOAP_TEST_SAMPLE=all .venv/bin/python -m pytest tests/families
    ONNX2SOAP_TEST_SAMPLE=7 .venv/bin/python -m pytest tests/families

Each parametrization is drawn with ``random.Random(f"{seed}:{salt}")``: string seeding is
the same in every process, where ``hash()`` of a string changes with PYTHONHASHSEED.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import pytest

SAMPLE_ENV = "ONNX2SOAP_TEST_SAMPLE"
SKIP_REASON = f"outside this run's seeded sample; {SAMPLE_ENV}=all runs every case"
# Draws tried for one that meets ``cover``; a real sample meets it within a few.
_DRAWS = 1000

Key = Callable[[Any], Hashable]


def sample_seed() -> str | None:
    """This run's seed (``0`` when unset), or None when every case runs."""
    seed = os.environ.get(SAMPLE_ENV, "0").strip() or "0"
    return None if seed.lower() == "all" else seed


def _quota(count: float, size: int) -> int:
    """``count`` cases of ``size``: a whole number, or a fraction of them rounded up;
    at least one and at most all."""
    if isinstance(count, float):
        if not 0.0 < count <= 1.0:
            raise ValueError(f"a fraction of the cases must be in (0, 1], got {count}")
        count = math.ceil(count * size)
    if count < 1:
        raise ValueError(f"a sample needs at least one case, got {count}")
    return min(count, size)


def _draw(rng: random.Random, groups: dict[Hashable, list[int]], count: float) -> set[int]:
    kept: set[int] = set()
    for members in groups.values():
        kept.update(rng.sample(members, _quota(count, len(members))))
    return kept


def seeded_sample(
    cases: Sequence[Any],
    salt: str,
    count: float = 1,
    *,
    per: Key | None = None,
    cover: Sequence[Key] = (),
) -> list[Any]:
    """``cases`` as ``pytest.param``s, those outside this run's seeded sample skipped.

    ``count`` cases are kept (an int, or a fraction of the cases rounded up), or ``count``
    of each group of cases with the same ``per(case)``: grouping by model keeps every model
    covered while the other parameters (its exporter) are sampled. Each key of ``cover``
    must take every value among the kept cases that it takes among all of them (both
    exporters, every rank count); draws are repeated until one does. ``salt`` names the
    parametrization, so that two of them draw independently. A tuple case is unpacked
    into the param's values, for ``parametrize`` with several names.
    """
    cases = list(cases)
    seed = sample_seed()
    if seed is None:
        kept = set(range(len(cases)))
    else:
        groups: dict[Hashable, list[int]] = {}
        for i, case in enumerate(cases):
            groups.setdefault(per(case) if per else None, []).append(i)
        rng = random.Random(f"{seed}:{salt}")
        wanted = [{key(c) for c in cases} for key in cover]
        for _ in range(_DRAWS):
            kept = _draw(rng, groups, count)
            if all(
                {key(cases[i]) for i in kept} == w for key, w in zip(cover, wanted, strict=True)
            ):
                break
        else:
            raise ValueError(f"{salt}: no sample of {count} per group covers every value")
    skip = pytest.mark.skip(reason=SKIP_REASON)
    return [
        pytest.param(
            *(case if isinstance(case, tuple) else (case,)), marks=() if i in kept else skip
        )
        for i, case in enumerate(cases)
    ]
