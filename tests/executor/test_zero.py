"""ZeRO-1, ZeRO-2 and ZeRO-3 plans (``plan --strategy zero``) train exactly like one
device. ZeRO-3 (each rank holding its rows of every replicated weight, gathering the
whole Rect for each op's forward and backward) too: SGD, Adam and Nesterov, on the
random plan, in bf16, with --save-weights (each member writes its rows; .npz, and
safetensors from a random plan) and a
checkpoint it writes resumed under plain data parallelism; it moves an all-gather
more than an all-reduce.

The example CNN, data parallel over 3 ranks (its weights' rows do not divide by 3, so
the shards are uneven), under a real mpiexec, float64: every optimizer (at both stages
with GPT-2's runs, tests/sequences/test_zero.py, and a resumed one) gives the one-device
losses and weights within 1e-10, moving what data parallelism moves, and so does ZeRO-2
on a random plan that replicates some weights among its splits; a ZeRO checkpoint
resumes under a plain data-parallel plan and a plain one under ZeRO, re-sharding the
optimizer's state, and both continue as the uninterrupted one-device run; bf16 with
ZeRO-2 and fp16 (loss scaling) with ZeRO-1 train like one device in the same precision
(within a half-format ulp, as tests/executor/test_precision.py); --save-weights and
--save-model write the trained weights. All runs share one mpiexec (``jobs_driver.py``).
The same on GPUs over NCCL and host-staged rings (the stand-in under ``-m gpu``). A
stage on a plan that replicates nothing is refused, naming the field (a stage other
than 1 or 2: tests/soap/test_zero.py, tests/cli/test_zero.py).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from mpi4py import MPI
from onnx import numpy_helper
from safetensors.numpy import load_file as load_safetensors

from executor.checkpoint import read_manifest
from executor.train import train
from onnx2soap.errors import UserError
from onnx2soap.importer import file_sha256, load_model
from onnx2soap.precision import Precision
from onnx2soap.search.baselines import data_parallel, random_strategy
from onnx2soap.sim import RooflineCost, make_simulator
from onnx2soap.sim.presets import cpu
from onnx2soap.soap import Partitioner, Plan, analyze, load_plan, plan_ops, save_plan
from onnx2soap.soap.zero import ZeroStage, zero_group
from tests.executor.jobs_driver import Job, options, read_result, run_jobs
from tests.executor.mpi import MPIEXEC
from tests.executor.optimizer_configs import OPTIMIZERS
from tests.optional import cupy_or_skip

pytestmark = pytest.mark.mpi
RANKS, BATCH = 3, 6
# A weight whose gradient is zero in exact arithmetic (GPT's key bias: softmax ignores a
# constant added to every score of a query) gets rounding noise of about 1e-17, which
# no two summation orders agree on; Adam turns it into steps of lr * noise / eps, about
# 5e-11 at lr 0.05 and eps 1e-8 (plain data parallelism the same).
ADAM_NOISE = 1e-9


def zero_plan(model: Path, plan: Path, ranks: int, batch: int, stage: int) -> Path:
    """Data parallelism over ``ranks`` with ZeRO ``stage`` (0: none), written as
    ``plan --strategy zero`` writes it (tests/cli/test_zero.py) without pricing every
    baseline (the ILP's solve included) for it."""
    graph = load_model(model, batch).graph
    space = analyze(graph)
    ops = plan_ops(data_parallel(graph, space, ranks), graph, space)
    doc = Plan(model, file_sha256(model), batch, graph.loss, ranks, ops)
    save_plan(replace(doc, zero_stage=ZeroStage(stage)), plan)
    return plan


def one_device(job: Job):
    """The job's training on one device (``job.plan`` a one-device plan), in this
    process; once per training (output, checkpoint and resume aside)."""
    return _one_device(
        replace(job, out="", checkpoint=None, resume=None, save_weights=None, save_model=None)
    )


@functools.cache
def _one_device(job: Job):
    result = train(MPI.COMM_SELF, options(job), gather=True)
    return np.array([r.loss for r in result.steps]), result.weights


def assert_like(out: Path, losses, weights, rtol: float, atol: float | None = None) -> None:
    """Losses within ``rtol``; weights within ``atol``, else within ``rtol`` of their
    size (as tests/executor/mpi.py's ``assert_same_training``), never below ``ADAM_NOISE``
    for a run with Adam (``Job.out`` names the optimizer)."""
    result = read_result(out)
    got_losses, got = result.losses, result.weights
    np.testing.assert_allclose(got_losses, losses, rtol=rtol, atol=0, err_msg=out.name)
    assert set(got) == set(weights)
    noise = ADAM_NOISE if "adam" in out.name else 0.0
    for name, w in weights.items():
        tol = rtol * max(float(np.abs(w).max()), 1.0) if atol is None else atol
        np.testing.assert_allclose(
            got[name], w, rtol=0 if atol else rtol, atol=max(tol, noise), err_msg=name
        )


@pytest.fixture(scope="module")
def plans(tmp_path_factory, example_onnx: Path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("zero")
    model = folder / "cnn.onnx"
    shutil.copy(example_onnx, model)
    out = {"model": model, "folder": folder}
    zero_plan(model, folder / "one.json", 1, BATCH, 0)
    zero_plan(model, folder / "dp.json", RANKS, BATCH, 0)
    for stage in (1, 2, 3):
        out[f"zero{stage}"] = zero_plan(model, folder / f"zero{stage}.json", RANKS, BATCH, stage)
    out |= {name: folder / f"{name}.json" for name in ("one", "dp")}
    out["random"] = _random_zero_plan(model, folder / "random.json")
    out["random3"] = _random_zero_plan(model, folder / "random3.json", stage=ZeroStage.PARAMETERS)
    out["mixed"] = _mixed(out["zero2"], folder / "mixed.json")
    out["random-mixed"] = _mixed(out["random"], folder / "random-mixed.json")
    # ZeRO-3 recomputing every op but the loss: a recomputed op keeps its gathered
    # weights, its forward run again from them
    doc = json.loads(out["zero3"].read_text())
    graph = load_model(model, BATCH).graph
    doc["recompute"] = [op.name for op in graph.ops if not op.is_loss]
    out["zero3redo"] = folder / "zero3redo.json"
    out["zero3redo"].write_text(json.dumps(doc))
    return out


def _random_zero_plan(
    model: Path, path: Path, seed: int = 3, stage: ZeroStage = ZeroStage.GRADIENTS
) -> Path:
    """ZeRO-2 on a random plan (mixed degrees, several tasks of an op on a device, tiles
    and gradient pieces crossing ranks between the reduce-scatters) that replicates some
    weights, as its ops happen to be split."""
    graph = load_model(model, BATCH).graph
    space = analyze(graph)
    strategy = random_strategy(graph, space, RANKS, np.random.default_rng(seed))
    ops = plan_ops(strategy, graph, space)
    doc = Plan(model, file_sha256(model), BATCH, graph.loss, RANKS, ops)
    save_plan(replace(doc, zero_stage=stage), path)
    return path


def _mixed(plan: Path, path: Path) -> Path:
    """``plan`` with its weights at stages 2, 3, none and 1 in turn by name
    (``zero_stages``; the CNN's kernels at 3 and 1, its biases at 2 and none): FSDP
    wrapping some layers, DDP others."""
    doc = load_plan(plan)
    graph = load_model(doc.model_path, doc.batch).graph
    names = sorted(t.name for t in graph.weights)
    stages = (ZeroStage.GRADIENTS, ZeroStage.PARAMETERS, ZeroStage.NONE, ZeroStage.OPTIMIZER)
    weights = tuple((name, stages[i % 4]) for i, name in enumerate(names))
    save_plan(replace(doc, zero_weights=weights), path)
    return path


# Every optimizer at stage 2 and three at stage 1; momentum at stage 1 on GPT-2
# (tests/sequences/test_zero.py) and Adam in a ZeRO-1 run resumed from a checkpoint.
STAGES = {name: (2, 1) if name in ("sgd", "nesterov", "adamw") else (2,) for name in OPTIMIZERS}
for name in ("sgd", "adam", "nesterov"):  # ZeRO-3
    STAGES[name] += (3,)


@pytest.fixture(scope="module")
def trained(plans) -> dict[str, tuple[Job, Path]]:
    """Every job run once on 3 ranks: (the job, its result file), by name."""
    folder = plans["folder"]
    jobs: dict[str, Job] = {}
    for name, stages in STAGES.items():
        for stage in stages:
            plan = str(plans[f"zero{stage}"])
            jobs[f"zero{stage}-{name}"] = Job(plan, str(folder / f"z{stage}-{name}.npz"), name)
    jobs["random-adam"] = Job(str(plans["random"]), str(folder / "random-adam.npz"), "adam")
    jobs["random3-adam"] = Job(str(plans["random3"]), str(folder / "random3-adam.npz"), "adam")
    jobs["zero3redo-adam"] = Job(str(plans["zero3redo"]), str(folder / "z3redo-adam.npz"), "adam")
    for name in ("mixed", "random-mixed"):
        jobs[f"{name}-adam"] = Job(str(plans[name]), str(folder / f"{name}-adam.npz"), "adam")
    # The weights written by each shard's owner (every member holds them whole; at
    # ZeRO-3 each member writes its rows).
    adam, sgd, adam3 = jobs["zero2-adam"], jobs["zero1-sgd"], jobs["zero3-adam"]
    jobs["zero2-adam"] = replace(adam, save_weights=str(folder / "z2-adam-weights.npz"))
    jobs["zero3-adam"] = replace(adam3, save_weights=str(folder / "z3-adam-weights.npz"))
    # a random plan's shards, ZeRO-3's rows among them, written in place as safetensors
    random3 = jobs["random3-adam"]
    jobs["random3-adam"] = replace(random3, save_weights=str(folder / "r3.safetensors"))
    jobs["zero1-sgd"] = replace(sgd, save_model=str(folder / "z1-sgd-model.onnx"))
    # Checkpoints across plans: two Adam steps under one, the third under the other.
    for first, then in (("zero2", "dp"), ("dp", "zero1"), ("zero3", "dp"), ("dp", "zero3")):
        ckpt = str(folder / f"ckpt-{first}")
        jobs[f"{first}-saves"] = Job(
            str(plans[first]), str(folder / f"{first}-saves.npz"), "adam", 2, checkpoint=ckpt
        )
        jobs[f"{then}-resumes-{first}"] = Job(
            str(plans[then]), str(folder / f"{then}-resumes-{first}.npz"), "adam", 3, resume=ckpt
        )
    for stage, precision in ((2, "bf16"), (1, "fp16"), (3, "bf16"), ("mixed", "bf16")):
        plan = str(plans[stage if stage == "mixed" else f"zero{stage}"])
        out = str(folder / f"z{stage}-{precision}.npz")
        # Momentum: Adam's normalized steps turn a half-format ulp of difference in a
        # gradient (summed in another order over ranks, ZeRO or not) into a step of lr.
        jobs[f"zero{stage}-{precision}"] = Job(
            plan, out, "momentum", dtype="float32", precision=precision
        )
    run_jobs(list(jobs.values()), RANKS, folder)
    return {name: (job, Path(job.out)) for name, job in jobs.items()}


@pytest.mark.parametrize(
    ("optimizer", "stage"), [(name, stage) for name, stages in STAGES.items() for stage in stages]
)
def test_zero_trains_like_one_device(plans, trained, stage: int, optimizer: str) -> None:
    job, out = trained[f"zero{stage}-{optimizer}"]
    losses, weights = one_device(replace(job, plan=str(plans["one"])))
    assert_like(out, losses, weights, rtol=1e-10)


def test_zero3_recomputing_trains_like_one_device(plans, trained) -> None:
    job, out = trained["zero3redo-adam"]
    losses, weights = one_device(replace(job, plan=str(plans["one"])))
    assert_like(out, losses, weights, rtol=1e-10)


@pytest.mark.parametrize("name", ["random", "random3", "mixed", "random-mixed"])
def test_zero_on_a_random_plan_trains_like_one_device(plans, trained, name: str) -> None:
    """A random plan under one stage, and plans with a stage per weight (every stage
    on some weight, the data-parallel plan's and the random one's)."""
    loaded = load_plan(plans[name])
    graph = load_model(plans["model"], BATCH).graph
    pg = Partitioner(graph).partition(loaded.strategy(graph, analyze(graph)))
    sharded = [g for gs in pg.groups.values() for g in gs if zero_group(g, loaded.zero)]
    assert sharded and len(sharded) < sum(len(gs) for gs in pg.groups.values())
    replicated = {g.weight for gs in pg.groups.values() for g in gs if len(g.devices) > 1}
    stages = {loaded.zero.weight(w) for w in replicated}
    if name == "mixed":
        assert stages == set(ZeroStage)
    elif name == "random-mixed":
        assert ZeroStage.PARAMETERS in stages and len(stages) > 2
    job, out = trained[f"{name}-adam"]
    losses, weights = one_device(replace(job, plan=str(plans["one"])))
    assert_like(out, losses, weights, rtol=1e-10)


@pytest.mark.parametrize(
    ("first", "then"), [("zero2", "dp"), ("dp", "zero1"), ("zero3", "dp"), ("dp", "zero3")]
)
def test_a_checkpoint_resumes_under_the_other_plan(plans, trained, first: str, then: str):
    """Adam's moments re-sharded: the third step continues the one-device run."""
    job, out = trained[f"{then}-resumes-{first}"]
    losses, weights = one_device(replace(job, plan=str(plans["one"]), resume=None))
    assert_like(out, losses[2:], weights, rtol=1e-10)
    entries = read_manifest(Path(trained[f"{first}-saves"][0].checkpoint))[0].entries
    moments = [e for e in entries if e.kind == "exp_avg"]
    values = [e for e in entries if e.kind == "value"]
    # ZeRO's state is written per shard, each by its owner: more entries than weights;
    # ZeRO-3's values too, each member its rows
    assert (len(moments) > len(values)) == (first == "zero2"), (len(moments), len(values))
    per_shard = len({e.tensor for e in values}) < len(values)
    assert per_shard == (first == "zero3")


@pytest.mark.parametrize(
    ("stage", "precision"), [(2, "bf16"), (1, "fp16"), (3, "bf16"), ("mixed", "bf16")]
)
def test_mixed_precision_with_zero_trains_like_one_device(plans, trained, stage, precision):
    """Each stage, and a stage per weight (every stage on some weight), in half
    precision."""
    job, out = trained[f"zero{stage}-{precision}"]
    losses, weights = one_device(replace(job, plan=str(plans["one"])))
    assert_like(out, losses, weights, rtol=2e-3, atol=2e-3)


def test_saved_weights_and_model_are_the_trained_ones(trained) -> None:
    """--save-weights and --save-model of ZeRO runs: the gathered weights, bit for bit
    (the model in its float32 initializers)."""
    for run in ("zero2-adam", "zero3-adam"):
        job, out = trained[run]
        gathered = read_result(out).weights
        with np.load(job.save_weights) as saved:
            assert set(saved.files) == set(gathered)
            for name, w in gathered.items():
                np.testing.assert_array_equal(saved[name], w, err_msg=f"{run} {name}")
    job, out = trained["random3-adam"]
    gathered, saved = read_result(out).weights, load_safetensors(job.save_weights)
    assert set(saved) == set(gathered)
    for name, w in gathered.items():
        np.testing.assert_array_equal(saved[name], w, err_msg=f"random3 {name}")
    job, out = trained["zero1-sgd"]
    gathered = read_result(out).weights
    model = onnx.load(job.save_model)
    initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for name, w in gathered.items():
        np.testing.assert_array_equal(initializers[name], w.astype(np.float32), err_msg=name)


def _simulated_bytes(plan: Path, precision: Precision = Precision.FP32) -> int:
    loaded = load_plan(plan)
    graph = load_model(loaded.model_path, loaded.batch).graph
    pg = Partitioner(graph).partition(loaded.strategy(graph, analyze(graph)))
    machine = cpu(loaded.devices)
    simulator = make_simulator(machine, RooflineCost(), precision=precision, zero=loaded.zero)
    return simulator.evaluate(pg).bytes_moved


def test_zero_moves_the_all_reduces_bytes(plans, trained) -> None:
    """A reduce-scatter and an all-gather per sharded group move what one all-reduce
    moves (the same two Adam steps, data parallel and ZeRO-2)."""
    sent = {name: read_result(trained[f"{name}-saves"][1]).sent for name in ("dp", "zero2")}
    assert sent["zero2"].sum() == sent["dp"].sum() > 0
    # ZeRO-3: an all-gather before each forward and each backward that reads the
    # weight, none after the update: what the simulator moves, next to data parallelism
    zero3 = read_result(trained["zero3-saves"][1]).sent
    moved = {name: _simulated_bytes(plans[name]) for name in ("dp", "zero3")}
    assert zero3.sum() / sent["dp"].sum() == pytest.approx(moved["zero3"] / moved["dp"])
    assert 1 < moved["zero3"] / moved["dp"] < 1.5
    # a stage per weight: what the simulator moves, between the two
    mixed = read_result(trained["mixed-adam"][1]).sent
    moved["mixed"] = _simulated_bytes(plans["mixed"])
    steps = trained["mixed-adam"][0].steps
    assert mixed.sum() / steps / sent["dp"].sum() * 2 == pytest.approx(moved["mixed"] / moved["dp"])
    assert moved["dp"] < moved["mixed"] < moved["zero3"]


def test_zero3_in_bf16_gathers_the_half_format_copies(plans, trained) -> None:
    """Mixed precision: each member's rows of the weight's half-format copy are what
    is gathered (FSDP's param_dtype), 2 bytes an element, the gradients reduce-scattered
    in float32: the bytes the simulator moves in bf16, fewer than in float32."""
    job, out = trained["zero3-bf16"]
    sent = int(read_result(out).sent.sum())
    bf16 = _simulated_bytes(plans["zero3"], Precision.BF16)
    assert sent == job.steps * bf16
    assert bf16 < _simulated_bytes(plans["zero3"])


def test_zero_without_data_parallelism_is_refused(plans) -> None:
    """Where the plan replicates no weight (here one device) the executor refuses the
    stage, naming the plan and its field (every rank agrees: one line, exit 2, as for
    any refused plan: tests/executor/test_refusals.py)."""
    plan = plans["folder"] / "one-zero.json"
    plan.write_text(json.dumps({**json.loads(plans["one"].read_text()), "zero_stage": 1}))
    with pytest.raises(UserError, match=r"one-zero.json: field 'zero_stage': 1 needs data para"):
        train(MPI.COMM_SELF, options(Job(str(plan), "")))


@pytest.mark.gpu
@pytest.mark.parametrize(("transport", "gpus"), [("nccl", RANKS), ("mpi-host", 1)])
def test_zero_on_gpus_trains_like_one_device(plans, tmp_path: Path, monkeypatch, transport, gpus):
    """``--device cuda``: NCCL's grouped reduces and broadcasts (a GPU per rank: ZeRO-2
    with Adam, ZeRO-1 with momentum, ZeRO-3 with Adam), and ranks sharing one GPU over
    host-staged rings (ZeRO-2 and ZeRO-3 with Adam)."""
    cp = cupy_or_skip()
    if cp.cuda.runtime.getDeviceCount() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    if gpus == 1:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU, on a real machine too
    pairs = ((2, "adam"), (3, "adam"), (1, "momentum"))[: 3 if transport == "nccl" else 2]
    jobs = [
        Job(str(plans[f"zero{stage}"]), str(tmp_path / f"z{stage}.npz"), optimizer)
        for stage, optimizer in pairs
    ]
    run_jobs([replace(j, device="cuda", transport=transport) for j in jobs], RANKS, tmp_path)
    for job in jobs:
        losses, weights = one_device(replace(job, plan=str(plans["one"])))
        assert_like(Path(job.out), losses, weights, rtol=1e-10)


@pytest.mark.gpu
@pytest.mark.parametrize(("stage", "transport"), [(2, "nccl"), (3, "nccl")])
def test_traced_gpu_memory_is_the_models_under_zero(
    example_onnx: Path, tmp_path: Path, monkeypatch, stage: int, transport: str
):
    """A traced step's peak of arrays on each rank's GPU within 10 % of the memory model
    for GPUs under the plan's stage, Adam's state sharded (as tests/executor/test_gpu.py
    without ZeRO; the example CNN at batch 32, whose activations outweigh its weights)."""
    cp = cupy_or_skip()
    gpus = RANKS if transport == "nccl" else 1
    if cp.cuda.runtime.getDeviceCount() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    if gpus == 1:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    model = tmp_path / "cnn.onnx"
    shutil.copy(example_onnx, model)
    plan = zero_plan(model, tmp_path / "zero.json", RANKS, 32, stage)
    trace = tmp_path / "measured.json"
    command = [str(MPIEXEC), "-n", str(RANKS), sys.executable, "-m", "executor", "run"]
    args = ("--steps", "3", "--device", "cuda", "--transport", transport, "--trace", str(trace))
    run = subprocess.run(
        [*command, str(plan), *args, "--optimizer", "adam"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(trace.read_text())["otherData"]["peak_memory_bytes"]
    loaded = load_plan(plan)
    graph = load_model(model, loaded.batch).graph
    pg = Partitioner(graph).partition(loaded.strategy(graph, analyze(graph)))
    machine = replace(cpu(RANKS), transfers_use_compute=False)  # a GPU holds arrays only
    simulator = make_simulator(machine, RooflineCost(), 2, zero=ZeroStage(stage))
    predicted = simulator.evaluate(pg).peak_memory_bytes
    for rank, (p, m) in enumerate(zip(predicted, measured, strict=True)):
        assert abs(p - m) <= 0.10 * m, f"rank {rank}: predicted {p}, measured {m}"
