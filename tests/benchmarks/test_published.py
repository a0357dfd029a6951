"""``benchmarks/published.py`` plans a published row's configuration by rule and prices
it: on a tiny LLaMA shape (the torchtitan row at 64 tokens), the plan it writes is the
row's (ZeRO-3, torchtitan's per-op selective recomputation: some products recomputed,
not all; bf16, the row's batch on its machine), and the
throughput it prints is the row's tokens over ``simulate``'s step."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.published import TORCHTITAN, predicted
from onnx2soap.cli import main as cli
from onnx2soap.importer import load_model

TOKENS = 64


def test_the_published_configuration_is_what_is_priced(tmp_path: Path, capsys) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from benchmarks.llama_shape import export_llama_shape

    row = replace(TORCHTITAN, tokens=TOKENS)
    model = export_llama_shape(tmp_path / "model", "tiny", row.batch, TOKENS).model
    work = tmp_path / "work"
    work.mkdir()
    speed, memory = predicted(row, model, work)
    plan = json.loads((work / "plan.json").read_text())
    assert plan["zero_stage"] == 3 and plan["precision"] == "bf16" and plan["recompute"]
    recomputed = set(plan["recompute"])
    graph = load_model(model, row.batch).graph
    products = [op.name for op in graph.ops if op.type == "MatMul"]
    assert 0 < sum(name in recomputed for name in products) < len(products)  # per-op AC
    assert plan["model"]["batch"] == row.batch and plan["devices"] == row.gpus
    assert plan["machine"] == row.machine
    capsys.readouterr()
    argv = ["simulate", str(work / "plan.json"), "--optimizer", "adam", "--json"]
    assert cli([*argv, "--machine", row.machine]) == 0
    doc = json.loads(capsys.readouterr().out)
    step = doc["step_time_s"]
    assert speed == pytest.approx(row.batch * TOKENS / step / row.gpus)
    assert memory == pytest.approx(max(doc["peak_memory_bytes"]) / (1 << 30))
