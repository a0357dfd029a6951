"""SOAP dim kinds of imported ops, from real PyTorch exports (legacy and dynamo) and from
the committed example: FlexFlow's Table 1 recovered from the loop nests.

Sources are named "example" (examples/cnn.onnx), "view" (x.view(x.size(0), -1)) or
"<model>-<exporter>" for a model of tests/models.py; every graph is loaded at batch 8.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnx2soap.errors import ModelError
from onnx2soap.importer import load_model
from onnx2soap.ir import LossKind, TensorRole
from tests.importer.conftest import BATCH
from tests.importer.helpers import axes, dims_by_op, kinds, ops_of, splittable

CONV_SOURCES = ["example", "cnn-legacy", "cnn-dynamo", "spatial-legacy", "spatial-dynamo"]
GEMM_SOURCES = ["example", "mlp-legacy", "mlp-dynamo", "cnn-dynamo"]
MATMUL_SOURCES = ["matmul-legacy", "matmul-dynamo"]
CONCAT_SOURCES = ["example", "cnn-legacy", "cnn-dynamo"]
RESHAPE_SOURCES = ["example", "cnn-dynamo", "spatial-legacy", "view"]
ALL_SOURCES = sorted({*CONV_SOURCES, *GEMM_SOURCES, *CONCAT_SOURCES, *RESHAPE_SOURCES})


@pytest.mark.parametrize("source", CONV_SOURCES)
def test_conv_dims_are_flexflow_table_1(load_graph, source: str) -> None:
    graph = load_graph(source).graph
    convs = ops_of(graph, "Conv")
    assert convs, f"{source} has no Conv"
    space = dims_by_op(graph)
    for op in convs:
        dims = space[op.name]
        assert list(dims) == ["n", "co", "h", "w", "ci", "kh", "kw"], op.name
        assert kinds(dims) == {
            "n": "sample",
            "co": "parameter",
            "h": "attribute",
            "w": "attribute",
            "ci": "reduction",
            "kh": "reduction",
            "kw": "reduction",
        }, op.name
        # A kept dim's axis is the output axis it indexes; reductions index none.
        assert axes(dims) == {
            "n": 0,
            "co": 1,
            "h": 2,
            "w": 3,
            "ci": None,
            "kh": None,
            "kw": None,
        }, op.name
        assert splittable(dims) == {
            "n": True,
            "co": True,
            "h": True,
            "w": True,
            "ci": True,  # the input channels: partial sums (no groups here)
            "kh": False,
            "kw": False,
        }, op.name
        out = graph.tensors[op.output].shape
        weight = graph.tensors[op.inputs[1]].shape
        sizes = {name: d.size for name, d in dims.items()}
        assert sizes == {
            "n": BATCH,
            "co": out[1],
            "h": out[2],
            "w": out[3],
            "ci": weight[1],
            "kh": weight[2],
            "kw": weight[3],
        }, op.name
        assert weight[0] == out[1]


@pytest.mark.parametrize("source", CONV_SOURCES)
def test_pool_dims(load_graph, source: str) -> None:
    graph = load_graph(source).graph
    pools = ops_of(graph, "MaxPool") + ops_of(graph, "AveragePool")
    assert pools, f"{source} has no pooling"
    space = dims_by_op(graph)
    for op in pools:
        dims = space[op.name]
        assert kinds(dims) == {
            "n": "sample",
            "c": "attribute",
            "h": "attribute",
            "w": "attribute",
            "kh": "reduction",
            "kw": "reduction",
        }, op.name
        assert axes(dims) == {"n": 0, "c": 1, "h": 2, "w": 3, "kh": None, "kw": None}
        assert [d.splittable for d in dims.values()][:4] == [True] * 4, op.name


def test_spatial_model_has_the_windowed_ops_it_promises(load_graph) -> None:
    graph = load_graph("spatial-legacy").graph
    convs = ops_of(graph, "Conv")
    assert [c.attrs.strides for c in convs] == [(2, 2), (1, 1), (1, 1)]
    assert [c.attrs.dilations for c in convs] == [(1, 1), (2, 2), (1, 1)]
    (maxpool,) = ops_of(graph, "MaxPool")
    assert maxpool.attrs.ceil_mode
    assert graph.tensors[maxpool.output].shape == (BATCH, 8, 8, 8)  # floor mode: 7x7
    averages = ops_of(graph, "AveragePool")
    assert [a.attrs.count_include_pad for a in averages] == [True, False]
    assert all(a.attrs.pads_begin == (1, 1) for a in averages)


def test_global_average_pool_reduces_the_spatial_dims(load_graph) -> None:
    graph = load_graph("spatial-legacy").graph
    (gap,) = ops_of(graph, "GlobalAveragePool")
    dims = dims_by_op(graph)[gap.name]
    assert kinds(dims) == {"n": "sample", "c": "attribute", "h": "reduction", "w": "reduction"}
    assert axes(dims) == {"n": 0, "c": 1, "h": None, "w": None}
    assert splittable(dims) == {"n": True, "c": True, "h": False, "w": False}


@pytest.mark.parametrize("source", GEMM_SOURCES)
def test_gemm_dims(load_graph, source: str) -> None:
    graph = load_graph(source).graph
    gemms = ops_of(graph, "Gemm")
    assert gemms
    space = dims_by_op(graph)
    for op in gemms:
        dims = space[op.name]
        # Rows are samples, output features index the weight, input features are summed
        # (split, they are partial sums).
        assert kinds(dims) == {"n": "sample", "co": "parameter", "ci": "reduction"}, op.name
        assert axes(dims) == {"n": 0, "co": 1, "ci": None}
        assert splittable(dims) == {"n": True, "co": True, "ci": True}  # ci: partial sums
        assert (dims["n"].size, dims["co"].size) == graph.tensors[op.output].shape
        assert dims["n"].size == BATCH


@pytest.mark.parametrize("source", MATMUL_SOURCES)
def test_matmul_on_a_sequence_keeps_the_sequence_as_attribute(load_graph, source: str) -> None:
    graph = load_graph(source, loss=LossKind.MSE).graph
    (op,) = ops_of(graph, "MatMul")
    dims = dims_by_op(graph)[op.name]
    assert kinds(dims) == {"n": "sample", "m": "attribute", "co": "parameter", "ci": "reduction"}
    assert axes(dims) == {"n": 0, "m": 1, "co": 2, "ci": None}
    assert {n: d.size for n, d in dims.items()} == {"n": BATCH, "m": 6, "co": 24, "ci": 16}
    assert splittable(dims) == {"n": True, "m": True, "co": True, "ci": True}  # partial sums


@pytest.mark.parametrize("source", MATMUL_SOURCES)
def test_bias_add_splits_the_bias_as_a_parameter_dim(load_graph, source: str) -> None:
    # dims.py: a kept dim that indexes an axis of a trainable weight is a parameter dim;
    # splitting the output features of "+ bias" splits the bias.
    graph = load_graph(source, loss=LossKind.MSE).graph
    (op,) = ops_of(graph, "Add")
    dims = dims_by_op(graph)[op.name]
    assert kinds(dims) == {"n": "sample", "c": "attribute", "l": "parameter"}


@pytest.mark.parametrize("source", CONCAT_SOURCES)
def test_concat_dims(load_graph, source: str) -> None:
    graph = load_graph(source).graph
    (op,) = ops_of(graph, "Concat")
    assert op.attrs.axis == 1
    dims = dims_by_op(graph)[op.name]
    assert kinds(dims) == {"n": "sample", "c": "attribute", "h": "attribute", "w": "attribute"}
    assert axes(dims) == {"n": 0, "c": 1, "h": 2, "w": 3}
    assert all(splittable(dims).values())


@pytest.mark.parametrize("source", ALL_SOURCES)
def test_relu_dims_are_sample_then_attributes(load_graph, source: str) -> None:
    graph = load_graph(source).graph
    relus = ops_of(graph, "Relu")
    assert relus
    space = dims_by_op(graph)
    for op in relus:
        dims = list(space[op.name].values())
        assert [d.kind.value for d in dims] == ["sample"] + ["attribute"] * (len(dims) - 1)
        assert [d.axis for d in dims] == list(range(len(dims)))
        assert all(d.splittable for d in dims)


def test_add_of_two_activations_is_sample_then_attribute(residual_onnx) -> None:
    graph = load_model(residual_onnx, BATCH).graph
    (op,) = ops_of(graph, "Add")
    assert all(graph.tensors[t].role is TensorRole.ACTIVATION for t in op.inputs)
    dims = dims_by_op(graph)[op.name]
    assert kinds(dims) == {"n": "sample", "f": "attribute"}
    assert splittable(dims) == {"n": True, "f": True}


@pytest.mark.parametrize("source", RESHAPE_SOURCES)
def test_flatten_and_reshape_keep_samples_and_split_the_merged_dim_by_channels(
    load_graph, source: str
) -> None:
    graph = load_graph(source).graph
    layout = ops_of(graph, "Flatten") + ops_of(graph, "Reshape")
    assert len(layout) == 1
    (op,) = layout
    dims = dims_by_op(graph)[op.name]
    assert kinds(dims) == {"n": "sample", "r1": "attribute"}
    assert axes(dims) == {"n": 0, "r1": 1}
    # The merged [C, H, W] axis splits in whole channels: H * W elements at a time.
    x = graph.tensors[op.inputs[0]].shape
    assert dims["r1"].granule == math.prod(x[2:])
    assert splittable(dims) == {"n": True, "r1": x[1] > 1}


@pytest.mark.parametrize("source", ALL_SOURCES)
def test_attached_cross_entropy_splits_samples_only(load_graph, source: str) -> None:
    graph = load_graph(source).graph
    loss = graph.loss_op
    assert loss is not None and loss.type == "SoftmaxCrossEntropyLoss"
    dims = dims_by_op(graph)[loss.name]
    assert kinds(dims) == {"n": "sample", "c": "reduction"}
    assert splittable(dims) == {"n": True, "c": False}
    assert axes(dims) == {"n": None, "c": None}  # the loss is a scalar


@pytest.mark.parametrize("source", MATMUL_SOURCES)
def test_attached_mse_splits_as_its_targets(load_graph, source: str) -> None:
    """Every dim of an MSE's targets splits as the batch does: each task's squared
    errors are a partial sum of the whole batch's."""
    graph = load_graph(source, loss=LossKind.MSE).graph
    loss = graph.loss_op
    assert loss is not None and loss.type == "MeanSquaredError"
    dims = dims_by_op(graph)[loss.name]
    assert kinds(dims) == {"n": "sample", "c": "sample", "l": "sample"}
    assert splittable(dims) == {"n": True, "c": True, "l": True}


