"""The memory model against the measured peak (``--trace``) at the fidelity benchmark's
small batches (lstm_lm 32, gpt2 16), where the runtime's own Python objects (about 1 kB
an instruction and 0.95 kB a piece: ``memory.PER_INSTRUCTION``, ``PER_PIECE``) are a
third of a rank's peak: without them the model missed lstm_lm by up to 36 % and gpt2 by
up to 35 %. Plans with few tasks (data parallel) and many (random: hundreds of
instructions and transfers a rank), and context parallelism's streamed attention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.executor.mpi import make_plan, mpirun
from tests.sequence_models import export_sequence
from tests.sim.test_memory_measured import TOLERANCE, predicted

pytestmark = pytest.mark.mpi

CASES = [  # model, batch, strategy, seed
    ("lstm_lm", 32, "data-parallel", 0),
    ("lstm_lm", 32, "random", 2),
    ("gpt2", 16, "data-parallel", 0),
    ("gpt2", 16, "random", 4),
    # context parallelism: each attention task takes K and V block by block (ring
    # attention), the received pieces copied in as its kernel reaches them
    ("gpt2", 16, "context", 0),
]


@pytest.fixture(scope="session")
def sequence_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sequence_memory")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:  # gpt2 as benchmarks/fidelity.py exports it
            made[name] = export_sequence(name, folder, "dynamo" if name == "gpt2" else "legacy")
        return made[name]

    return get


@pytest.mark.parametrize(("name", "batch", "strategy", "seed"), CASES)
def test_small_batch_peak_within_ten_percent_of_measured(
    sequence_model, tmp_path: Path, name, batch, strategy, seed
) -> None:
    plan = tmp_path / "plan.json"
    make_plan(sequence_model(name), plan, 2, batch, strategy, seed)
    trace = tmp_path / "measured.json"
    run = mpirun(plan, 2, tmp_path, "--steps", "3", "--trace", str(trace))
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(trace.read_text())["otherData"]["peak_memory_bytes"]
    working = {d for op in json.loads(plan.read_text())["ops"] for d in op["devices"]}
    for rank, (p, m) in enumerate(zip(predicted(plan), measured, strict=True)):
        if rank in working:
            assert abs(p - m) <= TOLERANCE * m, f"rank {rank}: predicted {p}, measured {m}"
