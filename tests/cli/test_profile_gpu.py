"""``onnx2soap profile --device cuda``: the kernels timed on the GPU and the in-step
calibration taken in the executor's runtime on the GPU (skipped without cupy and a GPU).

Two ranks share the one GPU, as ``benchmarks/fidelity.py --device cuda`` runs them: the
database holds the GPU's fingerprint, isolated timings and in-step times of the same
keys, and ``plan``/``simulate`` answer from them (never from the CPU's).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from executor.device import cupy_module
from onnx2soap.cli import main as cli
from onnx2soap.sim.machine import dump_machine
from onnx2soap.sim.presets import cpu
from tests.sim.tiny import gemm_model

pytestmark = [
    pytest.mark.skipif(cupy_module() is None, reason="needs cupy and a GPU"),
    pytest.mark.gpu,
    pytest.mark.mpi,
]


def test_profile_on_the_gpu_calibrates_in_the_step(tmp_path: Path, capsys) -> None:
    model = gemm_model(tmp_path / "tiny.onnx", hidden=8, relu=True)
    machine = tmp_path / "gpu.yaml"
    machine.write_text(dump_machine(cpu(2)))  # two ranks; their figures: the roofline's
    args = ["profile", str(model), "--batch", "8", "--machine", str(machine)]
    assert cli([*args, "--device", "cuda", "--ranks", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "in-step calibration: backward " in out, out
    db = sqlite3.connect(tmp_path / "gpu.costs.sqlite")
    (doc,) = db.execute("SELECT doc FROM fingerprints").fetchone()
    assert json.loads(doc)["kind"] == "cuda"
    joined = "SELECT COUNT(*) FROM in_step JOIN timings USING (fingerprint, phase, key)"
    assert db.execute(joined).fetchone()[0] > 0
    plan = tmp_path / "plan.json"
    plan_args = ["plan", str(model), "--batch", "8", "--machine", str(machine)]
    assert cli([*plan_args, "--strategy", "data-parallel", "-o", str(plan)]) == 0
    assert "costs: profiled (" in capsys.readouterr().out
    assert cli(["simulate", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["costs"] == "profiled"