@pytest.mark.parametrize("model", ["cnn", "mlp", "matmul"])
def test_legacy_and_dynamo_exports_give_the_same_dims(load_graph, model: str) -> None:
    loss = LossKind.MSE if model == "matmul" else None
    legacy = load_graph(f"{model}-legacy", loss=loss).graph
    dynamo = load_graph(f"{model}-dynamo", loss=loss).graph

    def signature(graph):
        # Names differ between exporters (/fc1/Gemm vs node_linear) and the legacy
        # Flatten is a Reshape from dynamo; everything else must agree.
        space = dims_by_op(graph)
        return [
            (
                "layout" if op.type in ("Flatten", "Reshape") else op.type,
                graph.tensors[op.output].shape,
                op.nest.flops,
                [(d.name, d.size, d.kind, d.axis, d.splittable) for d in space[op.name].values()],
            )
            for op in graph.ops
        ]

    assert signature(legacy) == signature(dynamo)


def test_reducemean_dims(load_graph) -> None:
    """dynamo's global average pool: n sample, c attribute, the reduced h and w reductions."""
    graph = load_graph("spatial-dynamo").graph
    (op,) = ops_of(graph, "ReduceMean")
    dims = dims_by_op(graph)[op.name]
    assert kinds(dims) == {"n": "sample", "c": "attribute", "h": "reduction", "w": "reduction"}
    assert splittable(dims) == {"n": True, "c": True, "h": False, "w": False}


