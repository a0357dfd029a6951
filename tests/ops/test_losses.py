"""Loss kernels: the partial losses of tasks split along the batch sum to the loss of the
whole batch (against onnxruntime for cross-entropy), and gradients match finite
differences with ignored rows getting none."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

from onnx2soap.importer import ImportedModel, load_model
from onnx2soap.ir import LossKind, Op
from onnx2soap.ops import definition
from onnx2soap.ops.base import TaskArgs
from onnx2soap.ops.defs.losses import LossAttrs, LossReduction
from onnx2soap.soap import analyze
from tests.ops.harness import (
    buffers,
    central_difference,
    config_of,
    one_task,
    ort_run,
    task_args,
    tasks_of,
    traced_peak,
)
from tests.optional import require

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class CrossEntropy:
    n: int
    classes: int
    reduction: str
    ignore_index: int | None

    @property
    def id(self) -> str:
        return f"ce_{self.n}_{self.classes}_{self.reduction}_{self.ignore_index}"


def _save_cross_entropy(ce: CrossEntropy, path: Path) -> None:
    attrs: dict[str, object] = {"reduction": ce.reduction}
    if ce.ignore_index is not None:
        attrs["ignore_index"] = ce.ignore_index
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"], **attrs)
    graph = helper.make_graph(
        [node],
        ce.id,
        [
            helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, (ce.n, ce.classes)),
            helper.make_tensor_value_info("labels", onnx.TensorProto.INT64, (ce.n,)),
        ],
        [helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, ())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))


@pytest.fixture(scope="module")
def cross_entropy(tmp_path_factory: pytest.TempPathFactory):
    """``cross_entropy(ce) -> (path, model)``, saved and imported once per shape."""
    directory = tmp_path_factory.mktemp("loss")
    cache: dict[CrossEntropy, tuple[Path, ImportedModel]] = {}

    def get(ce: CrossEntropy) -> tuple[Path, ImportedModel]:
        if ce not in cache:
            path = directory / f"{ce.id}.onnx"
            _save_cross_entropy(ce, path)
            cache[ce] = (path, load_model(path))
        return cache[ce]

    return get


@pytest.fixture(scope="module")
def mse(tmp_path_factory: pytest.TempPathFactory) -> ImportedModel:
    """Identity [4, 3, 2] with the MSE loss attached by the importer."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, (4, 3, 2))
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, (4, 3, 2))
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "mse", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path = tmp_path_factory.mktemp("mse") / "mse.onnx"
    onnx.save(model, str(path))
    return load_model(path, loss=LossKind.MSE)


def _labels(draw, ce: CrossEntropy) -> np.ndarray:
    choices = list(range(ce.classes))
    if ce.ignore_index is not None and ce.ignore_index not in choices:
        choices.append(ce.ignore_index)
    labels = draw(st.lists(st.sampled_from(choices), min_size=ce.n, max_size=ce.n))
    return np.array(labels, dtype=np.int64)


def _partial_sum(graph, op: Op, degree: int, arrays, loss_scale: float) -> float:
    degrees = [degree if d.name == "n" else 1 for d in analyze(graph)[op.name]]
    kernel = definition(op.type)
    total = 0.0
    for task in tasks_of(graph, op, config_of(degrees)):
        partial = kernel.forward(np, op.attrs, buffers(task, arrays), task_args(task, loss_scale))
        assert partial.shape == () and partial.dtype == arrays[0].dtype
        total += float(partial)
    return total


@st.composite
def cross_entropies(draw) -> CrossEntropy:
    return CrossEntropy(
        n=draw(st.integers(1, 7)),
        classes=draw(st.integers(2, 5)),
        reduction=draw(st.sampled_from(["mean", "sum"])),
        ignore_index=draw(st.sampled_from([None, -100, 1])),
    )


@SETTINGS
@given(ce=cross_entropies(), data=st.data())
def test_cross_entropy_partial_losses_sum_to_onnxruntime(cross_entropy, ce, data) -> None:
    path, model = cross_entropy(ce)
    op = model.graph.loss_op
    assert op is not None and op.type == "SoftmaxCrossEntropyLoss"
    assert op.attrs.reduction is LossReduction(ce.reduction)
    labels = _labels(data.draw, ce)
    kept = int((labels != ce.ignore_index).sum()) if ce.ignore_index is not None else ce.n
    if ce.reduction == "mean" and kept == 0:
        return  # 0/0: not a loss anyone trains on
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    scores = (rng.standard_normal((ce.n, ce.classes)) * 4).astype(np.float32)
    (want,) = ort_run(path, {"scores": scores, "labels": labels})
    scale = float(kept) if ce.reduction == "mean" else 1.0
    degree = data.draw(st.integers(1, ce.n), label="degree")
    got = _partial_sum(model.graph, op, degree, [scores, labels], scale)
    assert got == pytest.approx(float(want), rel=1e-5, abs=1e-5)


