"""Weights stay where they are stored: planning reads shapes and dtypes, and a box of a
weight reads exactly that box, compared with numpy's own reading of the same bytes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from benchmarks.peak_rss import measure
from benchmarks.sparse_mlp import Fill, write_sparse_mlp
from onnx2soap.importer import load_model, weights
from onnx2soap.importer.weights import ExternalData, StoredTensor
from tests.importer.helpers import run_cli

REPO = Path(__file__).resolve().parents[2]


def _boxes(shape: tuple[int, ...], rng: np.random.Generator, count: int):
    """The whole tensor, an empty box, and ``count`` random boxes."""
    yield tuple((0, n) for n in shape)
    yield tuple((0, 0) if k == 0 else (0, n) for k, n in enumerate(shape))
    for _ in range(count):
        box = []
        for n in shape:
            lo = int(rng.integers(0, n))
            box.append((lo, int(rng.integers(lo + 1, n + 1))))
        yield tuple(box)


def _reference(data: Path, offset: int, shape, dtype) -> np.ndarray:
    count = int(np.prod(shape))
    return np.fromfile(data, dtype=dtype, count=count, offset=offset).reshape(shape)


@pytest.mark.parametrize("chunk", [weights.CHUNK_BYTES, 64 * 4 * 3, 40])
def test_boxes_of_external_weights_are_the_files_bytes(tmp_path: Path, monkeypatch, chunk) -> None:
    """Whole rows, a few rows a chunk, and rows longer than a chunk read the same."""
    monkeypatch.setattr(weights, "CHUNK_BYTES", chunk)
    mlp = write_sparse_mlp(tmp_path, 3, 64, fill=Fill.RANDOM, seed=3)
    model = load_model(mlp.model, batch=2)
    rng = np.random.default_rng(0)
    for i in range(3):
        stored = model.weights[f"w{i}"]
        assert isinstance(stored.where, ExternalData)
        full = _reference(mlp.data, i * 64 * 64 * 4, (64, 64), "<f4")
        for box in _boxes(stored.shape, rng, 12):
            want = full[tuple(slice(lo, hi) for lo, hi in box)]
            np.testing.assert_array_equal(stored.read(box), want, err_msg=str(box))


@pytest.mark.parametrize("chunk", [weights.CHUNK_BYTES, 9 * 8 * 2, 24])
def test_boxes_of_a_3d_tensor(tmp_path: Path, monkeypatch, chunk) -> None:
    monkeypatch.setattr(weights, "CHUNK_BYTES", chunk)
    value = np.random.default_rng(1).standard_normal((5, 7, 9))
    path = tmp_path / "t.bin"
    path.write_bytes(b"pad!" + value.astype("<f8").tobytes())
    elem = TensorProto.DOUBLE
    stored = StoredTensor("t", value.shape, elem, ExternalData(path, 4, value.nbytes))
    rng = np.random.default_rng(2)
    for box in _boxes(value.shape, rng, 40):
        want = value[tuple(slice(lo, hi) for lo, hi in box)]
        np.testing.assert_array_equal(stored.read(box), want, err_msg=str(box))
        np.testing.assert_array_equal(stored[tuple(slice(lo, hi) for lo, hi in box)], want)
    np.testing.assert_array_equal(np.asarray(stored), value)
    with pytest.raises(ValueError, match="not inside"):
        stored.read(((0, 6), (0, 7), (0, 9)))


def _one_matmul(tmp_path: Path, weight: onnx.TensorProto) -> Path:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", weight.name], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [weight],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_typed_float_data_is_read_like_raw_bytes(tmp_path: Path) -> None:
    value = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    weight = helper.make_tensor("w", TensorProto.FLOAT, (3, 4), value.flatten().tolist())
    assert not weight.HasField("raw_data")
    model = load_model(_one_matmul(tmp_path, weight), batch=2)
    np.testing.assert_array_equal(model.weights["w"].read(), value)
    np.testing.assert_array_equal(model.weights["w"].read(((1, 3), (2, 4))), value[1:3, 2:4])


def _external(tmp_path: Path, entries: dict[str, str], data: bytes | None = None) -> Path:
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=(3, 4))
    weight.data_location = TensorProto.EXTERNAL
    for key, value in entries.items():
        weight.external_data.add(key=key, value=value)
    path = _one_matmul(tmp_path, weight)
    if data is not None:
        (tmp_path / "w.bin").write_bytes(data)
    return path


FULL = np.zeros((3, 4), np.float32).tobytes()


@pytest.mark.parametrize(
    ("entries", "data", "says"),
    [
        ({"location": "w.bin"}, None, "external weight file missing"),
        ({"location": "w.bin"}, FULL[:-4], "needs bytes 0 to 48 of w.bin, which holds 44"),
        ({"location": "w.bin", "offset": "8"}, FULL, "needs bytes 8 to 56"),
        ({"location": "w.bin", "length": "40"}, FULL, "length 40, but its dims [3, 4] need 48"),
        ({"location": "w.bin", "offset": "-4"}, FULL, "offset '-4' is not a byte count"),
        ({"location": "../w.bin"}, FULL, "'../w.bin' is outside the model's folder"),
        ({"location": "/etc/passwd"}, None, "'/etc/passwd' is outside the model's folder"),
        ({}, None, "external data without a location"),
    ],
    ids=["missing", "short", "offset-past-end", "length", "negative", "traversal", "abs", "none"],
)
def test_bad_external_data_is_refused_in_one_line(tmp_path, entries, data, says) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    if entries.get("location") == "../w.bin":
        (tmp_path / "w.bin").write_bytes(data)  # it exists, but outside the folder
        data = None
    path = _external(folder, entries, data)
    for command in (
        ["inspect", path, "--batch", 2],
        [
            "plan",
            path,
            "--batch",
            2,
            "--devices",
            "2",
            "--strategy",
            "data-parallel",
            "-o",
            tmp_path / "p.json",
        ],
    ):
        result = run_cli(command)
        assert result.code == 2, result.stderr
        assert len(result.stderr_lines) == 1 and says in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_a_34_gb_model_is_planned_without_reading_its_weights(tmp_path: Path) -> None:
    """32 layers of 16384x16384 float32 on a sparse file: inspect and plan run in a
    fraction of a GB (reading the weights would need 34), and the plan is written."""
    mlp = write_sparse_mlp(tmp_path, 32, 16384)
    assert mlp.weight_bytes > 34e9 and os.stat(mlp.data).st_blocks == 0  # no disk used
    cli = [sys.executable, "-m", "onnx2soap"]
    plan = tmp_path / "plan.json"
    runs = {
        "inspect": [*cli, "inspect", str(mlp.model), "--batch", "8"],
        "plan": [
            *cli,
            "plan",
            str(mlp.model),
            "--batch",
            "8",
            "--devices",
            "4",
            "--strategy",
            "data-parallel",
            "-o",
            str(plan),
        ],
    }
    for name, argv in runs.items():
        got = measure(argv, cwd=REPO)  # the command's own peak, not pytest's
        assert got.exit_code == 0, f"{name}: {got.stderr}"
        assert got.peak_rss < 1 << 30, f"{name}: peak RSS {got.peak_rss / 2**20:.0f} MB"
    assert plan.is_file()
    loaded = load_model(mlp.model, batch=8)
    assert {t.name: t.shape for t in loaded.weights.values()} == {
        f"w{i}": (16384, 16384) for i in range(32)
    }


def test_inline_weights_leave_the_parsed_model(tmp_path: Path) -> None:
    """An inline weight's bytes are moved out of the proto, not copied: reading gives
    what numpy_helper reads from the file."""
    value = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    path = _one_matmul(tmp_path, numpy_helper.from_array(value, "w"))
    model = load_model(path, batch=2)
    np.testing.assert_array_equal(model.weights["w"].read(), value)
    np.testing.assert_array_equal(model.weights["w"][1:, ::1], value[1:])


def test_a_large_folded_constant_kept_beside_the_proto_feeds_its_op(tmp_path: Path) -> None:
    """A folded value past 64 KiB (a causal mask, here a [64, 512] table) is kept beside
    the proto, never serialized through shape inference again; the model still computes
    what onnxruntime computes."""
    import onnxruntime as ort

    from executor import backend
    from onnx2soap.importer.prepare import prepare

    shape = helper.make_tensor("shape", TensorProto.INT64, (2,), [64, 512])
    table = helper.make_node(
        "ConstantOfShape",
        ["shape"],
        ["table"],
        value=helper.make_tensor("v", TensorProto.FLOAT, (1,), [0.5]),
    )
    ramp = helper.make_node("CumSum", ["table", "axis"], ["ramp"])  # 0.5, 1.0, ... per row
    axis = helper.make_tensor("axis", TensorProto.INT64, (), [1])
    graph = helper.make_graph(
        [table, ramp, helper.make_node("Mul", ["x", "ramp"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64, 512])],
        [shape, axis],
    )
    path = tmp_path / "folded.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    prepared = prepare(path, 2)
    (big,) = [v for v in prepared.constants.values() if v.nbytes > 64 << 10]
    np.testing.assert_array_equal(big, np.cumsum(np.full((64, 512), 0.5, np.float32), axis=1))
    x = np.random.default_rng(0).standard_normal((2, 64, 512)).astype(np.float32)
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    (got,) = backend.prepare(onnx.load(path)).run([x])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_folded_mask_at_the_bound_batch_is_held_once_not_per_sequence(tmp_path) -> None:
    """A causal mask as Hugging Face's eager attention builds it: positions copied to
    every sequence of the batch (Expand, then a Mul that makes them a real array),
    compared (LessOrEqual), then Where: folded at batch 64 and 256 tokens it is a [64, 1,
    256, 256] float32 constant (16 MiB) of one distinct [256, 256] table (256 KiB), which
    is all it holds; its values, and what the model computes, are onnxruntime's."""
    import onnxruntime as ort

    from executor import backend
    from onnx2soap.importer.prepare import prepare

    tokens, batch = 256, 64
    inits = [
        helper.make_tensor("start", TensorProto.INT64, (), [0]),
        helper.make_tensor("limit", TensorProto.INT64, (), [tokens]),
        helper.make_tensor("delta", TensorProto.INT64, (), [1]),
        helper.make_tensor("rows", TensorProto.INT64, (4,), [batch, 1, tokens, 1]),
        helper.make_tensor("cols", TensorProto.INT64, (4,), [batch, 1, 1, tokens]),
        helper.make_tensor("axes", TensorProto.INT64, (3,), [0, 1, 3]),
        helper.make_tensor("axes_c", TensorProto.INT64, (3,), [0, 1, 2]),
        helper.make_tensor("one", TensorProto.INT64, (), [1]),
        helper.make_tensor("zero", TensorProto.FLOAT, (), [0.0]),
        helper.make_tensor("low", TensorProto.FLOAT, (), [-1e9]),
    ]
    nodes = [
        helper.make_node("Range", ["start", "limit", "delta"], ["pos"]),
        helper.make_node("Unsqueeze", ["pos", "axes"], ["pos_r"]),
        helper.make_node("Unsqueeze", ["pos", "axes_c"], ["pos_c"]),
        helper.make_node("Expand", ["pos_r", "rows"], ["r_b"]),
        helper.make_node("Mul", ["r_b", "one"], ["r"]),  # a real [64, 1, 256, 1] array
        helper.make_node("Expand", ["pos_c", "cols"], ["c_b"]),
        helper.make_node("Mul", ["c_b", "one"], ["c"]),
        helper.make_node("LessOrEqual", ["c", "r"], ["allowed"]),
        helper.make_node("Where", ["allowed", "zero", "low"], ["mask"]),
        helper.make_node("Add", ["x", "mask"], ["y"]),
    ]
    shape = [batch, 1, tokens, tokens]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        inits,
    )
    path = tmp_path / "mask.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    prepared = prepare(path, batch)
    (mask,) = [v for v in prepared.constants.values() if v.shape == tuple(shape)]
    distinct = mask.base if mask.base is not None else mask
    assert mask.strides[:2] == (0, 0) and distinct.nbytes == tokens * tokens * 4
    causal = np.where(np.tril(np.ones((tokens, tokens), bool)), 0.0, -1e9).astype(np.float32)
    np.testing.assert_array_equal(mask, np.broadcast_to(causal, shape))
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"x": x})
    (got,) = backend.prepare(onnx.load(path)).run([x])
    np.testing.assert_array_equal(got, want)
    # the graph says so: a device holds (and the memory model prices) its distinct values
    from onnx2soap.importer import load_model

    (constant,) = load_model(path, batch).graph.constants
    assert constant.shape == tuple(shape) and constant.held_numel == tokens * tokens


@pytest.mark.parametrize("elem", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_a_weight_the_executor_cannot_compute_in_is_refused_in_one_line(tmp_path, elem) -> None:
    """Half-precision weights (mixed precision keeps float32 masters: export them in
    float32) are refused by planning too, before anything reads them."""
    weight = TensorProto(name="w", data_type=elem, dims=(3, 4))
    weight.data_location = TensorProto.EXTERNAL
    for key, value in {"location": "w.bin", "length": "24"}.items():
        weight.external_data.add(key=key, value=value)
    (tmp_path / "w.bin").write_bytes(bytes(24))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", elem, ["N", 3])],
        [helper.make_tensor_value_info("y", elem, ["N", 4])],
        [weight],
    )
    path = tmp_path / "half.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    result = run_cli(["inspect", path, "--batch", 2])
    assert result.code == 2 and len(result.stderr_lines) == 1, result.stderr
    name = TensorProto.DataType.Name(elem)
    assert f"element type {name}; supported: float, double, int64" in result.stderr
