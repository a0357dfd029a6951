"""Recomputation (a plan's ``recompute``) changes what a rank holds, never what it trains.

Every op but the loss recomputed: one device trains bit for bit as without (BatchNorm's
statistics, Dropout's masks and tied weights included), N ranks under a real mpiexec on a
random plan as one device without recomputation, and the step holds less: tracemalloc's
peak of a step (numpy reports its buffers to it) is below the plain plan's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from executor.train import RunOptions, train
from onnx2soap.cli import main as onnx2soap_main
from onnx2soap.importer import load_model
from onnx2soap.ir import DType
from onnx2soap.search.pipeline_rule import full_recompute, selective_recompute
from onnx2soap.soap import load_plan
from tests.executor.mpi import assert_same_training, make_plan, mpirun, reference
from tests.optional import cupy_or_skip

STEPS, LR = 3, 0.05
BATCH = {"bnnet": 4, "tied": 4, "mlp": 512}


def with_recompute(plan: Path, out: Path, ops: list[str] | None = None) -> Path:
    """The plan with ``ops`` recomputed (every op but the loss when None)."""
    doc = json.loads(plan.read_text())
    names = [o["name"] for o in doc["ops"]]
    doc["recompute"] = names[:-1] if ops is None else ops  # the loss is the last op
    out.write_text(json.dumps(doc))
    return out


@pytest.fixture(scope="module")
def plans(export_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("recompute")

    def get(name: str, devices: int = 1, strategy: str = "data-parallel", seed: int = 0):
        plan = folder / f"{name}-{devices}-{strategy}-{seed}.json"
        if not plan.exists():
            make_plan(export_model(name), plan, devices, BATCH[name], strategy, seed)
        return plan, with_recompute(plan, plan.with_name(f"{plan.stem}-recompute.json"))

    return get


@pytest.mark.parametrize("name", ["bnnet", "tied"])
def test_one_device_trains_bit_for_bit_as_without(plans, name: str) -> None:
    plain, recomputed = plans(name)
    want_losses, want_weights = reference(plain, STEPS, DType.FLOAT64, LR)
    losses, weights = reference(recomputed, STEPS, DType.FLOAT64, LR)
    assert losses == want_losses
    assert set(weights) == set(want_weights)
    for w in weights:
        np.testing.assert_array_equal(weights[w], want_weights[w], err_msg=w)


@pytest.mark.mpi
@pytest.mark.parametrize(("name", "ranks", "seed"), [("bnnet", 3, 5), ("tied", 2, 11)])
def test_ranks_train_like_one_device(plans, tmp_path: Path, name: str, ranks: int, seed: int):
    """A random plan (tiles sent, assembled and aliased, several tasks of an op on a
    rank) with recomputation, against one device without."""
    plain, _ = plans(name)
    losses, weights = reference(plain, STEPS, DType.FLOAT64, LR)
    _, recomputed = plans(name, ranks, "random", seed)
    run = mpirun(
        recomputed, ranks, tmp_path, "--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64"
    )
    assert_same_training(run, losses, weights, rtol=1e-10)


@pytest.mark.mpi
def test_checkpointed_ranks_train_like_one_device(plans, tmp_path: Path) -> None:
    """``--recompute all``'s list (``pipeline_rule.full_recompute``: checkpoints kept,
    the segments between them made again at their first backward need) on a random
    plan of 3 ranks, against one device without recomputation."""
    plain, _ = plans("bnnet")
    losses, weights = reference(plain, STEPS, DType.FLOAT64, LR)
    random, _ = plans("bnnet", 3, "random", 5)
    graph = load_model(load_plan(random).model_path, BATCH["bnnet"]).graph
    names = list(full_recompute(graph))
    assert 0 < len(names) < len(graph.ops) - 1  # some kept besides the loss
    checkpointed = with_recompute(random, tmp_path / "checkpointed.json", names)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")
    run = mpirun(checkpointed, 3, tmp_path, *args)
    assert_same_training(run, losses, weights, rtol=1e-10)


@pytest.mark.mpi
def test_selective_ranks_train_like_one_device(plans, tmp_path: Path) -> None:
    """``--recompute selective``'s list (``pipeline_rule.selective_recompute``: the
    products kept, BatchNorm, Relu and the rest made again) on a random plan of 3 ranks,
    against one device without recomputation."""
    plain, _ = plans("bnnet")
    losses, weights = reference(plain, STEPS, DType.FLOAT64, LR)
    random, _ = plans("bnnet", 3, "random", 5)
    graph = load_model(load_plan(random).model_path, BATCH["bnnet"]).graph
    names = list(selective_recompute(graph))
    assert names and not any(graph.ops[i].type in ("Conv", "Gemm") for i in _indices(graph, names))
    selective = with_recompute(random, tmp_path / "selective.json", names)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")
    run = mpirun(selective, 3, tmp_path, *args)
    assert_same_training(run, losses, weights, rtol=1e-10)


def _indices(graph, names) -> list[int]:
    return [i for i, op in enumerate(graph.ops) if op.name in set(names)]


def _step_peak(plan: Path, trace: Path) -> int:
    """The executor's measured peak of a steady step of ``plan`` on one device
    (``--trace``: tracemalloc, which numpy reports its buffers to)."""
    train(MPI.COMM_SELF, RunOptions(plan=plan, steps=3, lr=LR, dtype=DType.FLOAT64, trace=trace))
    return json.loads(trace.read_text())["otherData"]["peak_memory_bytes"][0]


def test_recomputing_the_cheap_ops_holds_less(plans, tmp_path: Path) -> None:
    """The MLP at batch 512: its activations (512 x 64 hidden units, float64: 262 KB a
    tile) are most of what a step makes. A plain step keeps, from forward to backward,
    the tiles its backwards read (each Relu's input, each Gemm's): four hidden tiles.
    Recomputing the Relus (as selective recomputation does: keep the products, make the
    cheap ops again) keeps their outputs no longer: two tiles fewer at the backward's
    start, one made again at a time (1.77 MB measured plain, 1.51 recomputed). Every op
    recomputed, with no checkpoint, makes the whole chain again for the loss's backward
    and holds it, and every Gemm's input buffer, to each op's own: no less than plain."""
    plain, _ = plans("mlp")
    relus = with_recompute(plain, tmp_path / "relus.json", ["/relu1/Relu", "/relu2/Relu"])
    held = _step_peak(plain, tmp_path / "plain.json")
    assert _step_peak(relus, tmp_path / "recomputed.json") < 0.9 * held


@pytest.mark.gpu
@pytest.mark.mpi
def test_ranks_sharing_a_gpu_recompute_like_one_device(plans, tmp_path: Path, monkeypatch):
    """``--device cuda``: the recomputed tiles made again on the GPU, two ranks sharing
    it over host-staged transfers, as one device without recomputation."""
    cupy_or_skip()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    plain, _ = plans("bnnet")
    losses, weights = reference(plain, STEPS, DType.FLOAT64, LR)
    _, recomputed = plans("bnnet", 2, "random", 5)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--device", "cuda")
    run = mpirun(recomputed, 2, tmp_path, *args, "--transport", "mpi-host")
    assert_same_training(run, losses, weights, rtol=1e-10)


def _plan_cli(model: Path, out: Path, devices: int, *extra: str) -> Path:
    args = ["plan", str(model), "--devices", str(devices), "--batch", str(BATCH["bnnet"])]
    assert onnx2soap_main([*args, *extra, "--quiet", "-o", str(out)]) == 0
    return out


@pytest.mark.mpi
def test_a_recomputing_pipeline_trains_like_one_device(export_model, tmp_path: Path) -> None:
    """``plan --strategy pipeline --recompute all``: 2 stages of 2 data-parallel ranks,
    1F1B over 2 microbatches, each microbatch's tiles made again in its backward, as one
    device running the same microbatches (BatchNorm's statistics are a microbatch's)."""
    model = export_model("bnnet")
    piped = ("--strategy", "pipeline", "--microbatches", "2")
    one = _plan_cli(model, tmp_path / "one.json", 1, *piped, "--stages", "1")
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    plan = _plan_cli(model, tmp_path / "p.json", 4, *piped, "--stages", "2", "--recompute", "all")
    assert json.loads(plan.read_text())["recompute"]
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")
    assert_same_training(mpirun(plan, 4, tmp_path, *args), losses, weights, rtol=1e-10)
