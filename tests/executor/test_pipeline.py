"""Pipeline plans (issue 32) train exactly like one device running the same microbatches.

Under a real mpiexec (4 ranks, every run in one of them: ``jobs_driver.py``),
float64, 1e-10: GPT-2 (tests/sequence_models.py: dropout 0.1, its masks those of the
samples whatever the plan) and the example CNN (BatchNorm in training mode: statistics
per microbatch, running statistics updated microbatch by microbatch), on 2 stages of 2
data-parallel ranks and on 4 stages of one, with more microbatches than stages and
fewer, GPipe and 1F1B, plain SGD, momentum and Adam, and ZeRO-2 inside the stages. The
reference is the same plan's model on one rank as a pipeline of one stage with the same
microbatches; and that reference equals torch's autograd and ``torch.optim`` with
gradient accumulation over the same microbatches (BatchNorm included), and a plan
without a pipeline on GPT-2 (no BatchNorm: a step of microbatches is the step of the
whole batch). A pipeline run's checkpoint resumes under plain data parallelism and
continues like the uninterrupted run; evaluation, ``--save-weights`` and
``--save-model`` give what one device gives. A pipeline the model contradicts is one
line and exit 2. On GPUs (the stand-in under ``-m gpu``): NCCL and host-staged rings.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from mpi4py import MPI
from onnx import numpy_helper

from executor.program import Close, Recv, Reopen, Send, compile_program, forward_program
from onnx2soap.importer import load_model
from onnx2soap.soap import Partitioner, analyze, load_plan
from onnx2soap.soap.pipeline import Schedule, held_at_most
from onnx2soap.soap.zero import ZeroStage
from tests.executor.jobs_driver import Job, read_result, run, run_jobs
from tests.executor.mpi import MPIEXEC
from tests.executor.pipeline_plans import pipeline_plan, walked_plan
from tests.executor.test_refusals import assert_refused
from tests.optional import cupy_or_skip, require

pytestmark = pytest.mark.mpi
RANKS, BATCH = 4, 8
GPIPE, ONE_F_ONE_B = Schedule.GPIPE, Schedule.ONE_F_ONE_B
# (model, stages, data-parallel width, microbatches, schedule, optimizer, ZeRO stage).
# Adam only where no stage is data parallel on GPT-2: a weight gradient that is zero in
# exact arithmetic (the key bias) is rounding noise that summation orders disagree on,
# and Adam normalizes it into a whole step (tests/executor/test_zero.py's ADAM_NOISE).
CASES = {
    "gpt-2x2-1f1b-momentum": ("gpt", 2, 2, 4, ONE_F_ONE_B, "momentum", 0),
    "gpt-4x1-gpipe-adam": ("gpt", 4, 1, 2, GPIPE, "adam", 0),
    "gpt-4x1-1f1b-sgd": ("gpt", 4, 1, 8, ONE_F_ONE_B, "sgd", 0),
    "cnn-2x2-gpipe-adam": ("cnn", 2, 2, 4, GPIPE, "adam", 0),
    "cnn-4x1-1f1b-momentum": ("cnn", 4, 1, 2, ONE_F_ONE_B, "momentum", 0),
    "cnn-2x2-1f1b-adam-zero2": ("cnn", 2, 2, 4, ONE_F_ONE_B, "adam", 2),
    "cnn-2x2-1f1b-momentum-zero3": ("cnn", 2, 2, 4, ONE_F_ONE_B, "momentum", 3),
    # one stage: data parallelism accumulating two microbatches' gradients, under FSDP
    # (each microbatch gathers the weights again), as the search offers it
    "gpt-1x4-1f1b-momentum-zero3": ("gpt", 1, 4, 2, ONE_F_ONE_B, "momentum", 3),
}
# The walk's plans inside pipelines (search/pipeline_walk.py): (model, each stage's
# tensor-parallel degree over 2 ranks, microbatches, optimizer, ZeRO stage, random
# changes of an op's config). Megatron-LM inside both stages; inside one beside a
# data-parallel one under ZeRO-1; and 40 ops' configs of the walk's random changes.
WALKED = {
    "gpt-walked-tp2-tp2-momentum": ("gpt", (2, 2), 4, "momentum", 0, 0),
    "gpt-walked-tp2-dp2-momentum-zero1": ("gpt", (2, 1), 4, "momentum", 1, 0),
    "gpt-walked-40-changes-sgd": ("gpt", (1, 2), 2, "sgd", 0, 40),
}


@functools.cache
def one_device(job: Job):
    """The job on one rank (``job.plan`` a one-device plan), in this process."""
    return run(MPI.COMM_SELF, job)


def reference(job: Job, plan: Path):
    """``job`` on one device under ``plan``: its training, nothing written."""
    return one_device(
        replace(job, plan=str(plan), out="", checkpoint=None, save_weights=None, save_model=None)
    )


def assert_like(got, want, rtol: float = 1e-10) -> None:
    """Losses within ``rtol``, every weight and state within ``rtol`` of its size."""
    np.testing.assert_allclose(got.losses, want.losses, rtol=rtol, atol=0)
    np.testing.assert_allclose(got.evaluations, want.evaluations, rtol=rtol, atol=0)
    assert set(got.weights) == set(want.weights)
    for name, w in want.weights.items():
        tol = rtol * max(float(np.abs(w).max()), 1.0)
        np.testing.assert_allclose(got.weights[name], w, rtol=0, atol=tol, err_msg=name)


@pytest.fixture(scope="module")
def models(tmp_path_factory, example_onnx: Path) -> dict[str, Path]:
    require("torch")
    require("transformers")
    from tests.sequence_models import export_sequence

    folder = tmp_path_factory.mktemp("pipeline")
    cnn = folder / "cnn.onnx"
    shutil.copy(example_onnx, cnn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on tracing
        gpt = export_sequence("gpt2", folder, "dynamo", dropout=0.1)
    return {"cnn": cnn, "gpt": gpt, "folder": folder}


def _plans(models, name: str, case) -> tuple[Path, Path]:
    """(the case's plan, its one-device reference: one stage, the same microbatches)."""
    model, stages, width, m, schedule, _, zero = case
    folder = models["folder"]
    plan = pipeline_plan(
        models[model], folder / f"{name}.json", BATCH, stages, m, schedule, width, ZeroStage(zero)
    )
    one = pipeline_plan(models[model], folder / f"one-{model}-{m}.json", BATCH, 1, m)
    return plan, one


@pytest.fixture(scope="module")
def eval_data(models) -> Path:
    """Two batches for the CNN's evaluation."""
    rng = np.random.default_rng(7)
    data = models["folder"] / "eval.npz"
    np.savez(
        data,
        input=rng.standard_normal((2 * BATCH, 3, 32, 32)),
        labels=rng.integers(0, 10, 2 * BATCH),
    )
    return data


@pytest.fixture(scope="module")
def trained(models, eval_data) -> dict[str, tuple[Job, Path]]:
    """Every job, run once in one mpiexec: (the job, its one-device plan), by name."""
    folder = models["folder"]
    jobs: dict[str, tuple[Job, Path]] = {}
    for name, case in CASES.items():
        plan, one = _plans(models, name, case)
        jobs[name] = (Job(str(plan), str(folder / f"{name}.npz"), case[5]), one)
    for name, (model, degrees, m, optimizer, zero, changes) in WALKED.items():
        plan = walked_plan(
            models[model], folder / f"{name}.json", BATCH, m, degrees, ZeroStage(zero), changes
        )
        one = pipeline_plan(models[model], folder / f"one-{model}-{m}.json", BATCH, 1, m)
        jobs[name] = (Job(str(plan), str(folder / f"{name}.npz"), optimizer), one)
    # Evaluation and the weights written out, on a CNN run.
    job, one = jobs["cnn-2x2-gpipe-adam"]
    jobs["cnn-2x2-gpipe-adam"] = (
        replace(
            job,
            eval_data=str(eval_data),
            save_weights=str(folder / "weights.npz"),
            save_model=str(folder / "trained.onnx"),
        ),
        one,
    )
    # Evaluation under ZeRO-3: each op's weights gathered for its forward, let go after.
    job, one = jobs["cnn-2x2-1f1b-momentum-zero3"]
    jobs["cnn-2x2-1f1b-momentum-zero3"] = (replace(job, eval_data=str(eval_data)), one)
    # Two steps under a pipeline, checkpointed; the third under plain data parallelism.
    job, one = jobs["gpt-2x2-1f1b-momentum"]
    checkpoint = str(folder / "checkpoints")
    jobs["saves"] = (
        replace(job, out=str(folder / "saves.npz"), steps=2, checkpoint=checkpoint),
        one,
    )
    dp = pipeline_plan(models["gpt"], folder / "dp.json", BATCH, 1, 1, width=RANKS)
    jobs["resumes"] = (
        replace(job, plan=str(dp), out=str(folder / "resumes.npz"), resume=checkpoint),
        one,
    )
    run_jobs([job for job, _ in jobs.values()], RANKS, folder)
    return jobs


@pytest.mark.parametrize("name", [*CASES, *WALKED])
def test_a_pipeline_trains_like_one_device(trained, name: str) -> None:
    job, one = trained[name]
    assert_like(read_result(Path(job.out)), reference(job, one))


def test_a_checkpoint_resumes_under_plain_data_parallelism(trained) -> None:
    """The pipeline's two steps, then a third under data parallelism over the 4 ranks
    (momentum re-sharded): the third step of the uninterrupted one-device run."""
    job, one = trained["resumes"]
    want = reference(replace(job, plan=job.plan, resume=None), one)
    got = read_result(Path(job.out))
    np.testing.assert_allclose(got.losses, want.losses[2:], rtol=1e-10)
    assert_like(replace(got, losses=want.losses), want)  # the weights
    saved = read_result(Path(trained["saves"][0].out))
    np.testing.assert_allclose(saved.losses, want.losses[:2], rtol=1e-10)


def test_evaluation_and_written_weights(trained) -> None:
    """The evaluation loss is one device's; --save-weights and --save-model write the
    gathered weights (the model in its float32 initializers)."""
    job, _ = trained["cnn-2x2-gpipe-adam"]
    got = read_result(Path(job.out))
    assert len(got.evaluations) == 1
    with np.load(job.save_weights) as saved:
        assert set(saved.files) == set(got.weights)
        for name, w in got.weights.items():
            np.testing.assert_array_equal(saved[name], w, err_msg=name)
    model = onnx.load(job.save_model)
    initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for name, w in got.weights.items():
        np.testing.assert_array_equal(initializers[name], w.astype(np.float32), err_msg=name)


def test_microbatches_are_the_whole_batch_without_batchnorm(models) -> None:
    """GPT-2 (Dropout, no BatchNorm) on one device: a step of 4 microbatches is the
    step of the whole batch, Dropout's masks included (the losses of a plan without a
    pipeline); so a pipeline changes how a step runs, not what it computes."""
    folder = models["folder"]
    plain = pipeline_plan(models["gpt"], folder / "plain.json", BATCH, 1, 1)
    four = pipeline_plan(models["gpt"], folder / "one-gpt-4.json", BATCH, 1, 4)
    job = Job(str(plain), "", "momentum")
    assert_like(reference(job, four), reference(job, plain))


def test_batchnorm_equals_torch_accumulating_gradients(tmp_path: Path) -> None:
    """Independent of the executor: torch's autograd and ``torch.optim.SGD`` (momentum)
    on the same BatchNorm network, gradients accumulated over the same 4 microbatches of
    consecutive samples (each microbatch's loss a share of the batch's mean), equal the
    one-device pipeline: losses, weights and running statistics."""
    torch = require("torch")
    from tests.models import build_bnnet, export_legacy

    batch, microbatches, steps, lr = 8, 4, 3, 0.05
    model = export_legacy(
        build_bnnet(seed=2, dropout=0.0),
        (torch.randn(2, 3, 16, 16),),
        tmp_path / "bnnet.onnx",
        ["input"],
        ["logits"],
    )
    # The exported values (tracing ran a forward in training mode: running statistics
    # moved) in a float64 module.
    net = build_bnnet(seed=2, dropout=0.0).double()
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(model).graph.initializer}
    with torch.no_grad():
        for name, value in [*net.named_parameters(), *net.named_buffers()]:
            if name in inits:
                value.copy_(torch.from_numpy(inits[name].astype(np.float64)))
    # ONNX keeps 1 - momentum as a float32 attribute, and its running variance follows
    # the batch's biased variance where torch's follows the unbiased one: kept here.
    variances = {}
    for name in ("bn1", "bn2"):
        bn = getattr(net, name)
        bn.momentum = 1 - float(np.float32(1 - bn.momentum))
        variances[f"{name}.running_var"] = bn.running_var.detach().numpy().copy()

        def onnx_variance(module, inputs, key=f"{name}.running_var") -> None:
            batch_var = inputs[0].detach().numpy().var(axis=(0, 2, 3))
            keep = 1 - module.momentum
            variances[key] = keep * variances[key] + (1 - keep) * batch_var

        bn.register_forward_pre_hook(onnx_variance)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((steps * batch, 3, 16, 16))
    labels = rng.integers(0, 10, steps * batch)
    data = tmp_path / "data.npz"
    np.savez(data, input=x, labels=labels)
    plan = pipeline_plan(model, tmp_path / "one.json", batch, 1, microbatches)
    config = Job(str(plan), "", "momentum", steps=steps, lr=lr, data=str(data))
    ours = run(MPI.COMM_SELF, config)

    # tests/executor/optimizer_configs.py's "momentum"
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.8, weight_decay=0.01)
    losses = []
    size = batch // microbatches
    for step in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for m in range(microbatches):
            rows = slice(step * batch + m * size, step * batch + (m + 1) * size)
            logits = net(torch.from_numpy(x[rows]))
            loss = (
                torch.nn.functional.cross_entropy(
                    logits, torch.from_numpy(labels[rows]), reduction="sum"
                )
                / batch
            )
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    np.testing.assert_allclose(ours.losses, losses, rtol=1e-10)
    state = {**dict(net.named_parameters()), **dict(net.named_buffers())}
    for name, w in ours.weights.items():
        want = variances.get(name, state[name].detach().numpy())
        np.testing.assert_allclose(w, want, rtol=1e-9, atol=1e-12, err_msg=name)


