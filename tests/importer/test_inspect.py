"""``onnx2soap inspect``: the table, and the documented shape and numbers of ``--json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.importer.helpers import run_cli

BATCH = 32
KINDS = {"sample", "attribute", "parameter", "reduction"}
OP_KEYS = {"name", "type", "output_shape", "flops", "params", "dims"}
DIM_KEYS = {"name", "size", "kind", "axis", "splittable", "synchronized"}
# (N, CO, OH, OW, CI, KH, KW) of each Conv of examples/cnn.py at batch 32.
EXAMPLE_CONVS = {
    "/conv1/Conv": (BATCH, 16, 32, 32, 3, 3, 3),
    "/branch_a/conv/Conv": (BATCH, 16, 16, 16, 16, 3, 3),
    "/branch_b/conv/Conv": (BATCH, 16, 16, 16, 16, 1, 1),
}
EXAMPLE_PARAMS = 134_826  # sum(p.numel() for p in SmallCNN().parameters())


@pytest.fixture(scope="module")
def report(example_onnx: Path) -> dict:
    result = run_cli(["inspect", example_onnx, "--batch", BATCH, "--json"])
    assert result.code == 0 and result.stderr == ""
    return json.loads(result.stdout)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def test_top_level_has_the_documented_keys(report: dict, example_onnx: Path) -> None:
    # Other keys may be added (the loss kind is); these must be there with these types.
    assert {"model", "batch", "ops"} <= set(report)
    assert report["loss"] == "cross-entropy"
    assert report["model"] == str(example_onnx)
    assert report["batch"] == BATCH and is_int(report["batch"])


def test_every_op_has_exactly_the_documented_fields(report: dict) -> None:
    assert isinstance(report["ops"], list) and report["ops"]
    for op in report["ops"]:
        assert set(op) == OP_KEYS, op["name"]
        assert isinstance(op["name"], str) and isinstance(op["type"], str)
        assert isinstance(op["output_shape"], list)
        assert all(is_int(s) for s in op["output_shape"])
        assert is_int(op["flops"]) and is_int(op["params"])
        assert isinstance(op["dims"], list) and op["dims"]


def test_every_dim_has_exactly_the_documented_fields(report: dict) -> None:
    for op in report["ops"]:
        for dim in op["dims"]:
            assert set(dim) == DIM_KEYS, (op["name"], dim)
            assert isinstance(dim["name"], str) and is_int(dim["size"])
            assert dim["kind"] in KINDS
            assert dim["axis"] is None or is_int(dim["axis"])
            assert isinstance(dim["splittable"], bool)
            # An axis is where a kept dim lands in the output; reductions land nowhere.
            if dim["kind"] == "reduction":
                assert dim["axis"] is None
            elif dim["axis"] is not None:
                assert op["output_shape"][dim["axis"]] == dim["size"]


def test_ops_are_the_example_in_order_with_the_loss_last(report: dict) -> None:
    names = [op["name"] for op in report["ops"]]
    assert names[:3] == ["/conv1/Conv", "/relu1/Relu", "/pool1/MaxPool"]
    assert names[-3:] == ["/relu_fc/Relu", "/fc2/Gemm", "loss"]
    loss = report["ops"][-1]
    assert loss["type"] == "SoftmaxCrossEntropyLoss"
    assert loss["output_shape"] == [] and loss["params"] == 0


@pytest.mark.parametrize("name", sorted(EXAMPLE_CONVS))
def test_conv_flops_and_params(report: dict, name: str) -> None:
    n, co, oh, ow, ci, kh, kw = EXAMPLE_CONVS[name]
    (op,) = [o for o in report["ops"] if o["name"] == name]
    assert op["output_shape"] == [n, co, oh, ow]
    assert op["flops"] == 2 * n * co * oh * ow * ci * kh * kw
    assert op["params"] == co * ci * kh * kw + co  # weight + bias


def test_gemm_flops_and_params(report: dict) -> None:
    (fc1,) = [o for o in report["ops"] if o["name"] == "/fc1/Gemm"]
    assert fc1["flops"] == 2 * BATCH * 64 * 2048
    assert fc1["params"] == 64 * 2048 + 64


def test_params_add_up_to_the_model(report: dict) -> None:
    assert sum(op["params"] for op in report["ops"]) == EXAMPLE_PARAMS


def test_table_lists_every_op(example_onnx: Path, report: dict) -> None:
    result = run_cli(["inspect", example_onnx, "--batch", BATCH])
    assert result.code == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 1 + len(report["ops"]) + 1  # header, one row per op, totals
    for line, op in zip(lines[1:-1], report["ops"], strict=True):
        assert line.split()[:2] == [op["name"], op["type"]]
    assert lines[-1].startswith(f"{len(report['ops'])} ops, batch {BATCH}, loss cross-entropy")


def test_batchnorm_mode_shows_in_its_synchronized_dims(tmp_path: Path) -> None:
    """Training mode: the batch and spatial dims carry statistics; inference: none."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from onnx2soap.cli.inspect_cmd import report
    from onnx2soap.importer import load_model
    from onnx2soap.ir import LossKind

    params = [numpy_helper.from_array(np.ones(3, np.float32), n) for n in "sbmv"]
    for mode, synced in ((1, {"n", "h", "w"}), (0, set())):
        outputs = ["y", "rm", "rv"] if mode else ["y"]
        node = helper.make_node("BatchNormalization", ["x", *"sbmv"], outputs, training_mode=mode)
        graph = helper.make_graph(
            [node],
            "bn",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4, 4])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3, 4, 4])],
            params,
        )
        path = tmp_path / f"bn{mode}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]), path)
        (bn,) = report(load_model(path, loss=LossKind.NONE).graph, str(path))["ops"]
        assert {d["name"] for d in bn["dims"] if d["synchronized"]} == synced


