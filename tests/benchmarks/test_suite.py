"""benchmarks/suite.py on one small model (written with onnx.helper: no torch) and one
cell: the tables have their shape, and the search is no slower than any baseline that
fits."""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from benchmarks.suite import BASELINE_NAMES, HEADER, Cell, cell_row, check, main
from benchmarks.suite_models import MODELS

# The issue's suite: FlexFlow's six, Alpa's four and a LLaMA-3-8B shape.
SUITE = {
    "alexnet",
    "inception_v3",
    "resnet101",
    "rnntc",
    "rnnlm",
    "nmt",
    "gpt_1.3b",
    "gpt_2.6b",
    "moe_2.4b",
    "wide_resnet",
    "llama3_8b",
}


def _columns(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_one_cell(tmp_path: Path) -> None:
    out = tmp_path / "suite.md"
    argv = ["--models", "small_mlp", "--presets", "flexflow-p100", "--devices", "8"]
    argv += ["--budget", "10", "--max-evals", "100", "--work", str(tmp_path), "--out", str(out)]
    assert main(argv) == 0
    lines = out.read_text().splitlines()
    imports, blank, header, rule, row = lines[2], lines[3], lines[4], lines[5], lines[6]
    assert len(lines) == 7 and blank == ""
    assert _columns(imports)[0] == "small_mlp" and _columns(imports)[-1] == "ok"
    assert header == HEADER and set(rule) == {"|", "-"}
    got = dict(zip(_columns(header), _columns(row), strict=True))
    assert got["model"] == "small_mlp" and got["devices"] == "8" and got["batch"] == "128"
    assert float(got["rule/search"].strip("*×")) >= 1.0
    doc = json.loads((tmp_path / "cells" / "small_mlp@flexflow-p100:8.json").read_text())
    assert set(BASELINE_NAMES) <= set(doc["starts"])
    assert check(doc) == []
    search = doc["search"]["step_s"]
    fitting = [e["step_s"] for n, e in doc["starts"].items() if e["fits"]]
    assert fitting and search <= min(fitting)
    assert 0 < doc["within_1pct_s"] <= doc["search_s"]


def test_a_faster_baseline_is_reported() -> None:
    starts = {n: {"step_s": 2.0, "fits": True, "peak_bytes": 1} for n in BASELINE_NAMES}
    starts["ilp"] = {"step_s": 0.5, "fits": True, "peak_bytes": 1}
    starts["expert"] = {"step_s": 0.1, "fits": False, "peak_bytes": 1}  # no reference
    doc = {"starts": starts, "search": {"step_s": 1.0}}
    assert check(doc) == ["ilp 0.5 s < search 1 s"]


def test_a_cell_where_nothing_fits_has_the_header_s_columns() -> None:
    doc = {"batch": 64, "import_s": 1.0, "peak_rss": 2e9, "error": "no strategy fits"}
    row = cell_row(Cell("m", "dgx-h100", 8), doc)
    assert len(_columns(row)) == len(_columns(HEADER))
    assert "no strategy fits" in row


def test_the_suite_is_the_issue_s() -> None:
    assert set(MODELS) == SUITE
    for spec in MODELS.values():
        assert spec.per_device >= 1 and spec.inputs and spec.note
    # a LLaMA-3-8B sequence a node of 8: 1, 2 and 8 sequences on the suite's 8, 16, 64
    assert [MODELS["llama3_8b"].batch(d) for d in (8, 16, 64)] == [1, 2, 8]
    assert [MODELS["gpt_1.3b"].batch(d) for d in (8, 16, 64)] == [8, 16, 64]


def _weight(name: str, dims: tuple[int, ...], offset: int) -> onnx.TensorProto:
    init = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=dims)
    init.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "m.data"), ("offset", offset), ("length", 48)):
        init.external_data.add(key=key, value=str(value))
    return init


def test_a_weight_is_stored_as_read_unless_another_op_reads_it() -> None:
    """``W.T`` read by a MatMul becomes a [3, 4] initializer; ``E.T`` stays a Transpose,
    since a Gather reads ``E`` too (a tied embedding)."""
    from onnx import TensorProto, helper

    from benchmarks.suite_models import fold_weight_shapes, stored_bytes

    nodes = [
        helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "Wt"], ["y"]),
        helper.make_node("Gather", ["E", "ids"], ["e"]),
        helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
        helper.make_node("MatMul", ["y", "Et"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"]),
        ],
        [
            helper.make_tensor_value_info("z", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("e", TensorProto.FLOAT, None),
        ],
        [_weight("W", (4, 3), 0), _weight("E", (4, 3), 64)],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    size = fold_weight_shapes(proto, "m.data", 112)
    assert [n.op_type for n in proto.graph.node] == ["MatMul", "Gather", "Transpose", "MatMul"]
    stored = {i.name: tuple(i.dims) for i in proto.graph.initializer}
    assert stored == {"E": (4, 3), "Wt": (3, 4)}  # W itself: read by nothing now
    assert size == 128 + 48 and stored_bytes(proto) == 96


def test_a_cell_whose_plan_has_a_zero_stage_says_so() -> None:
    starts = {
        n: {"step_s": 2.0, "fits": n == "model-parallel", "peak_bytes": 1} for n in BASELINE_NAMES
    }
    doc = {"batch": 8, "import_s": 1.0, "peak_rss": 2e9, "starts": starts, "search_s": 50.0}
    doc.update(search={"step_s": 0.5}, setup_s=5.0, within_1pct_s=50.0, zero_stage=2)
    row = cell_row(Cell("m", "dgx-h100", 8), doc)
    got = dict(zip(_columns(HEADER), _columns(row), strict=True))
    assert got["search"] == "500 ms (ZeRO-2)" and got["best rule"] == "model-parallel"
    assert got["rule/search"] == "**4.00×**"
    for ev in starts.values():  # a plan that fits only with ZeRO: no start fits
        ev["fits"] = False
    got = dict(
        zip(_columns(HEADER), _columns(cell_row(Cell("m", "dgx-h100", 8), doc)), strict=True)
    )
    assert got["rule/search"] == "no rule fits" and got["walk"] == "no start fits"