def test_1f1b_holds_fewer_microbatches_than_gpipe(models) -> None:
    """The compiled programs: every rank's sends and receives of a pair in one order
    (matched without tags), and the first stage's slots (the microbatches it holds at
    once) those ``held_at_most`` says: all of them under GPipe, the stages under 1F1B."""
    folder = models["folder"]
    for schedule in Schedule:
        plan = pipeline_plan(models["gpt"], folder / "s.json", BATCH, 4, 8, schedule)
        loaded = load_plan(plan)
        graph = load_model(models["gpt"], loaded.graph_batch).graph
        pg = Partitioner(graph).partition(loaded.strategy(graph, analyze(graph)))
        programs = [compile_program(pg, r, pipeline=loaded.pipeline) for r in range(4)]
        assert programs[0].slots == held_at_most(schedule, 0, 4, 8)
        for program in programs:
            closes = [i.microbatch for i in program.instructions if isinstance(i, Close)]
            assert sorted(closes) == list(range(8))
            assert forward_program(program).microbatches == 8
        reopened = sum(isinstance(i, Reopen) for i in programs[0].instructions)
        assert reopened == (0 if schedule is GPIPE else 8 - 4)
        for a in range(4):
            for b in range(4):
                sent = [
                    (i.transfer.id, i.microbatch)
                    for i in programs[a].instructions
                    if isinstance(i, Send) and i.transfer.dst == b
                ]
                posted = [
                    (i.transfer.id, i.microbatch)
                    for i in programs[b].instructions
                    if isinstance(i, Recv) and i.transfer.src == a
                ]
                assert sent == posted


