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


# Ops whose node cases have bool or int data, bool outputs, an opset older than 13 or
# outputs onnx2soap does not compute: each must pass at least one case.
TYPED_OR_MULTI_OUTPUT = ("LayerNormalization", "And", "Or", "Xor", "Not", "Equal", "Trilu")


@pytest.mark.parametrize("op", TYPED_OR_MULTI_OUTPUT)
def test_every_op_passes_a_case_of_its_own(op: str) -> None:
    outcomes = (run_case(c) for c in CASES if c.op_type == op)
    assert any(o.status is Status.PASSED for o in outcomes)


def test_a_partial_pass_names_the_outputs_it_left_out() -> None:
    """LayerNormalization's cases declare Mean and InvStdDev, which onnx2soap refuses:
    Y is compared, the other two are listed with the importer's reason."""
    case = next(c for c in CASES if c.name == "test_layer_normalization_2d_axis1")
    outcome = run_case(case)
    assert outcome.status is Status.PASSED
    assert [name for name, _ in outcome.unchecked] == ["Mean", "InvStdDev"]
    assert all("first output" in why for _, why in outcome.unchecked)


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
