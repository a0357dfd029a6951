"""benchmarks/fidelity.py run for real, small: one model's plans predicted, run side by side
and traced on two CPU ranks; its arguments checked before any work; the models
taken from ``--models-dir`` where there (the lent GPU's machine may lack transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import fidelity
from benchmarks.fidelity import RULES, Result, Setting, export
from executor.device import cupy_module
from executor.kinds import DeviceKind
from onnx2soap.sim.machine import dump_machine, load_machine_file
from onnx2soap.sim.presets import cpu

ROOT = Path(__file__).resolve().parents[2]


def _fidelity(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.fidelity", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--models", "cnn,vgg"], "--models: no model vgg"),
        (["--export-only"], "--export-only: give --models-dir"),
        (["--json", "no/such/out.json"], "--json no/such/out.json: no such folder"),
        (["--round-steps", "2"], "--round-steps: more than 2"),
        (["--repeats", "0"], "--repeats: at least 1"),
    ],
)
def test_bad_arguments_exit_2_before_any_work(args: list[str], said: str) -> None:
    done = _fidelity(*args)
    assert done.returncode == 2 and said in done.stderr, done.stderr


@pytest.mark.skipif(cupy_module() is not None, reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused() -> None:
    done = _fidelity("--device", "cuda")
    assert done.returncode == 2 and "--device cuda: cupy is not installed" in done.stderr


def test_ranks_sharing_a_gpu_get_its_machine_and_the_staged_transport(tmp_path: Path) -> None:
    setting = Setting(DeviceKind.CUDA, 4)
    machine = load_machine_file(setting.make_machine(tmp_path / "gpu.yaml"))
    assert machine.size == 4 and not machine.shares_cores
    assert machine.devices[0].peak_flops == pytest.approx(67e12 / 4)
    assert setting.executor_args == ["--device", "cuda", "--transport", "mpi-host"]
    assert Setting(DeviceKind.CPU, 4).executor_args == ["--device", "cpu"]  # never a GPU by default


def test_a_model_in_the_models_dir_is_not_exported_again(tmp_path: Path) -> None:
    there = tmp_path / "resnet18_legacy.onnx"  # the name the export gives it
    there.write_bytes(b"kept")
    assert export("resnet18", tmp_path) == there and there.read_bytes() == b"kept"
    done = _fidelity("--export-only", "--models-dir", str(tmp_path), "--models", "cnn,resnet18")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(ROOT / "examples" / "cnn.onnx"), str(there)]


def _small_run(tmp_path: Path, *extra: str) -> list[dict]:
    """The example CNN's plans (one random plan in place of five) on two ranks, one
    round, roofline costs: every plan still planned, simulated, run side by side and
    traced under a real mpiexec. The one model's results."""
    out = tmp_path / "fidelity.json"
    small = ["--models", "cnn", "--ranks", "2", "--repeats", "1", "--round-steps", "3"]
    small += ["--search-evals", "10", "--costs", "roofline", "--json", str(out), *extra]
    assert fidelity.main(small) == 0
    (results,) = json.loads(out.read_text())["results"].values()
    labels = [r["plan"] for r in results]
    assert labels == [*RULES, "random-1", "searched"]
    for r in results:
        assert r["predicted_s"] > 0 and r["measured_s"] > 0
        assert len(r["predicted_memory"]) == len(r["measured_memory"]) == 2
        assert min(r["measured_memory"][d] for d in r["working"]) > 0
    return results


@pytest.mark.mpi
@pytest.mark.slow
def test_one_model_on_two_ranks_end_to_end(tmp_path: Path, monkeypatch, capsys) -> None:
    """In-process for its speed: the preset's two ranks in place of a probe (10 s)."""
    monkeypatch.setattr(fidelity, "RANDOM_SEEDS", (1,))

    def preset_machine(self: Setting, path: Path) -> Path:
        path.write_text(dump_machine(cpu(self.ranks)))
        return path

    monkeypatch.setattr(Setting, "make_machine", preset_machine)
    _small_run(tmp_path)
    assert "| cnn | cpu:2 | 8 |" in capsys.readouterr().out


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.skipif(cupy_module() is None, reason="needs cupy and a GPU")
def test_two_ranks_sharing_a_gpu_end_to_end(tmp_path: Path, monkeypatch, capsys) -> None:
    """gpu_check.sh's part 6, small: the ranks share the GPU through host memory, and a
    rank a plan leaves idle holds nothing in its pool (its memory error is not a
    division by that nothing)."""
    monkeypatch.setattr(fidelity, "RANDOM_SEEDS", (1,))
    results = _small_run(tmp_path, "--device", "cuda")
    single = next(r for r in results if r["plan"] == "single-device")
    assert single["working"] == [0] and single["measured_memory"][1] == 0
    out = capsys.readouterr().out
    assert "| cnn | 2 ranks on one GPU | 8 |" in out
    assert "memory +" in out or "memory -" in out
    assert " idle" in out


def test_a_run_cut_short_keeps_the_models_it_finished(tmp_path: Path, monkeypatch, capsys):
    """Each model's row is printed and the JSON written as the model ends: gpu_check.sh
    stops the run at its time limit, and what it finished is then all there is."""
    made = Result("single-device", 2e-3, 3e-3, (3e-3, 3e-3), (100, 10), (100, 0), (0,))

    def run_model(name: str, *_):
        if name == "gpt2":
            raise KeyboardInterrupt  # the time limit's signal, as the second model runs
        return [made, replace(made, plan="searched", measured_s=2e-3)]

    monkeypatch.setattr(fidelity, "run_model", run_model)
    monkeypatch.setattr(Setting, "make_machine", lambda self, path: path)
    out = tmp_path / "fidelity.json"
    with pytest.raises(KeyboardInterrupt):
        fidelity.main(["--models", "cnn,gpt2", "--ranks", "2", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert list(doc["results"]) == ["cnn@cpu:2"]
    assert [r["plan"] for r in doc["results"]["cnn@cpu:2"]] == ["single-device", "searched"]
    assert [row[:2] for row in doc["summary"]] == [["cnn", "cpu:2"]]
    assert "| cnn | cpu:2 | 2 |" in capsys.readouterr().out
