"""Mixed precision (``--precision bf16|fp16``) against torch's own: the rounding against
torch's casts, the loss scale against torch's update op, training against
torch.autocast (+ GradScaler for fp16) on the same model, data and initial weights, and
N ranks against one device in the same precision.

How close is close: a bf16 value carries 8 bits, so one rounding moves it by up to 2^-9
of itself; a loss after a few SGD steps on this MLP moves by about 1e-4 relative between
float32 and bf16 training. The executor's bf16 run must land within a tenth of that
distance from torch's bf16 run (and fp16's, 11 bits, within a tenth of its own).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from executor.precision import HalfStorage, LossScaler, Rounding, round_bf16, round_fp16
from onnx2soap.precision import Precision
from tests.optional import require

torch = require("torch")

STEPS, BATCH, LR = 4, 8, 0.1


def _specials(rng) -> np.ndarray:
    """Random values over many magnitudes, exact ties of both formats, the extremes."""
    values = rng.standard_normal(4000) * 10.0 ** rng.integers(-40, 39, 4000)
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 65520.0])
    extremes = np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 3.4e38, -3.4e38, 1e-45])
    return np.concatenate([values, ties, -ties, extremes]).astype(np.float32)


@pytest.mark.parametrize(
    ("rounding", "dtype"), [(round_bf16, torch.bfloat16), (round_fp16, torch.float16)]
)
def test_rounding_is_torchs_cast_and_back(rounding, dtype) -> None:
    x = _specials(np.random.default_rng(0))
    want = torch.from_numpy(x.copy()).to(dtype).float().numpy()
    got = x.copy()
    rounding(np, got)
    np.testing.assert_array_equal(got, want)  # NaNs compare equal by position
    assert np.array_equal(np.signbit(got[np.isfinite(got)]), np.signbit(want[np.isfinite(want)]))


@pytest.mark.parametrize(
    ("rounding", "dtype"), [(round_bf16, torch.bfloat16), (round_fp16, torch.float16)]
)
@pytest.mark.parametrize("value", [1 + 2**-9 + 2**-12, np.nan, -3.0e38])
def test_a_0d_array_rounds_as_torch_casts_it(rounding, dtype, value) -> None:
    """A scalar's gradient is a 0-d array: arithmetic on one gives numpy scalars, which
    bf16's NaN store once crashed on (two held-out GPT-2 exports, one device)."""
    x = np.array(value, dtype=np.float32)
    want = torch.tensor(float(value), dtype=torch.float32).to(dtype).float().numpy()
    rounding(np, x)
    assert x.shape == ()
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize(
    ("precision", "dtype"), [(Precision.BF16, torch.bfloat16), (Precision.FP16, torch.float16)]
)
@pytest.mark.parametrize("premade", [False, True], ids=["new", "premade"])
def test_stored_values_are_torchs_cast(precision, dtype, premade: bool) -> None:
    """What the step stores of a kernel's result, in a new array or in the one made before
    the kernel ran (``Step._stored_tile``), is torch's cast of it, bit for bit but NaNs'
    payloads (a NaN where torch has one), and widens back to those values exactly."""
    x = _specials(np.random.default_rng(3))
    half = HalfStorage(np, precision)
    into = half.empty(x.shape) if premade else None
    stored = half.narrow(x, into)
    assert stored is into if premade else stored.dtype == half.dtype
    want = torch.from_numpy(x.copy()).to(dtype)
    numbers = ~np.isnan(x)
    bits = want.view(torch.int16).numpy()
    np.testing.assert_array_equal(stored.view(np.int16)[numbers], bits[numbers])
    np.testing.assert_array_equal(half.widen(stored), want.float().numpy())


def test_rounding_leaves_float32_training_and_other_dtypes_alone() -> None:
    x = np.float32([1 + 2**-10])
    Rounding(np, Precision.FP32)(x)
    assert x[0] == np.float32(1 + 2**-10)
    ids = np.array([3, 5])
    Rounding(np, Precision.BF16)(ids)
    assert ids.tolist() == [3, 5]


def test_loss_scale_follows_torchs_update() -> None:
    """The same scale and growth tracker as torch._amp_update_scale_ after every step of
    a sequence of good and overflowing steps (growth every 3 good steps)."""
    rng = np.random.default_rng(1)
    ours = LossScaler(scale=2.0**10, growth_interval=3)
    scale, tracker = torch.tensor([2.0**10]), torch.tensor([0], dtype=torch.int32)
    for found in (rng.random(60) < 0.3).tolist():
        ours.update(found)
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(found)]), 2.0, 0.5, 3)
        assert (ours.scale, ours.growth_tracker) == (scale.item(), tracker.item())


