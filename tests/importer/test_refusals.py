"""What the CLI says about models it cannot read: exit code 2, one line, no traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnx2soap.ops import registry
from tests.importer.helpers import CliResult, run_cli

REPO = Path(__file__).resolve().parents[2]
UNSUPPORTED = [  # name, op type of every node of unsupported_onnx that must be refused
    ("/Sign", "Sign"),
    ("/Atan", "Atan"),
    ("/TopK", "TopK"),
]


def run_process(args: list[str | Path]) -> CliResult:
    """``python -m onnx2soap ARGS`` in a fresh process: what a user's terminal shows."""
    env = {**os.environ, "PYTHONWARNINGS": "default"}  # a stray warning would be a 2nd line
    proc = subprocess.run(
        [sys.executable, "-m", "onnx2soap", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
        check=False,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def assert_one_line_refusal(result: CliResult) -> str:
    """Exit 2, nothing on stdout, one ``onnx2soap: error:`` line on stderr; returns it."""
    assert result.code == 2, result
    assert result.stdout == ""
    assert len(result.stderr_lines) == 1, result.stderr
    line = result.stderr_lines[0]
    assert line.startswith("onnx2soap: error: ")
    assert "Traceback" not in result.stderr
    return line


# --- unsupported ops ------------------------------------------------------------------------


def test_unsupported_ops_are_all_listed_in_one_line(unsupported_onnx: Path) -> None:
    exported = {(n.name, n.op_type) for n in onnx.load(unsupported_onnx).graph.node}
    assert set(UNSUPPORTED) <= exported
    line = assert_one_line_refusal(run_process(["inspect", unsupported_onnx, "--batch", 4]))
    assert "3 unsupported nodes" in line
    for name, op_type in UNSUPPORTED:
        assert f"'{name}' ({op_type}, domain ai.onnx, opset 17)" in line
    supported = line.split("supported ops: ", 1)[1]
    assert supported.split(", ") == sorted(d.name for d in registry().onnx_ops())


def test_supported_ops_are_not_listed_as_unsupported(unsupported_onnx: Path) -> None:
    line = assert_one_line_refusal(run_cli(["inspect", unsupported_onnx, "--batch", 4]))
    refused = line.split("; supported ops:", 1)[0]
    for name in ("/conv/Conv", "/flatten/Flatten", "/fc/Gemm"):
        assert name not in refused


def _custom_domain_model(path: Path) -> Path:
    """x -> Relu -> my.ops::Foo (domain opset 2) -> Atan -> Gemm, at ai.onnx opset 17."""
    weight = numpy_helper.from_array(np.ones((4, 3), np.float32), "W")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Foo", ["r"], ["f"], name="foo", domain="my.ops"),
        helper.make_node("Atan", ["f"], ["s"], name="atan"),
        helper.make_node("Gemm", ["s", "W"], ["y"], name="gemm"),
    ]
    graph = helper.make_graph(
        nodes,
        "custom",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 3])],
        [weight],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("my.ops", 2)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), path)
    return path


def test_a_custom_domain_node_is_listed_with_its_domain_and_opset(tmp_path: Path) -> None:
    path = _custom_domain_model(tmp_path / "custom.onnx")
    line = assert_one_line_refusal(run_cli(["inspect", path, "--batch", 4]))
    assert "2 unsupported nodes" in line
    assert "'atan' (Atan, domain ai.onnx, opset 17)" in line
    # The opset that defines Foo is my.ops version 2, not the ai.onnx opset.
    assert "'foo' (Foo, domain my.ops, opset 2)" in line


def test_unsupported_op_refusal_through_plan(unsupported_onnx: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    args = ["plan", unsupported_onnx, "--batch", 4, "--devices", 2, "-o", plan]
    line = assert_one_line_refusal(run_cli(args))
    assert "/TopK" in line
    assert not plan.exists()


# --- files that are not (readable) ONNX models -----------------------------------------------


def _random_bytes(path: Path, example: Path) -> None:
    del example
    path.write_bytes(os.urandom(4096))


def _text(path: Path, example: Path) -> None:
    del example
    path.write_text("name,size\nconv1,448\nthis is a CSV file, not an ONNX model\n")


def _truncated(path: Path, example: Path) -> None:
    data = example.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _empty(path: Path, example: Path) -> None:
    del example
    path.write_bytes(b"")


NOT_ONNX = {"random": _random_bytes, "text": _text, "truncated": _truncated, "empty": _empty}


@pytest.mark.parametrize("kind", sorted(NOT_ONNX))
def test_a_file_that_is_not_onnx_is_one_line(kind: str, tmp_path: Path, example_onnx) -> None:
    path = tmp_path / f"{kind}.onnx"
    NOT_ONNX[kind](path, example_onnx)
    line = assert_one_line_refusal(run_cli(["inspect", path, "--batch", 8]))
    assert str(path) in line and "not a valid ONNX model" in line


def test_garbage_in_a_fresh_process(tmp_path: Path) -> None:
    path = tmp_path / "garbage.onnx"
    path.write_bytes(os.urandom(4096))
    line = assert_one_line_refusal(run_process(["inspect", path, "--batch", 8]))
    assert str(path) in line


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.onnx"
    line = assert_one_line_refusal(run_cli(["inspect", path, "--batch", 8]))
    assert str(path) in line and "no such model file" in line


def test_a_directory_is_not_a_model(tmp_path: Path) -> None:
    line = assert_one_line_refusal(run_cli(["inspect", tmp_path, "--batch", 8]))
    assert str(tmp_path) in line


def test_an_old_opset_is_refused_with_the_minimum(old_opset_onnx: Path) -> None:
    line = assert_one_line_refusal(run_cli(["inspect", old_opset_onnx, "--batch", 8]))
    assert "opset 12" in line and "13" in line


# --- dynamo models whose weights file is gone -------------------------------------------------


@pytest.fixture
def dynamo_without_data(export_model, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the dynamo MLP export without the .data file its weights live in."""
    source = export_model("mlp", "dynamo")
    data = source.name + ".data"
    assert (source.parent / data).is_file()
    path = tmp_path / source.name
    shutil.copyfile(source, path)
    return path, data


def test_dynamo_model_with_its_data_file_deleted_is_one_clear_line(
    dynamo_without_data: tuple[Path, str],
) -> None:
    path, data = dynamo_without_data
    line = assert_one_line_refusal(run_process(["inspect", path, "--batch", 8]))
    assert data in line
    # The model itself is fine: the message must say the weights file is missing rather
    # than call the model invalid (prepare.read_model has that message for this case).
    assert "missing" in line
    assert "not a valid ONNX model" not in line
