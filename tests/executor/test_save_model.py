"""``--save-model``: the trained model back in ONNX, loadable by onnxruntime.

After two steps on a random 2-rank plan, the saved file holds exactly the trained
weights (those ``--save-weights`` writes), and onnxruntime's outputs on a batch equal the
executor's one-device forward of that file (float32, 1e-5): for a CNN, a token model
(int64 ids) and a tied embedding, and for a dynamo export whose weights live in external
data (written beside the output as OUT.onnx.data). A model whose trained tensors are not
all initializers, or an unwritable output, is refused in one line before training.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from mpi4py import MPI
from onnx import numpy_helper

from executor.device import CpuDevice
from executor.program import compile_program
from executor.runtime import Batch, Runtime
from executor.transport import MpiTransport
from onnx2soap.importer import load_model
from onnx2soap.ir import LossKind
from onnx2soap.search.baselines import data_parallel
from onnx2soap.soap import Partitioner, analyze
from tests.executor.mpi import make_plan, mpirun
from tests.models import MODELS

pytestmark = pytest.mark.mpi
BATCH = 4


def _batch(name: str, graph) -> dict[str, np.ndarray]:
    spec, rng = MODELS[name], np.random.default_rng(2)
    (input_name,) = graph.inputs
    shape = graph.tensors[input_name].shape
    if spec.ids:
        return {input_name: rng.integers(0, spec.ids, shape)}
    return {input_name: rng.standard_normal(shape).astype(np.float32)}


def _executor_forward(path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    model = load_model(path, BATCH, LossKind.NONE)
    graph = model.graph
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))
    rt = Runtime(
        pg,
        compile_program(pg, 0),
        MpiTransport(MPI.COMM_SELF, CpuDevice()),
        {**model.weights, **model.state},
        np.float32,
        model.constants,
    )
    feed = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in inputs.items()}
    tiles = rt.forward(Batch(feed, np.zeros(BATCH, np.int64)))
    return tiles[(graph.producer(graph.output).name, 0)]


@pytest.mark.parametrize(
    ("name", "exporter"),
    [("cnn", "legacy"), ("tokens", "legacy"), ("tied", "legacy"), ("cnn", "dynamo")],
)
def test_saved_model_runs_in_onnxruntime_like_the_executor(export_model, tmp_path, name, exporter):
    source = export_model(name, exporter)
    plan = tmp_path / "plan.json"
    make_plan(source, plan, 2, BATCH, "random", seed=3)
    out = tmp_path / "trained.onnx"
    run = mpirun(plan, 2, tmp_path, "--steps", "2", "--lr", "0.1", "--save-model", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "trained.onnx.data").exists() == (exporter == "dynamo")
    saved = {i.name: numpy_helper.to_array(i) for i in onnx.load(out).graph.initializer}
    for param, value in run.weights.items():  # exactly what --save-weights holds
        np.testing.assert_array_equal(saved[param], value.astype(saved[param].dtype), err_msg=param)
    graph = load_model(out, BATCH, LossKind.NONE).graph
    inputs = _batch(name, graph)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    expected = session.run(None, inputs)[0]
    got = _executor_forward(out, inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_an_unwritable_model_output_is_refused_before_training(export_model, tmp_path):
    plan = tmp_path / "plan.json"
    make_plan(export_model("cnn"), plan, 2, BATCH, "data-parallel")
    blocker = tmp_path / "file"
    blocker.write_text("")
    run = mpirun(plan, 2, tmp_path, "--steps", "1", "--save-model", str(blocker / "out.onnx"))
    assert run.returncode == 2 and "cannot write" in run.stderr
    assert not any(line.startswith('{"step"') for line in run.stdout.splitlines())
