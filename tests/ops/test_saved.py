"""``OpDef.saves``: what each op's backward reads of its forward (``Saved``).

The executor frees every tile an op does not save after its last forward reader and
hands the backward a ``Released`` in its place (shape and dtype, no values). For every
case of every op definition: the backward run with the buffers its op does not save
released (weights and constants too: the declaration must be truthful even where the
rank keeps them anyway) gives exactly the gradients of the backward run with everything.
A declaration that says too little fails here, with the ``TypeError`` (or
``AttributeError``) of the read it does not allow."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest

from onnx2soap.ops import definition, registry
from onnx2soap.ops.base import (
    SAVES_ALL,
    SAVES_INPUTS,
    SAVES_NOTHING,
    SAVES_OUTPUT,
    OpDef,
    Released,
    Saved,
    released,
)
from onnx2soap.soap.partition import rect_shape
from onnx2soap.soap.saved import wanted_gradients
from tests.ops.harness import (
    CaseLoader,
    all_task_args,
    buffers,
    one_task,
    op_of,
    operand_arrays,
    tasks_of,
)

DEFINITIONS = tuple(registry().by_name.values())
CASES = tuple(c for d in DEFINITIONS for c in d.cases)


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> CaseLoader:
    return CaseLoader(tmp_path_factory.mktemp("saved"))


def _assert_same(got, want, what: str) -> None:
    assert len(got) == len(want), what
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (w is None), f"{what} {k}"
        if w is not None:
            assert g.dtype == w.dtype and g.shape == w.shape, f"{what} {k}"
            assert np.array_equal(g, w, equal_nan=True), f"{what} {k}"


@pytest.mark.parametrize("as_graph", [False, True], ids=["every-gradient", "graphs-gradients"])
@pytest.mark.parametrize("c", CASES, ids=str)
def test_backward_reads_only_what_its_op_saves(load: CaseLoader, c, as_graph: bool) -> None:
    """Every gradient wanted (a kernel called alone), and only those the case's graph
    takes (its weights' and float activations', not data's or constants':
    ``Saved.only_for`` may then release more): the wanted ones are exactly those of the
    backward run with everything, the others not made."""
    model = load(c)[1]
    graph, op = model.graph, op_of(model)
    d = definition(op.type)
    saves = d.saves
    config = one_task(op)
    (task,) = tasks_of(graph, op, config)
    rng = np.random.default_rng(0)
    arrays = operand_arrays(c, model, rng)
    grad_output = np.asarray(rng.standard_normal(rect_shape(task.output)))
    # one task's args; an op with statistics gets its forward and backward sums
    args = all_task_args(graph, op, config, arrays, None if op.is_loss else grad_output)[0]
    mask = wanted_gradients(graph, op) if as_graph else ()
    wanted = frozenset(k for k, w in enumerate(mask) if w) if as_graph else None
    bufs = buffers(task, arrays)
    out = d.forward(np, op.attrs, bufs, args)

    def kept() -> tuple[list, object]:
        held = [
            copy.deepcopy(b) if saves.keeps_input(k, wanted) else released(b)
            for k, b in enumerate(bufs)
        ]
        return held, copy.deepcopy(out) if saves.output else released(out)

    def everything() -> tuple[list, object]:
        return copy.deepcopy(bufs), copy.deepcopy(out)

    want = d.backward(np, op.attrs, *everything(), grad_output.copy(), args)
    got = d.backward(np, op.attrs, *kept(), grad_output.copy(), replace(args, wanted=mask))
    if as_graph:  # an unwanted gradient may be made or not; it is never used
        want = tuple(w if mask[k] else None for k, w in enumerate(want))
        got = tuple(g if mask[k] else None for k, g in enumerate(got))
    _assert_same(got, want, f"{op.type} gradient")
    if d.statistics is not None and op.nest.sync_dims:  # the backward's partial sums too
        partial = d.statistics.backward
        want = partial(np, op.attrs, *everything(), grad_output.copy(), args)
        got = partial(np, op.attrs, *kept(), grad_output.copy(), replace(args, wanted=mask))
        _assert_same([got], [want], f"{op.type} backward statistics")


def test_a_constant_factor_is_not_kept_for_the_other_operands_gradient() -> None:
    """x * c keeps c (x's gradient reads it), not x (c takes no gradient); x * w keeps
    both; a linear's data input is kept for its weight's gradient, the weight for no
    gradient of data (held by the rank anyway)."""
    mul, div, matmul = (definition(n).saves for n in ("Mul", "Div", "MatMul"))
    assert [mul.keeps_input(k, frozenset({0})) for k in (0, 1)] == [False, True]
    assert [mul.keeps_input(k, frozenset({0, 1})) for k in (0, 1)] == [True, True]
    assert [div.keeps_input(k, frozenset({0})) for k in (0, 1)] == [False, True]
    assert [div.keeps_input(k, frozenset({1})) for k in (0, 1)] == [True, True]
    assert [matmul.keeps_input(k, frozenset({1})) for k in (0, 1)] == [True, False]
    assert [matmul.keeps_input(k) for k in (0, 1)] == [True, True]  # None: every one


@pytest.mark.parametrize("d", DEFINITIONS, ids=lambda d: d.name)
def test_declarations_are_saved(d: OpDef) -> None:
    assert isinstance(d.saves, Saved)
    inputs = d.saves.inputs
    assert inputs is None or all(isinstance(k, int) and k >= 0 for k in inputs)


def test_released_refuses_value_reads() -> None:
    x = np.arange(6.0).reshape(2, 3)
    r = released(x)
    assert isinstance(r, Released)
    assert (r.shape, r.dtype, r.ndim, r.size) == ((2, 3), x.dtype, 2, 6)
    assert released(r) is r
    with pytest.raises(TypeError):
        np.asarray(r)
    with pytest.raises(TypeError):
        np.add(r, 1.0)
    with pytest.raises(TypeError):
        np.exp(r)
    with pytest.raises(TypeError):
        r * 2.0
    with pytest.raises(TypeError):
        x + r
    with pytest.raises(TypeError):
        r[0]
    with pytest.raises(TypeError):
        r[:, 1:]


def test_default_saves_everything() -> None:
    def kernel(*_):
        raise AssertionError("not run")

    d = OpDef(name="Made", convert=kernel, forward=kernel, backward=kernel, cases=())
    assert d.saves == SAVES_ALL == Saved()
    assert d.saves.output and d.saves.inputs is None
    assert all(d.saves.keeps_input(k) for k in range(8))


def test_constants() -> None:
    assert not SAVES_NOTHING.output and not SAVES_NOTHING.keeps_input(0)
    assert not SAVES_INPUTS.output and SAVES_INPUTS.keeps_input(3)
    assert SAVES_OUTPUT.output and not SAVES_OUTPUT.keeps_input(0)
    assert Saved(inputs=(0, 2)).keeps_input(2) and not Saved(inputs=(0, 2)).keeps_input(1)
