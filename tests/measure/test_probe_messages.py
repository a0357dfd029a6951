"""The message probe (``measure/probe_messages.py``): its premise, checked on the simulator
with hand-computed link costs, and the probe itself under mpiexec."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from onnx2soap.measure.probe_messages import (
    BATCH,
    CHAIN_OPS,
    WIDTH,
    _data_parallel,
    _plan,
    chain_model,
    norm_chain_model,
)
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.presets import resolve_machine
from onnx2soap.sim.taskgraph import TaskKind
from tests.sim.tiny import LINK_BW, LINK_LATENCY, round_machine

ROOT = Path(__file__).resolve().parents[2]


def test_alternating_chain_puts_every_message_on_the_critical_path(tmp_path: Path) -> None:
    """What the probe divides by: the alternating plan's step exceeds the one-rank step
    by exactly its messages' link times, one tile forward and one gradient back per op
    boundary, none of them overlapping compute or each other."""
    graph = chain_model(tmp_path).graph
    sim = Simulator(round_machine(2), RooflineCost())
    alone = sim.evaluate(_plan(graph, 2, 0)).step_time_s
    apart = sim.evaluate(_plan(graph, 2, 1)).step_time_s
    boundaries = len(graph.ops) - 1  # the Relus and the attached loss, in a chain
    assert len(graph.ops) == CHAIN_OPS + 1
    tile = BATCH * WIDTH * 4
    message = 2 * LINK_LATENCY + tile / LINK_BW  # a route is two links
    assert apart - alone == pytest.approx(2 * boundaries * message, rel=1e-9)


@pytest.mark.parametrize("ranks", [2, 3])
def test_ring_probe_reads_the_statistics_rings_the_simulator_runs(tmp_path: Path, ranks) -> None:
    """What the ring probe reads: per rank, the data-parallel norm chain sums each
    BatchNormalization's statistics (forward and backward) in a ring over every rank,
    traced as ``stats OP fwd/bwd``; the simulator runs each as one task of 2 (ranks - 1)
    steps of ``ring_step_latency`` (and its few bytes: under 1 % of it), so the ring's
    time over its steps is that latency."""
    from executor.program import ReduceStats, compile_program
    from executor.trace import task_name

    graph = norm_chain_model(tmp_path, ranks).graph
    assert sum(op.type == "BatchNormalization" for op in graph.ops) == CHAIN_OPS
    spread = _data_parallel(graph, ranks)
    for rank in range(ranks):
        stats = [
            x for x in compile_program(spread, rank).instructions if isinstance(x, ReduceStats)
        ]
        assert len(stats) == 2 * CHAIN_OPS
        assert all(x.devices == tuple(range(ranks)) for x in stats)
        assert all(task_name(spread, x)[0].startswith("stats ") for x in stats)
    step = 7e-6
    machine = replace(resolve_machine(f"cpu:{ranks}"), ring_step_latency=step)  # GB/s links
    tg = Simulator(machine, RooflineCost()).task_graph(spread, names=True)
    rings = [i for i, name in enumerate(tg.names) if name.startswith("stats ")]
    assert len(rings) == 2 * CHAIN_OPS
    for i in rings:
        assert tg.kind[i] == TaskKind.ALLREDUCE
        latency = 2 * (ranks - 1) * step
        assert latency <= tg.duration[i] <= 1.01 * latency  # and its few bytes' time


@pytest.mark.mpi
def test_probe_measures_a_message_as_the_runtime_pays_it(tmp_path: Path) -> None:
    """Under mpiexec on two ranks: a positive cost per message, above what the bare
    transport's calls cost, and below a millisecond; each end busy for some of it."""
    script = tmp_path / "probe.py"
    script.write_text(
        "from mpi4py import MPI\n"
        "from onnx2soap.measure.probe_messages import message_costs\n"
        "(c,) = message_costs(MPI.COMM_WORLD, False)\n"
        "if MPI.COMM_WORLD.Get_rank() == 0: print(c.seconds, c.busy)\n"
    )
    mpiexec = Path(sys.executable).parent / "mpiexec"
    done = subprocess.run(
        [str(mpiexec), "-n", "2", sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seconds, busy = map(float, done.stdout.split())
    assert 1e-6 < seconds < 1e-3
    assert 0 < busy < 1e-3  # spinning ranks: about the whole message, or more
