"""Data from files: streamed, shuffled, evaluated, and refused in one line when bad.

- A folder of .npy (memory-mapped) with several batches, shuffled each epoch from the
  seed: N ranks train like one device over more than two epochs; the order is the same
  from run to run and differs from epoch to epoch; a rank reads only its rows.
- ``--eval-data``: the evaluation loss and accuracy equal what onnxruntime computes
  with the model the run saves (``--save-model``).
- Bad data (a missing array, a wrong shape or dtype, a label out of range, a truncated
  file) is one line naming the file and the array, exit 2, whichever rank reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from executor.dataset import open_dataset
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import Partitioner, analyze
from tests.executor.mpi import assert_same_training, cnn_data_folder, make_plan, mpirun

pytestmark = pytest.mark.mpi
BATCH, SAMPLES = 4, 18  # 4 batches an epoch, 2 samples dropped


def _folder(path: Path, samples: int = SAMPLES, seed: int = 0) -> Path:
    return cnn_data_folder(path, samples, seed)


@pytest.fixture(scope="module")
def cnn(export_model, tmp_path_factory):
    model = export_model("cnn")
    folder = tmp_path_factory.mktemp("data")
    one, three = folder / "one.json", folder / "three.json"
    make_plan(model, one, 1, BATCH, "data-parallel")
    make_plan(model, three, 3, BATCH, "random", seed=2)
    return model, one, three, _folder(folder / "train")


def test_shuffled_epochs_stream_and_train_like_one_device(cnn, tmp_path: Path):
    _, one, three, data = cnn
    args = ("--steps", "9", "--dtype", "float64", "--data", str(data), "--shuffle", "--seed", "5")
    ref = mpirun(one, 1, tmp_path, *args)
    assert ref.returncode == 0, ref.stderr[-2000:]
    again = mpirun(one, 1, tmp_path, *args)
    assert again.losses == ref.losses  # the same order from run to run
    unshuffled = mpirun(one, 1, tmp_path, *args[:-3])
    assert unshuffled.losses[4:] != ref.losses[4:]
    run = mpirun(three, 3, tmp_path, *args)
    assert_same_training(run, ref.losses, ref.weights, rtol=1e-10)


def test_epochs_are_permutations_and_a_rank_reads_its_rows(cnn):
    model, _, _, data = cnn
    graph = load_model(model, BATCH).graph
    dataset = open_dataset(data, graph, np.dtype(np.float64), shuffle_seed=5)
    assert isinstance(dataset.arrays["labels"], np.memmap)
    epochs = [np.concatenate([dataset.indices(e * 4 + b) for b in range(4)]) for e in (0, 1)]
    for seen in epochs:
        assert len(set(seen.tolist())) == 16 and seen.max() < SAMPLES
    assert not np.array_equal(epochs[0], epochs[1])
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 2))
    rows = pg.data_rows(1)
    batch = dataset.batch(5, rows)
    (name,) = graph.inputs
    assert batch.inputs[name].shape[0] == 2  # half the batch: rank 1's rows only
    whole = np.load(data / "input.npy")[dataset.indices(5)]
    np.testing.assert_array_equal(batch.inputs[name], whole[2:4])


def test_evaluation_equals_onnxruntime_on_the_saved_model(cnn, tmp_path: Path):
    _, _, three, data = cnn
    evaluation = _folder(tmp_path / "eval", samples=12, seed=3)
    out, metrics = tmp_path / "trained.onnx", tmp_path / "run.jsonl"
    args = ("--steps", "3", "--data", str(data), "--eval-data", str(evaluation))
    run = mpirun(three, 3, tmp_path, *args, "--save-model", str(out), "--metrics", str(metrics))
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert "summary" in lines[-1]  # the run's summary comes last
    lines = lines[:-1]
    assert [line["step"] for line in lines] == [1, 2, 3, 3]
    final = lines[-1]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = np.load(evaluation / "input.npy").astype(np.float32)
    y = np.load(evaluation / "labels.npy")
    logits = np.concatenate(
        [session.run(None, {"input": x[i : i + BATCH]})[0] for i in range(0, 12, BATCH)]
    ).astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    losses = [-log_p[i : i + BATCH][np.arange(BATCH), y[i : i + BATCH]].mean() for i in (0, 4, 8)]
    assert final["eval_loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert final["eval_accuracy"] == pytest.approx((logits.argmax(axis=1) == y).mean())


def _refusal(plan: Path, ranks: int, tmp_path: Path, data: Path) -> str:
    run = mpirun(plan, ranks, tmp_path, "--steps", "6", "--data", str(data))
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("executor")]
    assert len(lines) == 1, run.stderr
    return lines[0]


@pytest.mark.parametrize("fault", ["missing", "shape", "dtype", "label", "truncated"])
def test_bad_data_is_one_line_naming_the_array(cnn, tmp_path: Path, fault: str):
    _, _, three, _ = cnn
    data = _folder(tmp_path / "bad")
    if fault == "missing":
        (data / "labels.npy").unlink()
        said = "labels"
    elif fault == "shape":
        np.save(data / "input.npy", np.zeros((SAMPLES, 3, 16, 16)))
        said = "'input' has shape"
    elif fault == "dtype":
        np.save(data / "labels.npy", np.zeros(SAMPLES, dtype=np.float32))
        said = "'labels' must hold integer class ids"
    elif fault == "label":
        labels = np.load(data / "labels.npy")
        labels[13] = 10  # read in the fourth batch, by whichever ranks hold row 1
        np.save(data / "labels.npy", labels)
        said = "'labels' sample 13"
    else:
        blob = (data / "input.npy").read_bytes()
        (data / "input.npy").write_bytes(blob[: len(blob) // 2])
        said = "input.npy"
    line = _refusal(three, 3, tmp_path, data)
    assert said in line and str(data) in line, line