# --- the batch traced where it lands (a graph by hand, no torch) -------------------------

T, N, H, D = 3, 4, 2, 5  # time steps, batch, heads, head width


def _time_major(path, *, literal_batch: bool):
    """x [N, T, H*D] -> Transpose [T, N, H*D] -> Reshape [T, N*H, D] -> Transpose
    [N*H, T, D] -> Reshape [N, H, T, D] -> Softmax -> Transpose [T, N, H, D] -> Reshape
    [T*N, H*D] -> Reshape [T, N, H*D] -> Transpose [N, T, H*D]: nn.MultiheadAttention's
    layouts around a time-major batch. Shapes written in the file: with a -1 where the
    batch lands, or (``literal_batch``) with the batch written out and a -1 elsewhere."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    shapes = {
        "heads": [0, -1, D] if not literal_batch else [T, N * H, -1],
        "split": [-1, H, T, D] if not literal_batch else [N, H, T, -1],
        "rows": [-1, H * D],
        "back": [T, -1, H * D],
    }
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in shapes.items()]
    node = helper.make_node
    nodes = [
        node("Transpose", ["x"], ["tm"], perm=[1, 0, 2]),
        node("Reshape", ["tm", "heads"], ["merged"]),
        node("Transpose", ["merged"], ["bt"], perm=[1, 0, 2]),
        node("Reshape", ["bt", "split"], ["nhtd"]),
        node("Softmax", ["nhtd"], ["p"], axis=-1),
        node("Transpose", ["p"], ["tnhd"], perm=[2, 0, 1, 3]),
        node("Reshape", ["tnhd", "rows"], ["flat"]),
        node("Reshape", ["flat", "back"], ["tne"]),
        node("Transpose", ["tne"], ["y"], perm=[1, 0, 2]),
    ]
    graph = helper.make_graph(
        nodes,
        "time_major",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", T, H * D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", T, H * D])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_the_batch_is_traced_through_time_major_reshapes(tmp_path) -> None:
    graph = load_model(_time_major(tmp_path / "tm.onnx", literal_batch=False), N).graph
    space = {op.output: op for op in graph.ops}
    dims = dims_by_op(graph)

    def sample_of(tensor: str) -> list[tuple[str, int, bool]]:
        op = space[tensor]
        found = dims[op.name].values()
        return [(d.name, d.granule, d.splittable) for d in found if d.kind.value == "sample"]

    assert sample_of("tm") == [("c", 1, True)]  # [T, N, E]: the batch on axis 1
    # [T, N*H, D]: neither a split nor a merge; the outer axes split together, in heads
    assert sample_of("merged") == [("r1", H, True)]
    assert graph.tensors["merged"].shape == (T, N * H, D)
    assert sample_of("bt") == [("n", 1, True)]  # [N*H, T, D]
    assert sample_of("nhtd") == [("n", 1, True)] and sample_of("p") == [("n", 1, True)]
    assert sample_of("tnhd") == [("c", 1, True)]  # [T, N, H, D]
    # [T*N, H*D]: the batch merged behind the time steps; the rows still split (each
    # task some time steps of every sample), and the batch is traced on through them
    assert sample_of("flat") == [("n", N, True)]  # in whole time steps
    assert sample_of("tne") == [("r1", N, False)]  # [T, N, E]: the inner part of a split
    assert sample_of("y") == [("n", 1, True)]  # [N, T, E], as the data came in


def test_a_written_shape_that_follows_the_batch_is_not_refused(tmp_path) -> None:
    """[T, N*H, -1] and [N, H, T, -1] were written at batch N: they import at N, where they
    land the batch whole, and are refused at another batch, where they would mix samples."""
    path = _time_major(tmp_path / "literal.onnx", literal_batch=True)
    graph = load_model(path, N).graph
    assert graph.tensors["merged"].shape == (T, N * H, D)
    with pytest.raises(ModelError) as err:
        load_model(path, 2 * N)
    message = str(err.value)
    assert f"fixes the batch at {N}" in message and f"--batch {N}" in message