# --- training against torch.autocast ----------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
    )


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory):
    """The MLP's ONNX export, a one-device plan of it and a data file of STEPS batches."""
    from tests.executor.mpi import make_plan
    from tests.models import export

    folder = tmp_path_factory.mktemp("precision")
    model = export(_mlp(), torch.zeros(BATCH, 16), folder / "mlp.onnx")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((STEPS * BATCH, 16)).astype(np.float32) * 3
    y = rng.integers(0, 10, STEPS * BATCH)
    np.savez(folder / "data.npz", input=x, labels=y)
    make_plan(model, folder / "one.json", 1, BATCH, "single-device")
    return folder, x, y


def _torch_losses(x, y, precision: Precision, init_scale: float = 2.0**16) -> list[tuple]:
    """(loss, scale, skipped) per step: torch.autocast on the CPU, SGD, GradScaler for fp16."""
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    dtype = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=precision.scales_loss)
    out = []
    for step in range(STEPS):
        xb = torch.from_numpy(x[step * BATCH : (step + 1) * BATCH])
        yb = torch.from_numpy(y[step * BATCH : (step + 1) * BATCH])
        sgd.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(xb)
        loss = torch.nn.functional.cross_entropy(logits.float(), yb)
        scale = scaler.get_scale() if precision.scales_loss else None
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(sgd)
        scaler.update()
        skipped = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        out.append((loss.item(), scale, skipped and precision.scales_loss))
    return out


def _our_losses(folder: Path, precision: Precision, init_scale: float = 2.0**16) -> list[tuple]:
    from mpi4py import MPI

    from executor.kinds import DeviceKind
    from executor.train import RunOptions, train

    options = RunOptions(
        plan=folder / "one.json",
        steps=STEPS,
        lr=LR,
        data=folder / "data.npz",
        device=DeviceKind.CPU,
        precision=precision,
        loss_scale=init_scale,
    )
    result = train(MPI.COMM_SELF, options)
    return [(r.loss, r.loss_scale, r.skipped) for r in result.steps]


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16])
def test_training_follows_torch_autocast(mlp, precision: Precision) -> None:
    folder, x, y = mlp
    full = np.array([loss for loss, *_ in _torch_losses(x, y, Precision.FP32)])
    theirs = _torch_losses(x, y, precision)
    ours = _our_losses(folder, precision)
    assert [r[1:] for r in ours] == [r[1:] for r in theirs]  # the scale, no step skipped
    theirs_loss = np.array([r[0] for r in theirs])
    ours_loss = np.array([r[0] for r in ours])
    half_effect = np.abs(theirs_loss - full)[1:]  # the first loss sees no update yet
    assert half_effect.min() > 0, "the half format changed nothing: nothing is tested"
    np.testing.assert_array_less(np.abs(ours_loss - theirs_loss)[1:], 0.1 * half_effect)
    np.testing.assert_allclose(ours_loss[0], theirs_loss[0], rtol=2e-3)


def test_fp16_overflow_skips_steps_and_backs_off_as_gradscaler(mlp) -> None:
    """A loss scale of 2^40 overflows fp16 gradients: both skip the same first steps,
    halving the scale each time, then train alike."""
    folder, x, y = mlp
    theirs = _torch_losses(x, y, Precision.FP16, init_scale=2.0**30)
    ours = _our_losses(folder, Precision.FP16, init_scale=2.0**30)
    assert theirs[0][2], "no overflow at 2^30: nothing is tested"
    assert [r[1:] for r in ours] == [r[1:] for r in theirs]
    np.testing.assert_allclose([r[0] for r in ours], [r[0] for r in theirs], rtol=1e-3)


# --- N ranks, checkpoints, refusals -------------------------------------------------------------


def _one_device(folder: Path, plan: Path, precision: Precision, steps: int, **extra):
    from mpi4py import MPI

    from executor.kinds import DeviceKind
    from executor.train import RunOptions, train

    options = RunOptions(
        plan=plan, steps=steps, lr=LR, device=DeviceKind.CPU, precision=precision, **extra
    )
    return train(MPI.COMM_SELF, options, gather=True)


@pytest.mark.mpi
@pytest.mark.parametrize(("precision", "ranks", "seed"), [("bf16", 2, 3), ("fp16", 3, 5)])
def test_n_ranks_train_like_one_device_in_the_same_precision(mlp, tmp_path, precision, ranks, seed):
    """A random plan on N ranks against one device, both rounding alike: sums in other
    orders can move a value across a rounding boundary, so within a half-format ulp."""
    from tests.executor.mpi import make_plan, mpirun

    folder, *_ = mlp
    plan = tmp_path / "random.json"
    make_plan(folder / "mlp.onnx", plan, ranks, BATCH, "random", seed)
    one = tmp_path / "one.json"
    make_plan(folder / "mlp.onnx", one, ranks, BATCH, "single-device")
    ref = _one_device(folder, folder / "one.json", Precision(precision), STEPS)
    run = mpirun(
        plan, ranks, tmp_path, "--steps", str(STEPS), "--lr", str(LR), "--precision", precision
    )
    assert run.returncode == 0, run.stderr[-2000:]
    np.testing.assert_allclose(run.losses, [r.loss for r in ref.steps], rtol=2e-3)
    for name, w in ref.weights.items():
        np.testing.assert_allclose(run.weights[name], w, rtol=0, atol=2e-3, err_msg=name)