def test_cross_entropy_is_stable_for_huge_scores(cross_entropy) -> None:
    ce = CrossEntropy(n=2, classes=3, reduction="sum", ignore_index=None)
    _, model = cross_entropy(ce)
    op = model.graph.loss_op
    scores = np.array([[1000.0, -1000.0, 0.0], [-3e4, -3e4 + 2.0, -3e4]], dtype=np.float32)
    labels = np.array([1, 1], dtype=np.int64)
    got = _partial_sum(model.graph, op, 1, [scores, labels], 1.0)
    # -log_softmax: row 0 picks -1000 (2000 below the max), row 1 picks the max
    want = 2000.0 + np.log1p(2 * np.exp(-2.0))
    assert got == pytest.approx(want, rel=1e-6)


@SETTINGS
@given(ce=cross_entropies(), data=st.data())
def test_cross_entropy_backward_matches_finite_differences(cross_entropy, ce, data) -> None:
    op = cross_entropy(ce)[1].graph.loss_op
    graph = cross_entropy(ce)[1].graph
    labels = _labels(data.draw, ce)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    scores = rng.standard_normal((ce.n, ce.classes)) * 3
    degrees = [
        data.draw(st.integers(1, ce.n)) if d.name == "n" else 1 for d in analyze(graph)[op.name]
    ]
    tasks = tasks_of(graph, op, config_of(degrees))
    task = tasks[data.draw(st.integers(0, len(tasks) - 1), label="task")]
    bufs = buffers(task, [scores, labels])
    args = task_args(task, loss_scale=data.draw(st.sampled_from([1.0, 3.0])))
    kernel = definition(op.type)
    out = kernel.forward(np, op.attrs, bufs, args)
    grad_output = np.array(0.7)
    grad_scores, grad_labels = kernel.backward(np, op.attrs, bufs, out, grad_output, args)
    assert grad_labels is None
    assert grad_scores.shape == bufs[0].shape and grad_scores.dtype == np.float64

    def scalar() -> float:
        return 0.7 * float(kernel.forward(np, op.attrs, bufs, args))

    for index in np.ndindex(bufs[0].shape):
        numeric = central_difference(scalar, bufs[0], index, 1e-6)
        assert grad_scores[index] == pytest.approx(numeric, rel=1e-6, abs=1e-8), index
    if ce.ignore_index is not None:
        ignored = bufs[1] == ce.ignore_index
        assert (grad_scores[ignored] == 0).all()


@SETTINGS
@given(data=st.data())
def test_mse_partial_losses_sum_to_the_batch_loss(mse: ImportedModel, data) -> None:
    graph, op = mse.graph, mse.graph.loss_op
    assert op is not None and op.type == "MeanSquaredError"
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    pred, target = (rng.standard_normal(graph.tensors[t].shape) for t in op.inputs)
    degree = data.draw(st.integers(1, 4), label="degree")
    mean = _partial_sum(graph, op, degree, [pred, target], float(pred.size))
    assert mean == pytest.approx(float(((pred - target) ** 2).mean()), rel=1e-12)
    total = _partial_sum(graph, op, degree, [pred, target], 1.0)
    assert total == pytest.approx(float(((pred - target) ** 2).sum()), rel=1e-12)


def test_mse_backward_matches_finite_differences(mse: ImportedModel) -> None:
    graph, op = mse.graph, mse.graph.loss_op
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(graph.tensors[t].shape) for t in op.inputs]
    (task,) = tasks_of(graph, op, one_task(op))
    bufs = buffers(task, arrays)
    args = task_args(task, loss_scale=24.0)
    kernel = definition(op.type)
    out = kernel.forward(np, op.attrs, bufs, args)
    grad_pred, grad_target = kernel.backward(np, op.attrs, bufs, out, np.array(1.5), args)
    assert grad_target is None

    def scalar() -> float:
        return 1.5 * float(kernel.forward(np, op.attrs, bufs, args))

    for index in np.ndindex(bufs[0].shape):
        numeric = central_difference(scalar, bufs[0], index, 1e-6)
        assert grad_pred[index] == pytest.approx(numeric, rel=1e-6, abs=1e-9)


