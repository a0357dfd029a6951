"""Faults under a real mpiexec: Ctrl-C, SIGTERM, a killed rank, ranks failing together, and
an output path that cannot be written. Every rank must stop promptly, with one line and
no traceback, and with the exit code that says what happened."""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from executor.checkpoint import read_manifest
from tests.executor.mpi import MPIEXEC, make_plan

pytestmark = pytest.mark.mpi
DRIVER = Path(__file__).with_name("exit_driver.py")
RANKS = 2
FOREVER = "1000000"  # steps: the run only ends because of the fault


@dataclass(frozen=True)
class Ended:
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # from the fault to the end of mpiexec


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory, example_onnx: Path) -> Path:
    folder = tmp_path_factory.mktemp("faults")
    shutil.copy(example_onnx, folder / "cnn.onnx")
    path = folder / "plan.json"
    make_plan(folder / "cnn.onnx", path, RANKS, 4, "data-parallel")
    return path


def start(plan: Path, folder: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    command = [str(MPIEXEC), "-n", str(RANKS), sys.executable, str(DRIVER), str(folder)]
    return subprocess.Popen(
        [*command, "run", str(plan), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def wait_for_steps(proc: subprocess.Popen, count: int, timeout: float = 60) -> str:
    """Read stdout until ``count`` step lines were printed (training is under way)."""
    seen, lines = 0, []
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while seen < count:
        assert time.monotonic() < deadline, "training did not start"
        assert proc.poll() is None, proc.stderr.read()
        if selector.select(timeout=0.5):
            line = proc.stdout.readline()
            lines.append(line)
            seen += line.startswith("step")
    return "".join(lines)


def finish(proc: subprocess.Popen, since: float, timeout: float = 30) -> Ended:
    out, err = proc.communicate(timeout=timeout)
    return Ended(proc.returncode, out, err, time.monotonic() - since)


def rank_codes(folder: Path) -> list[int]:
    return [int((folder / f"rank-{r}.rc").read_text()) for r in range(RANKS)]


def our_lines(stderr: str) -> list[str]:
    """The executor's lines (mpiexec adds its own notes about forwarding the signal)."""
    return [line for line in stderr.splitlines() if line.startswith("executor")]


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_every_rank_at_a_step_boundary(
    plan: Path, tmp_path: Path, signum: int, code: int
) -> None:
    weights, checkpoints = tmp_path / "w.npz", tmp_path / "ckpt"
    args = ("--save-weights", str(weights), "--checkpoint", str(checkpoints))
    proc = start(plan, tmp_path, "--steps", FOREVER, *args)
    wait_for_steps(proc, 2)
    sent = time.monotonic()
    proc.send_signal(signum)  # to mpiexec, as Ctrl-C in its terminal would
    ended = finish(proc, sent)
    assert ended.returncode == code, ended.stderr
    assert rank_codes(tmp_path) == [code] * RANKS
    assert "Traceback" not in ended.stderr + ended.stdout
    lines = our_lines(ended.stderr)
    assert len(lines) == 1, ended.stderr
    assert signal.Signals(signum).name in lines[0] and "stopped after step" in lines[0]
    assert ended.seconds < 10
    with np.load(weights) as saved:  # nothing trained is lost
        assert saved.files and all(np.isfinite(saved[k]).all() for k in saved.files)
    # ... and the run can be continued from where it stopped.
    done = int(lines[0].split("stopped after step ")[1].split()[0])
    manifest, _ = read_manifest(checkpoints)
    assert manifest.step == done and "--resume" in lines[0]


@pytest.fixture(scope="module")
def idle_plan(plan: Path) -> Path:
    """Everything on rank 0: rank 1 sits the steps out (executor/crew.py)."""
    path = plan.with_name("single.json")
    make_plan(plan.with_name("cnn.onnx"), path, RANKS, 4, "single-device")
    return path


def test_a_signal_to_an_idle_rank_alone_stops_every_rank(idle_plan: Path, tmp_path: Path) -> None:
    """The idle rank takes no part in the steps' collectives; it passes the signal on to
    the working ranks, and all stop at a step boundary as when mpiexec forwards it."""
    proc = start(idle_plan, tmp_path, "--steps", FOREVER)
    wait_for_steps(proc, 2)
    sent = time.monotonic()
    os.kill(int((tmp_path / "rank-1.pid").read_text()), signal.SIGINT)
    ended = finish(proc, sent)
    assert ended.returncode == 130 and rank_codes(tmp_path) == [130] * RANKS, ended.stderr
    lines = our_lines(ended.stderr)
    assert len(lines) == 1 and "SIGINT" in lines[0] and "stopped after step" in lines[0]
    assert ended.seconds < 10


def test_killed_rank_ends_the_run_at_once(plan: Path, tmp_path: Path) -> None:
    proc = start(plan, tmp_path, "--steps", FOREVER)
    before = wait_for_steps(proc, 2)
    victim = int((tmp_path / "rank-1.pid").read_text())
    sent = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    ended = finish(proc, sent)
    assert ended.returncode != 0
    assert ended.seconds < 10
    # mpiexec names what it knows (on stdout): the dead process, its host and the signal;
    # the executor's first line maps that pid to its rank.
    said = ended.stdout + ended.stderr
    assert str(victim) in said and "signal 9" in said.lower(), said
    (ranks,) = [line for line in before.splitlines() if line.startswith("ranks: ")]
    assert ranks.split(", ")[1].endswith(f":{victim}"), ranks


def test_ranks_failing_together_print_no_second_traceback(plan: Path, tmp_path: Path) -> None:
    proc = start(plan, tmp_path, "--steps", "3", env={"FAIL_ALL_RANKS": "1"})
    ended = finish(proc, time.monotonic(), timeout=60)
    assert ended.returncode != 0
    assert "injected failure on every rank" in ended.stderr
    assert "UnboundLocalError" not in ended.stderr, ended.stderr


def test_unwritable_weights_path_is_refused_before_training(plan: Path, tmp_path: Path) -> None:
    began = time.monotonic()
    proc = start(plan, tmp_path, "--steps", FOREVER, "--save-weights", "/dev/null")
    ended = finish(proc, began, timeout=60)
    assert ended.returncode == 2 and rank_codes(tmp_path) == [2] * RANKS
    lines = [line for line in ended.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("executor: error: "), ended.stderr
    assert "/dev/null" in lines[0] and "step" not in ended.stdout


@pytest.mark.parametrize(
    "option", [("--lr", "nan"), ("--steps", "-1"), ("--seed", "-1"), ("--steps", "1e9")]
)
def test_odd_executor_options_are_one_line_from_rank_0(
    plan: Path, tmp_path: Path, option: tuple[str, str]
) -> None:
    began = time.monotonic()
    ended = finish(start(plan, tmp_path, *option), began, timeout=60)
    assert ended.returncode == 2 and rank_codes(tmp_path) == [2] * RANKS
    lines = [line for line in ended.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("executor: error: "), ended.stderr
    assert option[0] in lines[0] and "Traceback" not in ended.stderr