PIPELINE = ("pipeline", "--stages", "2", "--microbatches", "2")
RULES = {  # rules whose plans move half-format tiles, sums and shards in their own ways
    "pipeline, recomputing": (*PIPELINE, "--recompute", "all"),
    "zero-2, selective": ("zero", "--zero-stage", "2", "--recompute", "selective"),
    "megatron": ("megatron",),
}


@pytest.mark.mpi
@pytest.mark.parametrize("rule", list(RULES))
def test_rules_train_like_one_device_in_bf16(mlp, tmp_path, rule: str) -> None:
    """bf16 on 2 ranks under a pipeline with recomputation (half-format tiles sent
    between stages, gradients accumulated over microbatches in float32), ZeRO-2 with
    selective recomputation (reduce-scattered float32 gradients, sharded updates) and
    Megatron (partial sums of half-format tiles), against one device in bf16: within a
    half-format ulp, as a random plan."""
    from onnx2soap.cli import main as onnx2soap_main
    from tests.executor.mpi import mpirun

    folder, *_ = mlp
    plan = tmp_path / "plan.json"
    argv = ["plan", str(folder / "mlp.onnx"), "--batch", str(BATCH), "--devices", "2"]
    argv += ["--precision", "bf16", "--strategy", *RULES[rule], "--quiet", "-o", str(plan)]
    assert onnx2soap_main(argv) == 0
    ref = _one_device(folder, folder / "one.json", Precision.BF16, STEPS)
    run = mpirun(plan, 2, tmp_path, "--steps", str(STEPS), "--lr", str(LR))
    assert run.returncode == 0, run.stderr[-2000:]
    np.testing.assert_allclose(run.losses, [r.loss for r in ref.steps], rtol=2e-3)
    # Sums in other orders (over microbatches, ranks, partial tiles) move some values
    # across a rounding boundary: up to 4e-4 here. Float32 training ends 1.2e-3 away, so
    # the tolerance tells the plan's precision was taken.
    atol = 6e-4
    for name, w in ref.weights.items():
        np.testing.assert_allclose(run.weights[name], w, rtol=0, atol=atol, err_msg=name)
    fp32 = _one_device(folder, folder / "one.json", Precision.FP32, STEPS)
    assert max(float(np.max(np.abs(run.weights[n] - w))) for n, w in fp32.weights.items()) > atol


def test_fp16_resume_continues_the_loss_scale(mlp, tmp_path) -> None:
    """Four steps straight, or two and two from a checkpoint: the same losses and scales
    (the scale may grow after every step here, so a lost scale would show)."""
    folder, *_ = mlp
    plan = folder / "one.json"
    extra = {"loss_scale_growth_interval": 1, "data": folder / "data.npz"}
    straight = _one_device(folder, plan, Precision.FP16, 4, **extra)
    _one_device(folder, plan, Precision.FP16, 2, checkpoint=tmp_path / "ckpt", **extra)
    resumed = _one_device(folder, plan, Precision.FP16, 4, resume=tmp_path / "ckpt", **extra)
    assert [(r.loss, r.loss_scale) for r in resumed.steps] == [
        (r.loss, r.loss_scale) for r in straight.steps[2:]
    ]
    assert len({r.loss_scale for r in straight.steps}) > 1  # the scale moved


def test_mixed_precision_needs_float32_and_a_matching_checkpoint(mlp, tmp_path) -> None:
    from onnx2soap.errors import UserError

    folder, *_ = mlp
    from mpi4py import MPI

    from executor.kinds import DeviceKind
    from executor.train import RunOptions, train
    from onnx2soap.ir import DType

    options = RunOptions(
        plan=folder / "one.json",
        steps=1,
        dtype=DType.FLOAT64,
        precision=Precision.BF16,
        device=DeviceKind.CPU,
    )
    with pytest.raises(UserError, match="needs --dtype float32, not float64"):
        train(MPI.COMM_SELF, options)
    _one_device(folder, folder / "one.json", Precision.BF16, 1, checkpoint=tmp_path / "c")
    with pytest.raises(UserError, match="--precision bf16; this run has fp16"):
        _one_device(folder, folder / "one.json", Precision.FP16, 2, resume=tmp_path / "c")