def test_loss_gradient_keeps_float32(cross_entropy) -> None:
    """A float64 0-d grad_output must not promote float32 score gradients."""
    ce = CrossEntropy(n=3, classes=4, reduction="mean", ignore_index=None)
    op = cross_entropy(ce)[1].graph.loss_op
    (task,) = tasks_of(cross_entropy(ce)[1].graph, op, one_task(op))
    scores = np.ones((3, 4), dtype=np.float32)
    bufs = buffers(task, [scores, np.array([0, 1, 2])])
    args = task_args(task, loss_scale=3.0)
    kernel = definition(op.type)
    out = kernel.forward(np, op.attrs, bufs, args)
    (grad, _) = kernel.backward(np, op.attrs, bufs, out, np.array(1.0), args)
    assert grad.dtype == np.float32


# --- what the executor gives the kernels: the stash, and the scores' own copy -----------


def _kernel_args(shape: tuple[int, ...], loss_scale: float, owned: bool) -> TaskArgs:
    """A training step's arguments: a stash kept from the forward to the backward and,
    under mixed precision, the scores as the step's own float32 copy."""
    return TaskArgs(out_shape=(), valid=(), loss_scale=loss_scale, stash={}, owned=(owned, False))


@pytest.mark.parametrize("owned", [False, True], ids=["stored", "owned"])
@pytest.mark.parametrize(
    ("axis", "shape"), [(-1, (3, 5, 7)), (1, (3, 7, 5))], ids=["classes-last", "onnx-axis-1"]
)
def test_the_stash_and_the_owned_copy_give_torchs_loss_and_gradient(owned, axis, shape) -> None:
    torch = require("torch")
    rng = np.random.default_rng(4)
    scores = (rng.standard_normal(shape) * 4).astype(np.float32)
    labels = rng.integers(0, 7, (shape[0], 5))
    labels[0, 1] = -100  # ignored
    attrs = LossAttrs(LossReduction.MEAN, -100, class_axis=len(shape) - 1 if axis < 0 else axis)
    kernel = definition("SoftmaxCrossEntropyLoss")
    args = _kernel_args(shape, float((labels != -100).sum()), owned)
    loss = kernel.forward(np, attrs, [scores.copy(), labels], args)
    assert args.stash["lse"].shape[-1] == 1  # one number a row, kept for the backward
    mine = scores.copy()  # the backward's own copy, as the step widens it again
    grad, _ = kernel.backward(np, attrs, [mine, labels], loss, np.float32(1.0), args)
    theirs = torch.tensor(scores, requires_grad=True)
    logits = theirs if axis == 1 else theirs.movedim(-1, 1)
    want = torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels), ignore_index=-100)
    want.backward()
    assert float(loss) == pytest.approx(want.item(), rel=1e-6)
    np.testing.assert_allclose(grad, theirs.grad.numpy(), rtol=1e-5, atol=1e-7)
    # the gradient is made in the owned copy where its classes are rows, nowhere else
    assert np.shares_memory(grad, mine) == (owned and axis < 0)


@pytest.mark.parametrize("owned", [False, True], ids=["stored", "owned"])
def test_the_kernels_peaks_are_their_workspace_less_what_they_overwrite(owned) -> None:
    """tracemalloc's peaks (the executor's ``--trace`` measure) against
    ``cross_entropy_workspace``, less the scratch the forward keeps in an owned copy
    (``OpDef.overwrites``), and the gradient the backward returns, unless it is made in
    the owned copy: as the memory model prices them (``sim/memory.py``)."""
    shape = (8, 128, 512)
    kernel = definition("SoftmaxCrossEntropyLoss")
    attrs = LossAttrs(LossReduction.MEAN, None, class_axis=2)
    rng = np.random.default_rng(5)
    scores = rng.standard_normal(shape).astype(np.float32)
    labels = rng.integers(0, shape[-1], shape[:2])
    args = _kernel_args(shape, float(labels.size), owned)
    kernel.backward(np, attrs, [scores.copy(), labels], None, np.float32(1.0), args)  # warm
    copy = scores.copy()
    forward, loss = traced_peak(lambda: kernel.forward(np, attrs, [copy, labels], args))
    copy = scores.copy()
    backward, (grad, _) = traced_peak(
        lambda: kernel.backward(np, attrs, [copy, labels], loss, np.float32(1.0), args)
    )
    want_forward, want_backward = kernel.workspace(attrs, [shape, shape[:2]], (), 4)
    assert kernel.overwrites == frozenset({0})
    if owned:  # less the scratch kept in the copy, down to nothing (as sim/memory.py)
        want_forward = max(want_forward - scores.nbytes, 0)
    want_backward += 0 if owned else grad.nbytes
    # besides: each row's max, logsumexp, label, pick and mask, some 50 bytes, against
    # a row of scores' 2 KiB (not priced)
    rows = 64 * labels.size
    assert want_forward <= forward <= want_forward + rows
    assert want_backward <= backward <= want_backward + rows
