"""``executor.backend``: the ONNX backend API on one device with onnx2soap's kernels."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.backend.base import Backend, BackendRep

from executor import backend
from onnx2soap.errors import ModelError


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _conv_relu(elem=TensorProto.FLOAT) -> onnx.ModelProto:
    """Conv (weight initializer) -> Add (bias given as a graph input) -> Relu."""
    rng = np.random.default_rng(0)
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(dtype), "w")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "b"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", elem, [None, 3, 5, 5]),
        helper.make_tensor_value_info("b", elem, [4, 1, 1]),
    ]
    return _model(nodes, inputs, [helper.make_tensor_value_info("y", elem, None)], [w])


def test_module_level_api_is_onnxruntime_backend_s() -> None:
    assert issubclass(backend.SoapBackend, Backend)
    assert backend.supports_device("CPU")
    assert not backend.supports_device("TPU")
    rep = backend.prepare(_conv_relu(), device="CPU")
    assert isinstance(rep, BackendRep)


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.DOUBLE])
def test_a_model_runs_like_onnxruntime(elem) -> None:
    model = _conv_relu(elem)
    rng = np.random.default_rng(1)
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    x = rng.standard_normal((2, 3, 5, 5)).astype(dtype)
    b = rng.standard_normal((4, 1, 1)).astype(dtype)
    # onnxruntime has no double Conv: the double model is checked against the float one.
    reference = _conv_relu()
    (want,) = _ort(reference, {"x": x.astype(np.float32), "b": b.astype(np.float32)})
    rep = backend.prepare(model)
    for got in (rep.run([x, b]), rep.run({"b": b, "x": x}), backend.run_model(model, [x, b])):
        assert got[0].dtype == dtype and got["y"].shape == want.shape
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    # Another batch size through the same prepared model.
    x3 = rng.standard_normal((3, 3, 5, 5)).astype(dtype)
    want3 = _ort(reference, {"x": x3.astype(np.float32), "b": b.astype(np.float32)})[0]
    np.testing.assert_allclose(rep.run([x3, b])[0], want3, rtol=1e-5, atol=1e-5)


def test_several_outputs_are_each_computed() -> None:
    nodes = [helper.make_node("Split", ["x"], ["a", "b"], axis=1, num_outputs=2)]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "ab"],
        opset=18,
    )
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    try:
        a, b = backend.run_model(model, [x])
    except ModelError as e:  # while Split is not defined
        pytest.skip(str(e))
    np.testing.assert_array_equal(a, x[:, :2])
    np.testing.assert_array_equal(b, x[:, 2:])


def test_run_node() -> None:
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    (y,) = backend.run_node(helper.make_node("Relu", ["x"], ["y"]), [x])
    np.testing.assert_array_equal(y, np.maximum(x, 0))


def test_refusals_are_clear() -> None:
    """What the importer refuses raises its ModelError, without the temporary file."""
    ints = _model(
        [helper.make_node("Add", ["x", "z"], ["y"])],
        [helper.make_tensor_value_info(n, TensorProto.INT64, [2]) for n in "xz"],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
    )
    # ids are a data input, and integers computed from them are supported (no gradient)
    (y,) = backend.run_model(ints, [np.array([3, -7]), np.array([4, 2])])
    np.testing.assert_array_equal(y, [7, -5])
    # but not integers computed from floats: the gradient would stop there
    cut = _model(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.INT64)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
    )
    with pytest.raises(ModelError, match="cast of float32 to INT64 is not supported"):
        backend.run_model(cut, [np.ones(2, np.float32)])
    wide = _model(
        [helper.make_node("Add", ["x", "z"], ["y"])],
        [helper.make_tensor_value_info(n, TensorProto.UINT64, [2]) for n in "xz"],
        [helper.make_tensor_value_info("y", TensorProto.UINT64, None)],
    )
    with pytest.raises(ModelError, match="no float, integer or bool graph input"):
        backend.run_model(wide, [np.ones(2, np.uint64), np.ones(2, np.uint64)])
    batch = _model(
        [helper.make_node("Det", ["x"], ["y"])],  # no op definition
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    with pytest.raises(ModelError) as refused:
        backend.run_model(batch, [np.ones((2, 3, 3), np.float32)])
    assert "onnx2soap-backend" not in str(refused.value)
    with pytest.raises(ModelError, match="inputs"):
        backend.run_model(batch, [])


@pytest.mark.gpu
@pytest.mark.skipif(not backend.supports_device("CUDA"), reason="no cupy or CUDA GPU")
def test_cuda_computes_what_the_cpu_does() -> None:
    model = _conv_relu(TensorProto.DOUBLE)
    rng = np.random.default_rng(3)
    feeds = [rng.standard_normal((2, 3, 5, 5)), rng.standard_normal((4, 1, 1))]
    (cpu,) = backend.run_model(model, feeds, device="CPU")
    (gpu,) = backend.run_model(model, feeds, device="CUDA")
    assert isinstance(gpu, np.ndarray)
    np.testing.assert_allclose(gpu, cpu, rtol=1e-12, atol=1e-12)


def test_training_mode_batchnorm_uses_the_batch_statistics() -> None:
    """BatchNormalization(training_mode=1) normalizes with the batch's mean and biased
    variance, computed here by hand."""
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((4, 3, 2, 2)) + 5).astype(np.float64)
    scale, bias = rng.standard_normal(3), rng.standard_normal(3)
    params = [
        numpy_helper.from_array(v.astype(np.float64), n)
        for n, v in (("s", scale), ("b", bias), ("m", np.zeros(3)), ("v", np.ones(3)))
    ]
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])
    node.attribute.append(helper.make_attribute("training_mode", 1))
    graph = helper.make_graph(
        [node],
        "bn",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, x.shape)],
        params,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    (got,) = backend.prepare(model, "CPU").run([x])
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    want = (x - mean) / np.sqrt(var + 1e-5) * scale.reshape(1, 3, 1, 1) + bias.reshape(1, 3, 1, 1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _info(name: str, elem: int, shape=None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def test_outputs_come_back_in_their_onnx_types() -> None:
    """The IR computes masks as 0/1 and ids as int64; each output is returned in the type
    the graph declares, or, undeclared, the one shape inference gives it."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    less = _model(
        [helper.make_node("Less", ["x", "c"], ["y"])],
        [_info("x", TensorProto.FLOAT, [3, 4])],
        [onnx.ValueInfoProto(name="y")],  # no type given: inferred as bool
        [numpy_helper.from_array(np.float32(0.25), "c")],
    )
    (y,) = backend.run_model(less, [x])
    assert y.dtype == np.bool_
    np.testing.assert_array_equal(y, x < 0.25)
    # int32 ids and a bool mask as the data input: widened to int64, read as 0/1 ids
    ids = rng.integers(-3, 3, (3, 4)).astype(np.int32)
    equal = _model(
        [helper.make_node("Equal", ["a", "b"], ["y"])],
        [_info("a", TensorProto.INT32, [3, 4]), _info("b", TensorProto.INT32, [4])],
        [_info("y", TensorProto.BOOL)],
    )
    (y,) = backend.run_model(equal, [ids, ids[0]])
    assert y.dtype == np.bool_
    np.testing.assert_array_equal(y, ids == ids[0])
    scan = _model(
        [helper.make_node("CumSum", ["a", "axis"], ["y"], exclusive=1)],
        [_info("a", TensorProto.INT32, [3, 4])],
        [_info("y", TensorProto.INT32)],
        [numpy_helper.from_array(np.int32(1), "axis")],
    )
    (y,) = backend.run_model(scan, [ids])
    assert y.dtype == np.int32
    want = np.concatenate([np.zeros((3, 1), np.int32), np.cumsum(ids, axis=1)[:, :-1]], axis=1)
    np.testing.assert_array_equal(y, want)
    mask = rng.standard_normal((2, 5)) > 0
    (y,) = backend.run_node(helper.make_node("Not", ["m"], ["y"]), [mask])
    assert y.dtype == np.bool_
    np.testing.assert_array_equal(y, ~mask)


