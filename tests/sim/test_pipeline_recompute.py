"""Recomputation in the simulator, against time and memory by hand.

x [4, 8] -> gemm = Gemm(W [8, 4]) -> relu -> cross-entropy on one device of
``tiny.round_machine`` (1 FLOP takes 1 ns): gemm's forward 2*4*8*4 = 256 ns, relu's 16,
the loss's 64; backward twice the forward; SGD on W, 2 * 32 ns. A recomputed op's
backward first runs its forward again, so the step grows by exactly that forward, and
its output tile (4 * 4 floats, 64 bytes) is no longer held from forward to backward.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from onnx2soap.sim import RooflineCost, make_simulator
from onnx2soap.sim.delta import DeltaSimulator
from onnx2soap.sim.simulate import simulate
from onnx2soap.soap import ParallelConfig, Partitioner, Strategy, analyze
from onnx2soap.soap.dims import DimKind
from onnx2soap.soap.pipeline import Pipeline, Schedule
from tests.sim.test_pipeline_price import B, F, _graph, _two_stages
from tests.sim.tiny import round_machine, tiny_graph

NS = 1e-9
PLAIN_STEP = (256 + 16 + 64) * 3 * NS + 64 * NS  # forward, backward (twice), update


def _one_device(tmp_path: Path):
    graph = tiny_graph(tmp_path, batch=4, relu=True)
    space = analyze(graph)
    strategy = Strategy(
        1, {o.name: ParallelConfig((1,) * len(space[o.name]), (0,)) for o in graph.ops}
    )
    return Partitioner(graph), strategy


@pytest.mark.parametrize(
    ("recompute", "forward_ns"),
    [((), 0), (("relu",), 16), (("gemm",), 256), (("gemm", "relu"), 272)],
)
def test_the_step_pays_the_recomputed_forward(tmp_path, recompute, forward_ns) -> None:
    partitioner, strategy = _one_device(tmp_path)
    pg = partitioner.partition(strategy)
    sim = make_simulator(round_machine(1), RooflineCost(), recompute=recompute)
    ev = sim.evaluate(pg)
    assert ev.step_time_s == pytest.approx(PLAIN_STEP + forward_ns * NS, rel=1e-9)
    # the recomputation runs just before the op's backward, after the gradient reaches it
    tg = sim.task_graph(pg, names=True)
    timeline = simulate(tg)
    for op in recompute:
        redo = tg.names.index(f"recompute {op}[0]")
        backward = tg.names.index(f"bwd {op}[0]")
        assert timeline.end[redo] == pytest.approx(timeline.start[backward])
    # delta simulation (the search's) gives the same figures
    assert DeltaSimulator(sim, partitioner).evaluate(strategy)[0] == ev


def test_recomputing_a_tile_not_alive_at_the_peak_changes_nothing(tmp_path) -> None:
    """The peak is in gemm's backward (first in graph order, last in the backward): 772
    bytes (tests/sim/test_memory_rows.py's accounting: the batch, W, its gradient and
    the buffers, the loss's scalar, and gemm's output gradient, which is relu's input
    gradient read whole). Neither tile lives then: relu's went after the loss's
    backward, which read it in place, and gemm's after relu's (Relu's backward reads
    its input; Gemm's reads its inputs only). Recomputed, either is made again for the
    backward that reads it and let go after it: the peak stays. (Where it did not,
    making gemm's tile again for its own backward cost 64 bytes: the executor's test of
    a recomputing MLP shows what recomputation saves.)"""
    partitioner, strategy = _one_device(tmp_path)
    pg = partitioner.partition(strategy)

    def peak(*recompute: str) -> int:
        sim = make_simulator(round_machine(1), RooflineCost(), recompute=recompute)
        return sim.evaluate(pg).peak_memory_bytes[0]

    assert peak() == 772 == peak("relu") == peak("gemm") == peak("gemm", "relu")


def test_a_recomputed_stage_pays_its_forward_in_its_backward(tmp_path) -> None:
    """The two-stage pipeline of test_pipeline_price.py with every op but the loss
    recomputed: each stage's backward is b + its recomputed forward (g1's 64 ns; g2's
    2*2*2*4 = 32 ns), so the step grows."""
    pg, stages = _two_stages(_graph(tmp_path))
    pipeline = Pipeline(stages, 4, Schedule.ONE_F_ONE_B)
    machine = round_machine(2)
    plain = make_simulator(machine, RooflineCost(), pipeline=pipeline).evaluate(pg)
    redo = make_simulator(machine, RooflineCost(), pipeline=pipeline, recompute=("g1", "g2"))
    ev = redo.evaluate(pg)
    times = [s.times for s in ev.pipeline.stages]
    assert [t.backward_s for t in times] == pytest.approx([B + F, B + 32 * NS])
    assert [t.forward_s for t in times] == pytest.approx([F, F])
    assert ev.step_time_s > plain.step_time_s
    # Stage 0 no longer holds g1's 16-byte tile for a second microbatch, but the
    # transport holds the piece of it sent to stage 1 (all of it) until the step ends,
    # recomputed or not: at B2, one microbatch held and two closed, 16 + 2 * 16 either
    # way. Stage 1 (one microbatch held under 1F1B): g2's 32-byte tile, which the loss
    # reads in place and keeps for its backward, is made again for it and let go after
    # it (g2's own backward does not read it), as the plain step lets it go: unchanged.
    assert ev.peak_memory_bytes == plain.peak_memory_bytes


def test_the_loss_and_a_partial_sum_are_kept_whatever_the_plan_says(tmp_path) -> None:
    """As the executor (executor/recompute.py, soap/recompute.py): the loss is a scalar,
    and gemm split over 2 devices on its reduction dim outputs a partial sum whose sum
    would take its all-reduce again. Named in ``recompute``, neither changes the step,
    its memory or its tasks."""
    graph = tiny_graph(tmp_path, batch=4, relu=True)
    space = analyze(graph)
    configs = {}
    for op in graph.ops:
        degrees = tuple(
            2 if d.kind is DimKind.REDUCTION and op.name == "gemm" else 1 for d in space[op.name]
        )
        configs[op.name] = ParallelConfig(degrees, (0, 1) if 2 in degrees else (0,))
    pg = Partitioner(graph).partition(Strategy(2, configs))
    assert pg.sums["gemm"]
    loss = graph.loss_op.name

    def evaluated(*recompute: str):
        sim = make_simulator(round_machine(2), RooflineCost(), recompute=recompute)
        return sim.evaluate(pg), sim.task_graph(pg, names=True).names

    plain, names = evaluated()
    kept, kept_names = evaluated("gemm", loss)
    assert kept == plain and kept_names == names
    _, redone_names = evaluated("gemm", "relu", loss)
    assert "recompute relu[0]" in redone_names and not any(
        n.startswith(("recompute gemm", f"recompute {loss}")) for n in redone_names
    )
