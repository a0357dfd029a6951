"""Run the executor under a real mpiexec and compare with the one-device reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mpi4py import MPI

from executor.kinds import DeviceKind
from executor.train import RunOptions, train
from onnx2soap.cli import main as onnx2soap_main
from onnx2soap.cli.machine_cmd import find_mpiexec
from onnx2soap.errors import UserError
from onnx2soap.ir import DType
from tests.models import MODELS


def _mpiexec() -> Path:
    """mpiexec beside this Python (the project's MPICH), else the one on PATH (a machine
    whose MPI came with the system, as the lent GPU's may)."""
    try:
        return Path(find_mpiexec())
    except UserError:  # none at all: the tests that run it fail, saying so
        return Path(sys.executable).parent / "mpiexec"


MPIEXEC = _mpiexec()


@dataclass(frozen=True)
class Run:
    returncode: int
    losses: tuple[float, ...]
    weights: dict[str, np.ndarray] | None
    bytes_sent: tuple[int, ...]
    stdout: str
    stderr: str
    peak_rss: tuple[int, ...] = ()  # bytes, per rank (the run's summary)


def make_plan(
    model: Path, plan: Path, devices: int, batch: int, strategy: str, seed: int = 0
) -> None:
    code = onnx2soap_main(
        [
            "plan",
            str(model),
            "--devices",
            str(devices),
            "--batch",
            str(batch),
            "--strategy",
            strategy,
            "--seed",
            str(seed),
            "-o",
            str(plan),
        ]
    )
    assert code == 0


def mpirun(
    plan: Path,
    ranks: int,
    workdir: Path,
    *args: str,
    timeout: float = 180,
    script: list[str] | None = None,
    launch: tuple[str, ...] = (),
) -> Run:
    """``mpiexec [launch...] -n ranks python -m executor run plan --json ...``, weights
    saved. ``launch``: mpiexec's own options (a hostfile, a launcher)."""
    weights = workdir / f"weights-{ranks}-{plan.stem}.npz"
    entry = script or ["-m", "executor"]
    command = [
        str(MPIEXEC),
        *launch,
        "-n",
        str(ranks),
        sys.executable,
        *entry,
        "run",
        str(plan),
        "--json",
        "--save-weights",
        str(weights),
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    losses, sent, peaks = [], (), ()
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            if "loss" in doc:
                losses.append(doc["loss"])
            if "summary" in doc:
                sent = tuple(doc["summary"]["bytes_sent"])
                peaks = tuple(doc["summary"]["peak_rss_bytes"])
    saved = None
    if done.returncode == 0 and weights.exists():
        with np.load(weights) as f:
            saved = {k: f[k] for k in f.files}
    return Run(done.returncode, tuple(losses), saved, sent, done.stdout, done.stderr, peaks)


def reference(plan: Path, steps: int, dtype: DType, lr: float, seed: int = 0):
    """The same training on one device, in this process (MPI.COMM_SELF), in numpy."""
    options = RunOptions(
        plan=plan, steps=steps, lr=lr, seed=seed, dtype=dtype, device=DeviceKind.CPU
    )
    result = train(MPI.COMM_SELF, options, gather=True)
    return tuple(r.loss for r in result.steps), result.weights


def assert_same_training(run: Run, ref_losses, ref_weights, rtol: float) -> None:
    assert run.returncode == 0, run.stderr[-3000:]
    np.testing.assert_allclose(run.losses, ref_losses, rtol=rtol, atol=0)
    assert run.weights is not None and set(run.weights) == set(ref_weights)
    for name, w in ref_weights.items():
        # Relative to the weight's size, but never below rtol absolute: a weight that is
        # zero in exact arithmetic (a bias before a BatchNorm gets no gradient) holds
        # rounding noise of 1e-17 that no two summation orders agree on.
        scale = max(float(np.abs(w).max()), 1.0)
        np.testing.assert_allclose(run.weights[name], w, rtol=rtol, atol=rtol * scale, err_msg=name)


def cnn_data_folder(path: Path, samples: int, seed: int = 0) -> Path:
    """A data folder for the example CNN (input.npy, labels.npy of 10 classes) with
    ``samples`` random samples from ``seed``."""
    rng = np.random.default_rng(seed)
    path.mkdir()
    np.save(path / "input.npy", rng.standard_normal((samples, *MODELS["cnn"].sample_shape)))
    np.save(path / "labels.npy", rng.integers(0, 10, samples))
    return path


def run_driver(driver: Path, ranks: int, folder: Path, timeout: float = 120) -> dict[int, dict]:
    """``mpiexec -n RANKS python DRIVER FOLDER``: what each rank wrote to
    FOLDER/rank-R.json. The run must succeed."""
    done = subprocess.run(
        [str(MPIEXEC), "-n", str(ranks), sys.executable, str(driver), str(folder)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return {r: json.loads((folder / f"rank-{r}.json").read_text()) for r in range(ranks)}
