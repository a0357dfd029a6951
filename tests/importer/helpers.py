"""Small helpers shared by the importer tests."""

from __future__ import annotations

import io
from collections.abc import Sequence
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass

from onnx2soap.ir import Graph, Op
from onnx2soap.soap import SoapDim, analyze


def ops_of(graph: Graph, op_type: str) -> list[Op]:
    return [op for op in graph.ops if op.type == op_type]


def dims_by_op(graph: Graph) -> dict[str, dict[str, SoapDim]]:
    """``{op name: {dim name: SoapDim}}`` for every op."""
    return {name: {d.name: d for d in dims} for name, dims in analyze(graph).items()}


def kinds(dims: dict[str, SoapDim]) -> dict[str, str]:
    return {name: d.kind.value for name, d in dims.items()}


def axes(dims: dict[str, SoapDim]) -> dict[str, int | None]:
    return {name: d.axis for name, d in dims.items()}


def splittable(dims: dict[str, SoapDim]) -> dict[str, bool]:
    return {name: d.splittable for name, d in dims.items()}


@dataclass(frozen=True)
class CliResult:
    code: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()


def run_cli(args: Sequence[str]) -> CliResult:
    """``onnx2soap ARGS`` in this process, with its exit code and both streams."""
    from onnx2soap.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return CliResult(code, out.getvalue(), err.getvalue())
