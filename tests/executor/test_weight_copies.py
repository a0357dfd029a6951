"""Weight-only ops computed by every holder of their weight (``ParallelConfig.copies``)
train on N MPI ranks exactly like one device (float64, 1e-10), and send the bytes the
simulator counts: a dynamo-exported LSTM (its weights fed through Slice x 4 -> Concat)
and a hand-built weight chain data-parallel, and a mixed plan of the chain whose
weight-only ops are split and copied at once, with a reader that takes its piece from
another device's copy (the box's owner) and a copy no reader reads."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from onnx2soap.importer import load_model
from onnx2soap.importer.prepare import file_sha256
from onnx2soap.ir import DType, Graph
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.presets import cpu
from onnx2soap.soap import Partitioner, analyze
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.partition import ParallelConfig
from onnx2soap.soap.plan import Plan, load_plan, plan_ops, save_plan
from onnx2soap.soap.strategy import Strategy
from onnx2soap.soap.zero import ZeroStage
from tests.executor.mpi import assert_same_training, make_plan, mpirun, reference
from tests.optional import require
from tests.sim.test_memory_measured import TOLERANCE, predicted
from tests.weight_only_models import CHAIN, weight_chain_model

pytestmark = pytest.mark.mpi
STEPS, LR, BATCH = 2, 0.05, 6
ARGS = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory) -> Path:
    return weight_chain_model(tmp_path_factory.mktemp("chain") / "chain.onnx")


@pytest.fixture(scope="module")
def lstm_model(tmp_path_factory) -> Path:
    require("torch")
    from tests.sequence_models import export_sequence

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_sequence("lstm_lm", tmp_path_factory.mktemp("lstm"), "dynamo", dropout=0.0)


def predicted_bytes(plan: Path, model: Path) -> int:
    """What the simulator says a step sends (float64), a pipeline's every microbatch."""
    loaded = load_plan(plan)
    graph = load_model(model, loaded.graph_batch).graph
    strategy = loaded.strategy(graph, analyze(graph))
    simulator = Simulator(
        cpu(strategy.devices), RooflineCost(), itemsize=8, pipeline=loaded.pipeline
    )
    return simulator.evaluate(Partitioner(graph).partition(strategy)).bytes_moved


def trains_like_one_device(model: Path, plan: Path, ranks: int, batch: int, tmp: Path) -> None:
    one = tmp / "one.json"
    make_plan(model, one, 1, batch, "data-parallel")
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    run = mpirun(plan, ranks, tmp, *ARGS)
    assert_same_training(run, losses, weights, rtol=1e-10)
    assert sum(run.bytes_sent) == STEPS * predicted_bytes(plan, model)


def test_dynamo_lstm_data_parallel_on_2_ranks(lstm_model: Path, tmp_path: Path) -> None:
    plan = tmp_path / "dp.json"
    make_plan(lstm_model, plan, 2, 4, "data-parallel")
    graph = load_model(lstm_model, 4).graph
    copied = {o.name for o in load_plan(plan).ops if o.copies == 2}
    assert copied == weight_only_ops(graph)
    assert sum(op.type in ("Slice", "Concat") for op in graph.ops if op.name in copied) >= 16
    trains_like_one_device(lstm_model, plan, 2, 4, tmp_path)


def test_dynamo_lstm_pipeline_rule_on_4_ranks(lstm_model: Path, tmp_path: Path) -> None:
    """The pipeline rule's stages copy each stage's weight-only ops over the stage's
    devices; microbatches accumulate every copy's gradients before the rings."""
    plan = tmp_path / "pipeline.json"
    make_plan(lstm_model, plan, 4, 8, "pipeline")
    loaded = load_plan(plan)
    assert loaded.pipeline is not None and len(loaded.pipeline.stages) == 2
    copied = [o for o in loaded.ops if o.copies > 1]
    assert copied and all(o.copies == 2 and o.devices in ((0, 1), (2, 3)) for o in copied)
    trains_like_one_device(lstm_model, plan, 4, 8, tmp_path)


