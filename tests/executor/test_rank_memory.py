"""Each rank holds only its shards: a model split over more ranks takes less memory per
rank, and every rank's measured peak RSS, less an idle executor's, is the memory model's
peak within 20 %.

The model is an MLP of eight 4096x4096 float32 layers (537 MB) on a sparse file; the
plans split it model-parallel over 1, 2 and 4 ranks, and over 2 in bf16 mixed
precision. An idle executor is the idle rank of a single-device plan on 2 ranks: the
same interpreter, libraries, graph and plan, no shards. Peak RSS is what each rank's
kernel reports (``ru_maxrss``), in the run's summary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sparse_mlp import write_sparse_mlp
from onnx2soap.cli import main as onnx2soap_main
from tests.executor.mpi import MPIEXEC, make_plan

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
LAYERS, HIDDEN, BATCH = 8, 4096, 8


def _run(plan: Path, ranks: int) -> tuple[list[int], list[int]]:
    """Measured peak RSS per rank (the run's summary) and the plan's simulated peaks."""
    command = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "executor", "run"]
    command += [str(plan), "--steps", "1", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (summary,) = [json.loads(x)["summary"] for x in done.stdout.splitlines() if "summary" in x]
    simulated = json.loads(plan.read_text())["predicted"]["peak_memory_bytes"]
    return summary["peak_rss_bytes"], simulated


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("rank_memory")
    mlp = write_sparse_mlp(folder, LAYERS, HIDDEN)
    runs = {}
    for name, ranks, rule in (
        ("idle", 2, "single-device"),
        (1, 1, "model-parallel"),
        (2, 2, "model-parallel"),
        (4, 4, "model-parallel"),
    ):
        plan = folder / f"{name}.json"
        make_plan(mlp.model, plan, ranks, BATCH, rule)
        runs[name] = _run(plan, ranks)
    # bf16 mixed precision: a half-format copy of each weight, rounding's temporaries
    plan = folder / "bf16.json"
    argv = ["plan", str(mlp.model), "--batch", str(BATCH), "--devices", "2", "--precision"]
    assert onnx2soap_main([*argv, "bf16", "--strategy", "model-parallel", "-o", str(plan)]) == 0
    runs["bf16"] = _run(plan, 2)
    return runs


def test_memory_per_rank_falls_with_the_number_of_ranks(measured) -> None:
    idle = measured["idle"][0][1]
    used = {n: max(measured[n][0]) - idle for n in (1, 2, 4)}
    # halved weights and gradients, and a little that every rank holds (activations)
    assert used[4] < 0.7 * used[2] and used[2] < 0.7 * used[1], used
    # no rank of the 4-rank run holds the whole model's weights, rank 0 included
    weights = LAYERS * HIDDEN * HIDDEN * 4
    assert used[4] < 0.8 * weights, used


def test_measured_peaks_are_the_memory_models_within_20_percent(measured) -> None:
    idle = measured["idle"][0][1]
    for n in (1, 2, 4, "bf16"):
        peaks, simulated = measured[n]
        for rank, (peak, predicted) in enumerate(zip(peaks, simulated, strict=True)):
            error = abs(peak - idle - predicted) / predicted
            assert error <= 0.2, f"{n} ranks, rank {rank}: {peak - idle} vs {predicted}"
