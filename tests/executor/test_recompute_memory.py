"""Recomputation's memory against the executor: the simulator's peak per rank within 10 %
of the traced one (``executor run --trace``: tracemalloc per rank), and ``--recompute
all``'s checkpoints, on GPT-shaped decoders.

Plans come from ``plan --recompute all`` on ``cpu:2``: a checkpoint per transformer layer
(its output, and the first layer's input), the rest recomputed, under data parallelism
and 1F1B and GPipe pipelines of two stages of one rank and four microbatches (the executor
rematerializes a layer's inside at its first backward need and holds each tile until
the last backward that reads it; a held microbatch keeps its checkpoints; a slot of
buffers per microbatch open at once; the transport holds each sent piece until its send
completes); and from ``--recompute selective`` (the products kept, the ops between them made
again), data parallel and 1F1B.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpt_onnx import GptShape, write_gpt
from onnx2soap.cli import main as onnx2soap_main
from onnx2soap.importer import load_model
from onnx2soap.search.groups import find_groups
from onnx2soap.soap import analyze
from tests.executor.mpi import mpirun
from tests.sequence_models import export_sequence

TOLERANCE = 0.10
LAYERS = 2
SHAPE = GptShape(LAYERS, 64, 4, 256, 64)  # layers, width, heads, vocabulary, tokens
BATCH = 8
PIPELINE = ("--strategy", "pipeline", "--stages", "2", "--microbatches", "4")
CASES = {  # the rule, and what it recomputes
    "data parallel": ("--strategy", "data-parallel", "--recompute", "all"),
    "1f1b": (*PIPELINE, "--schedule", "1f1b", "--recompute", "all"),
    "gpipe": (*PIPELINE, "--schedule", "gpipe", "--recompute", "all"),
    "selective": ("--strategy", "data-parallel", "--recompute", "selective"),
    "selective 1f1b": (*PIPELINE, "--schedule", "1f1b", "--recompute", "selective"),
}


@pytest.fixture(scope="module")
def gpt(tmp_path_factory) -> Path:
    return write_gpt(tmp_path_factory.mktemp("gpt"), SHAPE)


def _plan(model: Path, plan: Path, rule: tuple[str, ...]) -> dict:
    argv = ["plan", str(model), "--batch", str(BATCH), "--machine", "cpu:2", *rule]
    assert onnx2soap_main([*argv, "--quiet", "-o", str(plan)]) == 0
    return json.loads(plan.read_text())


def test_recompute_all_keeps_each_layers_output(gpt, tmp_path: Path) -> None:
    """Every op but the loss is recomputed except, per layer (block instance), its last
    op, the residual sum it hands on, and the first layer's input."""
    doc = _plan(gpt, tmp_path / "plan.json", CASES["data parallel"])
    graph = load_model(gpt, BATCH).graph
    (block,) = find_groups(graph, analyze(graph)).blocks
    assert len(block.instances) == LAYERS
    names = [op.name for op in graph.ops]
    first = names.index(block.instances[0][0])
    kept = [n for n in names if n not in doc["recompute"] and n != graph.loss_op.name]
    assert kept == [names[first - 1], *(layer[-1] for layer in block.instances)]


def test_recompute_all_on_gpt2_tiny_keeps_one_checkpoint_per_layer(tmp_path: Path) -> None:
    """transformers' GPT-2 (tests/sequence_models.py: 2 layers, exported as
    benchmarks/fidelity.py does): the plan's ``recompute`` is every op but the loss, the
    embeddings' sum (the first layer's input) and each layer's output."""
    pytest.importorskip("transformers")
    model = export_sequence("gpt2", tmp_path, "dynamo")
    doc = _plan(model, tmp_path / "plan.json", CASES["data parallel"])
    graph = load_model(model, BATCH).graph
    (block,) = find_groups(graph, analyze(graph)).blocks
    assert len(block.instances) == 2
    names = [op.name for op in graph.ops]
    first = names.index(block.instances[0][0])
    kept = [n for n in names if n not in doc["recompute"] and n != graph.loss_op.name]
    assert kept == [names[first - 1], *(layer[-1] for layer in block.instances)]
    assert len(doc["recompute"]) == len(names) - len(kept) - 1


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(CASES))
def test_recomputing_plans_peak_within_ten_percent_of_measured(gpt, tmp_path, case) -> None:
    plan = tmp_path / "plan.json"
    predicted = _plan(gpt, plan, CASES[case])["predicted"]["peak_memory_bytes"]
    trace = tmp_path / "measured.json"
    run = mpirun(plan, 2, tmp_path, "--steps", "3", "--trace", str(trace))
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(trace.read_text())["otherData"]["peak_memory_bytes"]
    for rank, (p, m) in enumerate(zip(predicted, measured, strict=True)):
        assert abs(p - m) <= TOLERANCE * m, f"rank {rank}: predicted {p}, measured {m}"