def test_weight_chain_data_parallel_on_3_ranks(chain_model: Path, tmp_path: Path) -> None:
    plan = tmp_path / "dp.json"
    make_plan(chain_model, plan, 3, BATCH, "data-parallel")
    assert {o.name for o in load_plan(plan).ops if o.copies == 3} == set(CHAIN)
    trains_like_one_device(chain_model, plan, 3, BATCH, tmp_path)
    # only the weights' all-reduce moves: a ring over 3 of W [3, 8] and W2 [6, 5]
    assert predicted_bytes(plan, chain_model) == 3 * 2 * 2 * (54 // 3) * 8


def test_weight_chain_under_zero3_on_3_ranks(chain_model: Path, tmp_path: Path) -> None:
    """ZeRO-3 shards the chain's weight over its copies' replica group and gathers it
    for each copy, forward and backward."""
    plan = tmp_path / "zero3.json"
    make_plan(chain_model, plan, 3, BATCH, "data-parallel")
    save_plan(replace(load_plan(plan), zero_stage=ZeroStage.PARAMETERS), plan)
    one = tmp_path / "one.json"
    make_plan(chain_model, one, 1, BATCH, "data-parallel")
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    run = mpirun(plan, 3, tmp_path, *ARGS)
    assert_same_training(run, losses, weights, rtol=1e-10)
    graph = load_model(chain_model, BATCH).graph
    strategy = load_plan(plan).strategy(graph, analyze(graph))
    simulator = Simulator(cpu(3), RooflineCost(), itemsize=8, zero=ZeroStage.PARAMETERS)
    predicted_moved = simulator.evaluate(Partitioner(graph).partition(strategy)).bytes_moved
    assert sum(run.bytes_sent) == STEPS * predicted_moved


def mixed(graph: Graph) -> Strategy:
    """The chain split and copied at once on 3 ranks, its readers data-parallel:
    reshape's copy on device 1 (its owner) is read by nobody (top and bottom read the
    copies on their own devices); concat's copies on devices 1 and 0 leave device 2's
    matmul to read both boxes from their owners; top is split in 2 and each half copied
    twice; bottom runs once, on device 2."""
    space = analyze(graph)
    configs = dict(data_parallel(graph, space, 3).configs)
    configs["reshape"] = ParallelConfig((1, 1), (1, 2, 0), 3)
    configs["top"] = ParallelConfig((1, 2), (0, 2, 2, 0), 2)
    configs["bottom"] = ParallelConfig((1, 1), (2,))
    configs["concat"] = ParallelConfig((2, 1), (1, 0, 0, 1), 2)
    return Strategy(3, configs)


def test_weight_chain_split_and_copied_on_3_ranks(chain_model: Path, tmp_path: Path) -> None:
    graph = load_model(chain_model, BATCH).graph
    strategy = mixed(graph)
    plan = tmp_path / "mixed.json"
    ops = plan_ops(strategy, graph, analyze(graph))
    save_plan(Plan(chain_model, file_sha256(chain_model), BATCH, graph.loss, 3, ops), plan)
    assert load_plan(plan).strategy(graph, analyze(graph)) == strategy
    # the pieces that cross devices: matmul on 2 reads both concat boxes from owners,
    # concat's copy on 1 reads top's halves from their owners (on 0 and 2) and bottom
    pg = Partitioner(graph).partition(strategy)
    crossing = sorted(
        (e.producer, p.device, c.device) for e, _, p, c in pg.moves() if p.device != c.device
    )
    assert ("concat", 1, 2) in crossing and ("concat", 0, 2) in crossing
    assert all(e != "reshape" for e, _, _ in crossing)
    trains_like_one_device(chain_model, plan, 3, BATCH, tmp_path)


def test_lstm_copies_peak_memory_within_ten_percent_of_measured(
    lstm_model: Path, tmp_path: Path
) -> None:
    """Each rank holds its copies of the LSTM's concatenated weights (and their
    gradients) as the memory model prices them (measured 0.9 % under it)."""
    plan = tmp_path / "dp.json"
    make_plan(lstm_model, plan, 2, 8, "data-parallel")
    trace = tmp_path / "measured.json"
    run = mpirun(plan, 2, tmp_path, "--steps", "3", "--trace", str(trace))
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(trace.read_text())["otherData"]["peak_memory_bytes"]
    for rank, (p, m) in enumerate(zip(predicted(plan), measured, strict=True)):
        assert abs(p - m) <= TOLERANCE * m, f"rank {rank}: predicted {p}, measured {m}"


@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory) -> Path:
    require("torch")
    require("transformers")
    from tests.sequence_models import export_sequence

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_sequence("gpt2", tmp_path_factory.mktemp("gpt2"), "dynamo", dropout=0.0)


def test_megatron_splits_and_copies_the_tied_weight_on_4_ranks(
    gpt2_model: Path, tmp_path: Path
) -> None:
    """Megatron-LM's rule on GPT-2 (tensor parallel 2 by 2 data parallel): the tied
    weight's Identity is cut by rows as the LM head reads it and each half copied on
    the two devices whose head reads it; the token embedding's weight-only op whole on
    every device."""
    plan = tmp_path / "megatron.json"
    make_plan(gpt2_model, plan, 4, 4, "megatron")
    copied = {o.name: o for o in load_plan(plan).ops if o.copies > 1}
    shared = next(o for name, o in copied.items() if name.endswith(":shared"))
    assert (shared.degrees, shared.devices, shared.copies) == ((("n", 2),), (0, 2, 1, 3), 2)
    trains_like_one_device(gpt2_model, plan, 4, 4, tmp_path)
