"""ONNX's own node test cases, generated in memory from the installed onnx package, run
through ``executor.backend`` (onnx no longer ships their data files).

``node_cases()`` keeps the single-node cases whose op type has an onnx2soap definition
(so a newly defined op is picked up without touching this file), and the function-expanded
variants (``*_expanded``: an op's function body, several nodes) whose every node is an op
onnx2soap defines or folds, counted together as ``EXPANDED``. ``run_case``
runs one case and says whether it passed, failed (with the mismatch) or is outside what
onnx2soap supports (skipped, with the importer's reason). A case with several outputs is
checked on the outputs onnx2soap computes (LayerNormalization's Y without its Mean and
InvStdDev): it passes if they all match, and says which it left unchecked and why; it
is skipped only if every output is refused.
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from dataclasses import dataclass
from enum import Enum
from functools import cache

import numpy as np
import onnx
from onnx import numpy_helper

from executor import backend
from onnx2soap.errors import UserError
from onnx2soap.ops import registry

# Multi-node cases (ONNX function bodies expanded into ops onnx2soap defines) count as
# this "op"; nodes of these types are folded away by the importer.
EXPANDED = "(function expansions)"
FOLDED = {"Constant", "Shape"}

# What the float outputs must match to (onnx's runner uses rtol 1e-3, atol 1e-7).
TOLERANCE = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-7}


class Status(Enum):
    PASSED = "passed"
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclass(frozen=True)
class ConformanceCase:
    name: str
    op_type: str
    model: onnx.ModelProto
    data_sets: tuple[tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]], ...]


@dataclass(frozen=True)
class Outcome:
    status: Status
    reason: str = ""  # skip: the importer's refusal; fail: the mismatch
    # A pass on some outputs only: the refusal of each output left unchecked, by name.
    unchecked: tuple[tuple[str, str], ...] = ()


@cache
def node_cases() -> tuple[ConformanceCase, ...]:
    """Every ONNX node test case of an op onnx2soap defines (and every expanded function
    made of such ops), sorted by name."""
    from onnx.backend.test.case.node import collect_testcases

    ops = {d.name for d in registry().onnx_ops()}
    # The case generators print nothing useful but warn about deliberate overflows.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        found = collect_testcases()
    cases = []
    for tc in found:
        nodes = tc.model.graph.node
        if any(n.domain not in ("", "ai.onnx") for n in nodes):
            continue
        if len(nodes) == 1 and nodes[0].op_type in ops:
            op_type = nodes[0].op_type
        elif len(nodes) > 1 and all(n.op_type in ops | FOLDED for n in nodes):
            op_type = EXPANDED
        else:
            continue
        data = tuple(
            (tuple(_array(v) for v in ins), tuple(_array(v) for v in outs))
            for ins, outs in tc.data_sets
        )
        cases.append(ConformanceCase(tc.name, op_type, tc.model, data))
    return tuple(sorted(cases, key=lambda c: c.name))


def _array(value):
    """A tensor as a numpy array (numpy scalars too); sequences and optionals as given."""
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return np.asarray(value) if isinstance(value, np.generic) else value


def run_case(case: ConformanceCase) -> Outcome:
    """Run every data set of ``case`` on the outputs onnx2soap computes; the first
    refusal of every output, or the first mismatch, decides."""
    if not case.data_sets:
        return Outcome(Status.FAILED, "the case has no data to compare")
    unchecked: dict[str, str] = {}
    for inputs, expected in case.data_sets:
        if any(not isinstance(v, np.ndarray) for v in (*inputs, *expected)):
            return Outcome(Status.SKIPPED, "sequence or optional values (tensors only)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                results = backend.prepare(case.model, "CPU").run_each(list(inputs))
        except UserError as e:
            return Outcome(Status.SKIPPED, str(e))
        if len(results) != len(expected):
            return Outcome(Status.FAILED, f"{len(results)} outputs, expected {len(expected)}")
        computed = [k for k, v in enumerate(results.values()) if not isinstance(v, UserError)]
        refused = {n: str(v) for n, v in results.items() if isinstance(v, UserError)}
        if not computed:
            return Outcome(Status.SKIPPED, next(iter(refused.values())))
        unchecked.update(refused)
        got = [list(results.values())[k] for k in computed]
        want = [expected[k] for k in computed]
        ratio = _random_dropout_ratio(case, inputs)
        if ratio is not None:
            mismatch = compare_dropout(got, want, inputs[0], ratio)
        elif any(n.op_type == "RandomUniformLike" for n in case.model.graph.node):
            mismatch = compare_bernoulli(got, want, inputs[0])
        else:
            mismatch = compare(got, want)
        if mismatch:
            names = [list(results)[k] for k in computed]
            return Outcome(Status.FAILED, f"{mismatch} (outputs compared: {names})")
    return Outcome(Status.PASSED, unchecked=tuple(unchecked.items()))


def _random_dropout_ratio(case: ConformanceCase, inputs: tuple[np.ndarray, ...]) -> float | None:
    """The ratio of a Dropout in training mode with a ratio above 0, None otherwise: its
    mask is random (onnx's expected output comes from numpy's generator, onnx2soap's from
    a counter-based hash), so only what any mask gives can be compared."""
    node = case.model.graph.node[0]
    if node.op_type != "Dropout" or len(node.input) < 3 or not node.input[2]:
        return None
    values = dict(zip([n for n in node.input if n], inputs, strict=True))
    ratio = float(values[node.input[1]]) if node.input[1] else 0.5
    return ratio if bool(values[node.input[2]]) and ratio > 0 else None


def compare_dropout(
    got: list[np.ndarray], expected: list[np.ndarray], x: np.ndarray, ratio: float
) -> str:
    """'' when ``got`` is a dropout of ``x``: the expected dtype and shape, every element
    dropped (0) or kept and scaled by 1 / (1 - ratio), and the dropped fraction within 5
    standard deviations of the ratio."""
    if len(got) != 1 or len(expected) != 1:
        return f"{len(got)} outputs, expected {len(expected)} (the output only)"
    y, want = np.asarray(got[0]), expected[0]
    if y.dtype != want.dtype or y.shape != want.shape:
        return f"output: {y.dtype}{list(y.shape)}, expected {want.dtype}{list(want.shape)}"
    kept = y != 0
    tol = TOLERANCE[np.dtype(want.dtype)]
    if not np.allclose(y[kept], (x / (1 - ratio))[kept], rtol=tol, atol=tol):
        return "kept elements are not the input scaled by 1 / (1 - ratio)"
    dropped, sigma = 1 - kept.mean(), np.sqrt(ratio * (1 - ratio) / x.size)
    if abs(dropped - ratio) > 5 * sigma:
        return f"dropped {dropped:.3f} of the elements, expected about {ratio}"
    return ""


def compare_bernoulli(got: list[np.ndarray], expected: list[np.ndarray], p: np.ndarray) -> str:
    """'' when ``got`` is a Bernoulli draw with probabilities ``p`` (the function body of
    Bernoulli: RandomUniformLike, Less, Cast): onnx's expected values come from numpy's
    generator, so compare the law: 0s and 1s, and as many 1s as ``p`` says, within 5
    standard deviations."""
    if len(got) != 1 or len(expected) != 1:
        return f"{len(got)} outputs, expected {len(expected)}"
    y, want = np.asarray(got[0]), expected[0]
    if y.dtype != want.dtype or y.shape != want.shape:
        return f"output: {y.dtype}{list(y.shape)}, expected {want.dtype}{list(want.shape)}"
    if not np.isin(y, (0, 1)).all():
        return "a Bernoulli draw holds values other than 0 and 1"
    sigma = np.sqrt((p * (1 - p)).sum())
    if abs(y.sum() - p.sum()) > 5 * max(sigma, 1e-12):
        return f"{y.sum()} ones, expected about {p.sum():.1f}"
    return ""


def compare(got: list[np.ndarray], expected: list[np.ndarray]) -> str:
    """'' when every output matches, else what differs."""
    if len(got) != len(expected):
        return f"{len(got)} outputs, expected {len(expected)}"
    for k, (g, e) in enumerate(zip(got, expected, strict=True)):
        g = np.asarray(g)
        if g.dtype != e.dtype or g.shape != e.shape:
            return f"output {k}: {g.dtype}{list(g.shape)}, expected {e.dtype}{list(e.shape)}"
        tol = TOLERANCE.get(e.dtype)
        if tol is None:
            ok = np.array_equal(g, e)
        else:
            ok = np.allclose(g, e, rtol=tol, atol=tol, equal_nan=True)
        if not ok:
            worst = float(np.nanmax(np.abs(g.astype(np.float64) - e.astype(np.float64))))
            return f"output {k}: max |difference| {worst:.3g} (tolerance {tol})"
    return ""


def short_reason(reason: str) -> str:
    """The gist of a skip reason, so that the reasons of different cases count together:
    its first clause, without the node, tensor names, shapes and remarks in parentheses."""
    text = re.sub(r"node '[^']*' \(\w+\): ", "", reason)
    text = re.sub(r" ?\((?!axis \d+\))[^()]*\)", "", text)  # keeps "(axis 0)"
    text = re.split(r"; |: |, but ", text)[0]
    text = re.sub(r"\b(output|input) '[^']*'", r"\1", text)
    text = re.sub(r" ?\[[^\]]*\]", "", text)
    return text.strip()