def _stored(name: str, value):
    import onnx

    from onnx2soap.importer.weights import InlineData, StoredTensor

    elem = onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
    payload = value.astype(value.dtype.newbyteorder("<")).tobytes()
    return StoredTensor(name, value.shape, elem, InlineData(payload))


def test_weight_copies_are_found_and_constant_arrays_ignored() -> None:
    import numpy as np

    from onnx2soap.importer.copies import CopyKind, weight_copies

    w = np.arange(6.0).reshape(2, 3)
    arrays = {"a": w, "b": w.copy(), "c": w.T.copy(), "zeros1": np.zeros(4), "zeros2": np.zeros(4)}
    copies = weight_copies({k: _stored(k, v) for k, v in arrays.items()})
    assert {(c.first, c.second, c.kind) for c in copies} == {
        ("a", "b", CopyKind.EQUAL),
        ("a", "c", CopyKind.TRANSPOSED),
    }


def test_weight_copies_compare_whole_weights_not_only_their_samples() -> None:
    """Weights that agree at every sampled position but differ elsewhere are not copies;
    big ones are compared a band of rows at a time."""
    import numpy as np

    from onnx2soap.importer import copies
    from onnx2soap.importer.copies import CopyKind, weight_copies

    w = np.random.default_rng(0).standard_normal((97, 41)).astype(np.float32)
    sampled = set(copies._positions(w.shape))
    spot = next((i, j) for i in range(97) for j in range(41) if (i, j) not in sampled)
    near = w.copy()
    near[spot] += 1.0
    near_t = w.T.copy()
    near_t[spot[::-1]] += 1.0
    arrays = {"w": w, "w_equal": w.copy(), "w_near": near, "wt": w.T.copy(), "wt_near": near_t}
    stored = {k: _stored(k, v) for k, v in arrays.items()}
    for band in (copies.COMPARE_BYTES, 41 * 4 * 3):  # whole, and three rows at a time
        copies_found = {
            (c.first, c.second, c.kind)
            for c in _with_band(copies, band, lambda: weight_copies(stored))
        }
        assert copies_found == {
            ("w", "w_equal", CopyKind.EQUAL),
            ("w", "wt", CopyKind.TRANSPOSED),
            ("w_near", "wt_near", CopyKind.TRANSPOSED),  # near_t is near's transpose
        }


def _with_band(module, band: int, work):
    saved = module.COMPARE_BYTES
    module.COMPARE_BYTES = band
    try:
        return work()
    finally:
        module.COMPARE_BYTES = saved


@pytest.mark.parametrize(("exporter", "warned"), [("dynamo", True), ("legacy", False)])
def test_inspect_warns_when_an_export_broke_a_tie(export_model, exporter, warned) -> None:
    """Dynamo's default optimizer stores the tied LM head as a transposed copy of the
    embedding; the legacy exporter keeps one weight."""
    from tests.importer.helpers import run_cli

    result = run_cli(["inspect", export_model("tied", exporter), "--batch", "4"])
    assert result.code == 0
    assert ("are transposed copies" in result.stdout) is warned, result.stdout[-500:]
