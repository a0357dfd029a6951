"""The memory model against the executor's measured peak (``--trace``: tracemalloc on CPU
ranks, counted from just before the Runtime is built), on small plans of five models: the
CNN, BatchNorm's, an embedding's, and the recurrent ones (LSTM, GRU), whose kernels hold
every step's states and gate activations.

A step's arrays are freed when it ends (no reference cycle holds them), so the peak is
a property of the plan. Batches are large enough that numpy's arrays, which the model is
about, dominate Python's own objects (the program, the trace events); the recurrent
models' are larger still, their steps being cheap. The model counts the runtime's Python
objects too; test_memory_sequences.py checks it at the fidelity benchmark's small batches,
where they are a third of lstm_lm's and gpt2's measured peak.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onnx2soap.importer import load_model
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.presets import cpu
from onnx2soap.soap import Partitioner, analyze, import_loss, load_plan
from tests.executor.mpi import make_plan, mpirun
from tests.sequence_models import export_sequence

pytestmark = pytest.mark.mpi

TOLERANCE = 0.10
# A sent array is let go once its send completes, which the sender sees at its next call
# into the transport after the receiver has taken it (executor/transport.py); the model
# keeps it through the kernel that reads it. Where sent pieces are a large share of a
# rank's peak, the measured peak moves with how soon each side calls into MPI: the
# tokens plan's strided LayerNorm pieces, sent early and read late, were measured at
# 3.85-4.16 MB against 4.41 priced (the receiver takes them well before its reader);
# the CNN's 3-rank plan's device 2, whose AveragePool sends 0.5 MB of gradient pieces
# to pool1's devices, at 6.66-7.19 MB against 7.60.
RACY = 0.15
CASES = [  # model, batch, ranks, strategy, seed[, tolerance]
    ("cnn", 32, 2, "random", 1),
    ("cnn", 32, 3, "random", 2, RACY),
    ("cnn", 32, 2, "data-parallel", 0),
    ("bnnet", 64, 3, "random", 3),
    ("bnnet", 64, 2, "data-parallel", 0),
    ("tokens", 1024, 2, "random", 1, RACY),
    ("lstm_lm", 256, 2, "random", 1),
    ("lstm_lm", 256, 2, "data-parallel", 0),
    ("gru_classifier", 512, 2, "random", 1),
]
SEQUENCE = {"lstm_lm", "gru_classifier"}  # tests/sequence_models.py


def predicted(plan_path: Path) -> tuple[int, ...]:
    plan = load_plan(plan_path)
    graph = load_model(plan.model_path, plan.batch, import_loss(plan)).graph
    pg = Partitioner(graph).partition(plan.strategy(graph, analyze(graph)))
    simulator = Simulator(cpu(plan.devices), RooflineCost(), bucket_mb=plan.bucket_mb)
    return simulator.evaluate(pg).peak_memory_bytes


@pytest.mark.parametrize(
    ("name", "batch", "ranks", "strategy", "seed", "tolerance"),
    [case if len(case) == 6 else (*case, TOLERANCE) for case in CASES],
)
def test_peak_memory_within_ten_percent_of_measured(
    export_model, example_onnx: Path, tmp_path: Path, name, batch, ranks, strategy, seed, tolerance
) -> None:
    if name in SEQUENCE:
        model = export_sequence(name, tmp_path)
    else:
        model = example_onnx if name == "cnn" else export_model(name)
    plan = tmp_path / "plan.json"
    make_plan(model, plan, ranks, batch, strategy, seed)
    trace = tmp_path / "measured.json"
    run = mpirun(plan, ranks, tmp_path, "--steps", "3", "--trace", str(trace))
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(trace.read_text())["otherData"]["peak_memory_bytes"]
    for rank, (p, m) in enumerate(zip(predicted(plan), measured, strict=True)):
        assert abs(p - m) <= tolerance * m, f"rank {rank}: predicted {p}, measured {m}"
