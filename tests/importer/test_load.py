"""Graph structure after import: batch binding, weights, the loss, constant folding.

(Forward semantics on one device are checked by the executor tests.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnx2soap.errors import ModelError
from onnx2soap.importer import load_model
from onnx2soap.ir import DType, LossKind, TensorRole
from onnx2soap.ops.defs.losses import LossReduction
from tests.importer.conftest import BATCH, STATIC_BATCH
from tests.importer.helpers import ops_of, run_cli
from tests.optional import require

EXAMPLE_WEIGHTS = {
    "conv1.weight": (16, 3, 3, 3),
    "conv1.bias": (16,),
    "branch_a.conv.weight": (16, 16, 3, 3),
    "branch_a.conv.bias": (16,),
    "branch_b.conv.weight": (16, 16, 1, 1),
    "branch_b.conv.bias": (16,),
    "fc1.weight": (64, 2048),
    "fc1.bias": (64,),
    "fc2.weight": (10, 64),
    "fc2.bias": (10,),
}


# --- batch ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 5, 32])
def test_batch_rebinds_the_symbolic_batch(example_onnx: Path, batch: int) -> None:
    graph = load_model(example_onnx, batch).graph
    assert graph.batch == batch
    assert graph.tensors[graph.input].shape == (batch, 3, 32, 32)
    for op in graph.ops:
        shape = graph.tensors[op.output].shape
        expected_batch = () if op.is_loss else (batch,)  # the loss is a scalar
        assert shape[:1] == expected_batch, op.name
    assert graph.tensors[graph.labels].shape == (batch,)


def test_missing_batch_with_a_symbolic_batch_names_the_input_and_dim(example_onnx: Path) -> None:
    with pytest.raises(ModelError) as err:
        load_model(example_onnx)
    message = str(err.value)
    assert "'input'" in message and "'batch'" in message and "--batch" in message


def test_missing_batch_through_the_cli(example_onnx: Path) -> None:
    result = run_cli(["inspect", example_onnx])
    assert result.code == 2
    assert len(result.stderr_lines) == 1
    assert "'input'" in result.stderr and "'batch'" in result.stderr


def test_static_batch_is_used_without_batch_and_rebound_with_it(own_loss_onnx: Path) -> None:
    assert load_model(own_loss_onnx).graph.batch == STATIC_BATCH
    graph = load_model(own_loss_onnx, BATCH).graph
    assert graph.batch == BATCH
    assert graph.tensors[graph.input].shape == (BATCH, 8)
    assert graph.tensors[graph.labels].shape == (BATCH,)


@pytest.mark.parametrize("batch", [0, -3])
def test_batch_below_one_is_refused(example_onnx: Path, batch: int) -> None:
    with pytest.raises(ModelError, match="--batch"):
        load_model(example_onnx, batch)


# --- weights ------------------------------------------------------------------------------


def test_weights_are_the_float_initializers_with_their_shapes(example_onnx: Path) -> None:
    model = load_model(example_onnx, BATCH)
    weights = model.graph.weights
    assert {w.name: w.shape for w in weights} == EXAMPLE_WEIGHTS
    assert all(w.role is TensorRole.WEIGHT and w.dtype is DType.FLOAT32 for w in weights)
    stored = {i.name: numpy_helper.to_array(i) for i in onnx.load(example_onnx).graph.initializer}
    assert set(model.weights) == set(EXAMPLE_WEIGHTS)
    for name, value in model.weights.items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, stored[name])


def test_example_weights_match_the_seeded_torch_model(example_onnx: Path) -> None:
    # examples/cnn.onnx must be what `python examples/cnn.py` writes today.
    require("torch")
    from tests.models import build_cnn

    state = {k: v.detach().numpy() for k, v in build_cnn().state_dict().items()}
    weights = load_model(example_onnx, BATCH).weights
    assert set(weights) == set(state)
    for name, value in weights.items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)


def test_example_re_export_is_byte_identical(example_onnx: Path, tmp_path: Path) -> None:
    require("torch")
    from tests.models import example_cnn_module

    path = tmp_path / "cnn.onnx"
    assert example_cnn_module().main(["--output", str(path)]) == 0
    assert path.read_bytes() == example_onnx.read_bytes(), "run `python examples/cnn.py`"


def test_dynamo_weights_are_read_from_the_external_data_file(export_model) -> None:
    from tests.models import build_cnn

    path = export_model("cnn", "dynamo")
    assert path.with_name(path.name + ".data").is_file()
    weights = load_model(path, BATCH).weights
    state = {k: v.detach().numpy() for k, v in build_cnn().state_dict().items()}
    assert set(weights) == set(state)
    for name, value in weights.items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)


def test_integer_constants_are_not_weights(export_model) -> None:
    # The dynamo exporter stores the Reshape's target shape as an int64 initializer.
    path = export_model("cnn", "dynamo")
    ints = [
        i.name
        for i in onnx.load(path, load_external_data=False).graph.initializer
        if i.data_type == onnx.TensorProto.INT64
    ]
    assert ints
    graph = load_model(path, BATCH).graph
    assert not set(ints) & {w.name for w in graph.weights}


# --- loss -------------------------------------------------------------------------------


def test_cross_entropy_is_attached_by_default(example_onnx: Path) -> None:
    graph = load_model(example_onnx, BATCH).graph
    assert graph.loss is LossKind.CROSS_ENTROPY
    loss = graph.ops[-1]
    assert loss is graph.loss_op and loss.type == "SoftmaxCrossEntropyLoss"
    assert loss.inputs == (graph.output, graph.labels) == ("logits", "labels")
    assert loss.attrs.reduction is LossReduction.MEAN
    labels = graph.tensors["labels"]
    assert (labels.shape, labels.dtype, labels.role) == ((BATCH,), DType.INT64, TensorRole.LABELS)
    assert graph.tensors[loss.output].shape == ()
    assert sum(op.is_loss for op in graph.ops) == 1


@pytest.mark.parametrize(
    ("fixture", "output_shape"), [("example_onnx", (BATCH, 10)), ("matmul_onnx", (BATCH, 6, 24))]
)
def test_mse_labels_are_floats_of_the_output_shape(
    request: pytest.FixtureRequest, fixture: str, output_shape: tuple[int, ...]
) -> None:
    graph = load_model(request.getfixturevalue(fixture), BATCH, LossKind.MSE).graph
    assert graph.loss is LossKind.MSE
    loss = graph.ops[-1]
    assert loss.type == "MeanSquaredError" and loss.inputs == (graph.output, graph.labels)
    assert graph.tensors[graph.output].shape == output_shape
    labels = graph.tensors[graph.labels]
    assert (labels.shape, labels.dtype, labels.role) == (
        output_shape,
        DType.FLOAT32,
        TensorRole.LABELS,
    )


def test_loss_none_attaches_nothing(example_onnx: Path) -> None:
    graph = load_model(example_onnx, BATCH, LossKind.NONE).graph
    assert graph.loss is LossKind.NONE
    assert graph.loss_op is None and graph.labels is None
    assert not any(op.is_loss for op in graph.ops)
    assert graph.ops[-1].name == "/fc2/Gemm" and graph.output == "logits"
    assert not [t for t in graph.tensors.values() if t.role is TensorRole.LABELS]


def test_cross_entropy_over_token_logits_takes_the_last_axis(matmul_onnx: Path) -> None:
    """A [N, T, C] output gets torch's CrossEntropyLoss over its last axis: labels [N, T],
    -100 ignored."""
    graph = load_model(matmul_onnx, BATCH).graph
    loss = graph.loss_op
    output = graph.tensors[graph.output].shape
    assert len(output) == 3 and loss.attrs.class_axis == 2
    assert graph.tensors[graph.labels].shape == output[:-1]
    assert loss.attrs.ignore_index == -100


def test_torch_exports_cross_entropy_as_one_loss_node(own_loss_onnx: Path) -> None:
    nodes = onnx.load(own_loss_onnx).graph.node
    assert [n.op_type for n in nodes].count("SoftmaxCrossEntropyLoss") == 1
    assert {i.name for i in onnx.load(own_loss_onnx).graph.input} == {"input", "labels"}


@pytest.mark.parametrize("loss", [None, LossKind.MODEL])
def test_a_model_with_its_own_loss_keeps_it(own_loss_onnx: Path, loss: LossKind | None) -> None:
    graph = load_model(own_loss_onnx, BATCH, loss).graph
    assert graph.loss is LossKind.MODEL
    assert [op.type for op in graph.ops] == ["Gemm", "SoftmaxCrossEntropyLoss"]
    loss_op = graph.loss_op
    assert loss_op is not None and loss_op.name == "/SoftmaxCrossEntropyLoss"
    assert loss_op.attrs.reduction is LossReduction.MEAN
    assert loss_op.attrs.ignore_index == -100  # PyTorch's default, kept from the node
    assert graph.labels == "labels" and graph.output == loss_op.inputs[0]
    labels = graph.tensors["labels"]
    assert (labels.shape, labels.dtype, labels.role) == ((BATCH,), DType.INT64, TensorRole.LABELS)


@pytest.mark.parametrize("loss", [LossKind.MSE, LossKind.CROSS_ENTROPY, LossKind.NONE])
def test_a_model_with_its_own_loss_refuses_another(own_loss_onnx: Path, loss: LossKind) -> None:
    with pytest.raises(ModelError, match="/SoftmaxCrossEntropyLoss"):
        load_model(own_loss_onnx, BATCH, loss)


# --- constant folding and reshapes ---------------------------------------------------------


def test_view_flatten_imports_thanks_to_constant_folding(view_onnx: Path) -> None:
    exported = {n.op_type for n in onnx.load(view_onnx).graph.node}
    assert {"Shape", "Gather", "Unsqueeze", "Concat", "Reshape"} <= exported
    graph = load_model(view_onnx, BATCH).graph
    assert [op.type for op in graph.ops] == [
        "Conv",
        "Relu",
        "Reshape",
        "Gemm",
        "SoftmaxCrossEntropyLoss",
    ]
    (reshape,) = ops_of(graph, "Reshape")
    assert graph.tensors[reshape.output].shape == (BATCH, 4 * 8 * 8)
    assert reshape.inputs == (graph.ops[1].output,)  # the folded shape is no operand


def test_static_batch_reshape_imports_at_its_own_batch(static_view_onnx: Path) -> None:
    graph = load_model(static_view_onnx).graph
    (reshape,) = ops_of(graph, "Reshape")
    assert graph.tensors[reshape.output].shape == (STATIC_BATCH, 256)


def test_reshape_that_fixes_the_batch_says_what_to_do(static_view_onnx: Path) -> None:
    with pytest.raises(ModelError) as err:
        load_model(static_view_onnx, BATCH)
    message = str(err.value)
    assert "'/Reshape'" in message
    assert f"fixes the batch at {STATIC_BATCH}" in message
    assert "dynamic batch" in message and f"--batch {STATIC_BATCH}" in message


def test_reshape_that_fixes_the_batch_through_the_cli(static_view_onnx: Path) -> None:
    result = run_cli(["inspect", static_view_onnx, "--batch", BATCH])
    assert result.code == 2 and result.stdout == ""
    assert len(result.stderr_lines) == 1
    assert "'/Reshape'" in result.stderr and f"--batch {STATIC_BATCH}" in result.stderr