def test_run_each_computes_the_supported_outputs_and_says_why_not_the_others() -> None:
    node = helper.make_node("LayerNormalization", ["x", "s"], ["y", "mean"], axis=1)
    model = _model(
        [node],
        [_info("x", TensorProto.FLOAT, [2, 5])],
        [_info("y", TensorProto.FLOAT), _info("mean", TensorProto.FLOAT)],
        [numpy_helper.from_array(np.ones(5, np.float32), "s")],
    )
    x = np.random.default_rng(5).standard_normal((2, 5)).astype(np.float32)
    rep = backend.prepare(model)
    results = rep.run_each([x])
    assert list(results) == ["y", "mean"]
    centered = x - x.mean(axis=1, keepdims=True)
    want = centered / np.sqrt((centered**2).mean(axis=1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(results["y"], want, rtol=1e-5, atol=1e-5)
    assert isinstance(results["mean"], ModelError)
    assert "first output" in str(results["mean"])
    with pytest.raises(ModelError, match="first output"):
        rep.run([x])


def test_an_old_opset_is_read_where_its_schemas_are_unchanged() -> None:
    """And of opset 7 is And of opset 13; Dropout's schema changed at 12 and 13 (training
    mode), so a Dropout model of opset 11 stays refused."""
    model = _model(
        [helper.make_node("And", ["a", "b"], ["y"])],
        [_info("a", TensorProto.BOOL, [2, 3]), _info("b", TensorProto.BOOL, [3])],
        [_info("y", TensorProto.BOOL)],
        opset=7,
    )
    a = np.array([[True, False, True], [False, False, True]])
    b = np.array([True, True, False])
    (y,) = backend.run_model(model, [a, b])
    np.testing.assert_array_equal(y, a & b)
    dropout = _model(
        [helper.make_node("Dropout", ["x"], ["y"])],
        [_info("x", TensorProto.FLOAT, [2, 3])],
        [_info("y", TensorProto.FLOAT)],
        opset=11,
    )
    with pytest.raises(ModelError, match="too old"):
        backend.run_model(dropout, [np.ones((2, 3), np.float32)])
