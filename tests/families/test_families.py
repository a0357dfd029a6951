"""torchvision's CNN families, as a user brings them: imported from both exporters, and
trained on random plans of 2-4 ranks exactly like one device (float64, 1e-10, 2 steps)
under a real mpiexec, with BatchNorm (training mode), Dropout and stochastic depth on as
torchvision sets them. The search finds plans no slower than data parallelism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onnx2soap.cli import main as onnx2soap_main
from onnx2soap.importer import load_model
from onnx2soap.ir import DType, TensorRole
from tests.executor.mpi import assert_same_training, make_plan, mpirun, reference
from tests.families.conftest import BATCH, FAMILIES

STEPS, LR = 2, 0.05


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_imports(family_onnx, name: str, exporter: str) -> None:
    model = load_model(family_onnx(name, exporter), BATCH)
    graph = model.graph
    norms = [op for op in graph.ops if op.type == "BatchNormalization"]
    if exporter == "legacy" and name != "squeezenet1_1":
        # TRAINING mode: statistics synchronized across splits, running stats are state.
        assert norms and all(op.nest.sync_dims for op in norms)
        assert graph.states and all(t.role is TensorRole.STATE for t in graph.states)
    # dynamo writes BatchNorm in inference mode (and folds it into the convolutions)
    assert all(not op.nest.sync_dims for op in norms) or exporter == "legacy"
    assert graph.weights and graph.loss_op is not None


def _train_like_one_device(model: Path, tmp_path: Path, ranks: int, seed: int) -> None:
    one = tmp_path / "one.json"
    make_plan(model, one, 1, BATCH, "data-parallel")
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    plan = tmp_path / f"random-{ranks}.json"
    make_plan(model, plan, ranks, BATCH, "random", seed)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")
    run = mpirun(plan, ranks, tmp_path, *args)
    assert_same_training(run, losses, weights, rtol=1e-10)


@pytest.mark.mpi
@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_trains_like_one_device(family_onnx, tmp_path: Path, name: str, exporter) -> None:
    # 2, 3 and 4 ranks across the families and exporters; one random plan each.
    ranks = 2 + (FAMILIES.index(name) + (exporter == "dynamo")) % 3
    _train_like_one_device(family_onnx(name, exporter), tmp_path, ranks, seed=11)


@pytest.mark.parametrize("name", FAMILIES)
def test_search_is_no_slower_than_data_parallel(family_onnx, tmp_path: Path, name, capsys):
    model = family_onnx(name, "legacy")
    args = ["plan", str(model), "--batch", "32", "--machine", "flexflow-p100:4"]
    args += ["--max-evals", "150", "--seed", "0", "--json", "-o", str(tmp_path / "p.json")]
    assert onnx2soap_main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["predicted_step_time_s"] <= report["baselines"]["data-parallel"] * (1 + 1e-9)
