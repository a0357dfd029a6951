"""SOAP dim kinds of imported ops, from real PyTorch exports (legacy and dynamo) and from
the committed example: FlexFlow's Table 1 recovered from the loop nests.

Sources are named "example" (examples/cnn.onnx), "view" (x.view(x.size(0), -1)) or
"<model>-<exporter>" for a model of tests/models.py; every graph is loaded at batch 8.
"""

from __future__ import annotations

import math

import pytest

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
            "ci": False,
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
        # Rows are samples, output features index the weight, input features are summed.
        assert kinds(dims) == {"n": "sample", "co": "parameter", "ci": "reduction"}, op.name
        assert axes(dims) == {"n": 0, "co": 1, "ci": None}
        assert splittable(dims) == {"n": True, "co": True, "ci": False}
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
    assert splittable(dims) == {"n": True, "m": True, "co": True, "ci": False}


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
def test_attached_mse_splits_samples_only(load_graph, source: str) -> None:
    graph = load_graph(source, loss=LossKind.MSE).graph
    loss = graph.loss_op
    assert loss is not None and loss.type == "MeanSquaredError"
    dims = dims_by_op(graph)[loss.name]
    assert kinds(dims) == {"n": "sample", "c": "reduction", "l": "reduction"}
    assert splittable(dims) == {"n": True, "c": False, "l": False}


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