def test_a_pipeline_the_model_contradicts_is_refused(models, tmp_path: Path) -> None:
    """Stages whose data flows backwards (the stages' ops swapped): one line naming the
    op and the stages, exit 2 on every rank."""
    plan = pipeline_plan(models["cnn"], tmp_path / "plan.json", BATCH, 2, 2)
    doc = json.loads(plan.read_text())
    doc["pipeline"]["stages"] = doc["pipeline"]["stages"][::-1]
    plan.write_text(json.dumps(doc))
    command = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "executor", "run", str(plan)]
    done = subprocess.run([*command, "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert_refused(done, "reads", "from a later stage")


@pytest.mark.gpu
@pytest.mark.parametrize(("transport", "gpus"), [("nccl", 2), ("mpi-host", 1)])
def test_a_pipeline_on_gpus_trains_like_one_device(
    models, tmp_path: Path, monkeypatch, transport, gpus
):
    """``--device cuda``: 2 stages (one GPU each over NCCL, or sharing one over
    host-staged rings), 1F1B with 4 microbatches (slots reused: the device waited for)
    and GPipe, against one CPU device."""
    cp = cupy_or_skip()
    if cp.cuda.runtime.getDeviceCount() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    if gpus == 1:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    jobs = []
    for model, schedule, optimizer in (("gpt", ONE_F_ONE_B, "momentum"), ("cnn", GPIPE, "adam")):
        plan = pipeline_plan(models[model], tmp_path / f"{model}.json", BATCH, 2, 4, schedule)
        out = str(tmp_path / f"{model}.npz")
        jobs.append(Job(str(plan), out, optimizer, device="cuda", transport=transport))
    run_jobs(jobs, 2, tmp_path)
    for job in jobs:
        one = pipeline_plan(
            Path(load_plan(job.plan).model_path), tmp_path / "one.json", BATCH, 1, 4
        )
        want = one_device(replace(job, plan=str(one), out="", device="cpu", transport="auto"))
        assert_like(read_result(Path(job.out)), want)
