"""ONNX's own node test cases, for every op onnx2soap defines, through ``executor.backend``.

The cases are generated in memory from the installed onnx's ``onnx.backend.test.case``
definitions (see ``tests.conformance.cases``), so an op added to the registry is tested
here without editing this file. Each case passes (every output compared, float32 within
1e-4) or is skipped with the importer's reason for refusing it (integer-only data, an op
on the batch axis, an unsupported attribute...). Anything else — a wrong value, a shape
or dtype mismatch, a crash that is not a ``UserError`` — fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conformance.cases import Status, compare, compare_dropout, node_cases, run_case

CASES = node_cases()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_onnx_node_case(case) -> None:
    outcome = run_case(case)
    if outcome.status is Status.SKIPPED:
        pytest.skip(f"{case.op_type}: {outcome.reason}")
    assert outcome.status is Status.PASSED, outcome.reason


def test_cases_are_found_for_the_core_ops() -> None:
    ops = {c.op_type for c in CASES}
    assert {"Conv", "Relu", "Gemm", "MaxPool", "Add"} <= ops


def test_a_case_never_passes_without_comparing() -> None:
    """``compare`` refuses missing outputs, other shapes or dtypes and values off by more
    than the tolerance; equal outputs (NaN where expected) pass."""
    y = np.array([[1.0, np.nan]], dtype=np.float32)
    assert compare([y.copy()], [y]) == ""
    assert compare([], [y])
    assert compare([y[0]], [y])
    assert compare([y.astype(np.float64)], [y])
    assert compare([y + 1e-3], [y])
    assert compare([np.array([1, 2])], [np.array([1, 3])])


def test_a_random_dropout_is_checked_for_what_any_mask_gives() -> None:
    x = np.random.default_rng(0).standard_normal((40, 50)).astype(np.float32)
    mask = np.random.default_rng(1).random(x.shape) >= 0.25
    dropped = np.where(mask, x / 0.75, 0).astype(np.float32)
    assert compare_dropout([dropped], [dropped], x, 0.25) == ""
    assert compare_dropout([x], [dropped], x, 0.25)  # the identity: nothing dropped
    assert compare_dropout([np.where(mask, x, 0)], [dropped], x, 0.25)  # not rescaled
