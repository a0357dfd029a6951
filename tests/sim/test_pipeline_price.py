"""A pipeline plan priced by the simulator, against step times and memory by hand.

The model: x [B, 8] -> g1 = Gemm(W1 [8, 2]) -> g2 = Gemm(W2 [2, 4]) -> cross-entropy,
on ``tiny.round_machine`` (1 FLOP takes 1 ns; a route is two links of 1 us latency and
1 byte/us: b bytes take 2 us + b us). Per sample, g1's forward is 2*8*2 = 32 FLOPs and
g2's with the loss 2*2*4 + 4*4 = 32: a stage of g1 and one of g2 and the loss take equal
time. Backward is twice the forward (RooflineCost), SGD's update 2 FLOPs an element.
Microbatches of 2 samples: f = 64 ns, b = 128 ns on each stage.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnx2soap.importer import load_model
from onnx2soap.ir import Graph
from onnx2soap.search.baselines import Rule, by_rule
from onnx2soap.sim import RooflineCost, make_simulator
from onnx2soap.sim.machine import Resume
from onnx2soap.sim.memory import peak_memory
from onnx2soap.sim.pipeline_price import makespans
from onnx2soap.sim.presets import cpu
from onnx2soap.sim.simulate import simulate
from onnx2soap.sim.taskgraph import build_task_graph
from onnx2soap.soap import ParallelConfig, Partitioner, Strategy, analyze
from onnx2soap.soap.pipeline import Pipeline, Schedule
from tests.sim.tiny import round_machine, tiny_graph

NS, US = 1e-9, 1e-6
F, B = 64 * NS, 128 * NS  # a microbatch's forward and backward on either stage
TAIL0, TAIL1 = 2 * 16 * NS, 2 * 8 * NS  # SGD on W1 (16 elements), on W2 (8)


def two_gemms(path: Path) -> Path:
    w1 = numpy_helper.from_array(np.ones((8, 2), np.float32), "W1")
    w2 = numpy_helper.from_array(np.ones((2, 4), np.float32), "W2")
    nodes = [
        helper.make_node("Gemm", ["x", "W1"], ["y"], name="g1"),
        helper.make_node("Gemm", ["y", "W2"], ["logits"], name="g2"),
    ]
    graph = helper.make_graph(
        nodes,
        "two",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", 4])],
        [w1, w2],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _graph(tmp_path: Path, microbatch: int = 2) -> Graph:
    return load_model(two_gemms(tmp_path / "two.onnx"), batch=microbatch).graph


def _two_stages(graph: Graph):
    """g1 on device 0 (stage 0), g2 and the loss on device 1 (stage 1)."""
    space = analyze(graph)
    configs = {
        op.name: ParallelConfig((1,) * len(space[op.name]), (0 if op.name == "g1" else 1,))
        for op in graph.ops
    }
    stages = (("g1",), tuple(op.name for op in graph.ops if op.name != "g1"))
    return Partitioner(graph).partition(Strategy(2, configs)), stages


def _fast_links(devices: int):
    """Links so fast that a move costs nothing: the stages' passes alone."""
    return replace(cpu(devices, round_machine(1).devices[0], 1e30, 0.0))


@pytest.mark.parametrize("schedule", list(Schedule))
def test_balanced_stages_take_m_plus_s_minus_one_passes(tmp_path, schedule) -> None:
    pg, stages = _two_stages(_graph(tmp_path))
    sim = make_simulator(_fast_links(2), RooflineCost(), pipeline=Pipeline(stages, 4, schedule))
    ev = sim.evaluate(pg)
    # (M + S - 1)(f + b), then stage 0's update (its last backward ends the step's passes)
    assert ev.step_time_s == pytest.approx((4 + 2 - 1) * (F + B) + TAIL0, rel=1e-9)
    times = [s.times for s in ev.pipeline.stages]
    assert [t.forward_s for t in times] == pytest.approx([F, F])
    assert [t.backward_s for t in times] == pytest.approx([B, B])
    assert [t.tail_s for t in times] == pytest.approx([TAIL0, TAIL1])
    assert [s.devices for s in ev.pipeline.stages] == [(0,), (1,)]
    held = [4, 4] if schedule is Schedule.GPIPE else [2, 1]  # 1F1B: min(S - s, M)
    assert [s.held for s in ev.pipeline.stages] == held


@pytest.mark.parametrize("schedule", list(Schedule))
def test_stages_sharing_a_core_take_turns(tmp_path, schedule) -> None:
    """The two stages' ranks on one core (``Machine.cores``): their passes cannot run at
    once, so the step is every pass one after the other, 2 M (f + b), then the two
    stages' updates in turn, where a core each overlaps them to (M + S - 1)(f + b)."""
    pg, stages = _two_stages(_graph(tmp_path))
    shared = replace(_fast_links(2), cores=1)
    sim = make_simulator(shared, RooflineCost(), pipeline=Pipeline(stages, 4, schedule))
    step = 2 * 4 * (F + B) + TAIL0 + TAIL1
    assert sim.evaluate(pg).step_time_s == pytest.approx(step, rel=1e-9)


def test_moves_between_stages_by_hand(tmp_path) -> None:
    """Slow links: y [2, 2] (16 bytes) goes to stage 1 in 18 us and its gradient comes
    back in 18 us, one microbatch at a time per direction. GPipe: stage 1's forward of
    microbatch 3 starts when the 4th move lands (64 ns + 4 * 18 us) and ends 64 ns later;
    its first backward 128 ns after; then four gradients one after the other, the last
    landing at 72 us + 256 ns + 4 * 18 us, and stage 0's last backward and update."""
    pg, stages = _two_stages(_graph(tmp_path))
    pipeline = Pipeline(stages, 4, Schedule.GPIPE)
    ev = make_simulator(round_machine(2), RooflineCost(), pipeline=pipeline).evaluate(pg)
    first = ev.pipeline.stages[0].times
    assert first.send_forward_s == pytest.approx(18 * US) == first.send_backward_s
    landed = 64 * NS + 4 * 18 * US + 64 * NS + 128 * NS + 4 * 18 * US
    assert ev.step_time_s == pytest.approx(landed + B + TAIL0, rel=1e-9)
    assert ev.bytes_moved == 4 * (16 + 16)  # every microbatch's y and its gradient


def test_one_f_one_b_holds_fewer_microbatches(tmp_path) -> None:
    """With M = 4 > S = 2, stage 0 holds 2 microbatches' activations under 1F1B and 4
    under GPipe, stage 1 holds 1 against 4; the executor makes a slot of buffers per
    microbatch open at once (``open_at_most``): 2 on each stage under 1F1B (stage 1's
    next microbatch opens with the receive stage 0's forward posts), 4 under GPipe.

    A held microbatch's activations: on device 0 none (g1's tile y [2, 2] goes once its
    one reader, the send to stage 1, has completed: g1's backward does not read it); on
    device 1 g2's tile [2, 4] (32), the loss's scalar (4) and y's input buffer (16: the receive
    buffer of its one piece, made by the step that posts the receive and kept for g2's
    backward): 52. A slot's buffers: on device 0 x's input buffer [2, 8] (64; g1's
    output gradient arrives in a receive buffer the step makes); on device 1 the labels
    [2] (int64, 16) (g2's gradient buffer is the loss's input gradient, made by its
    backward).

    A microbatch after the first finds every weight gradient made (the first's backward
    made them) and its backward kernel's fresh one is summed into it, then dropped: the
    peak of one microbatch, in the stage's first op's backward, is the plain step's plus
    that op's weight gradient, W1's 8 * 2 * 4 = 64 bytes, W2's 2 * 4 * 4 = 32.

    A closed microbatch holds nothing: the transport lets its pieces sent to the other
    stage go once their sends complete. So the other microbatches held add, under 1F1B,
    (2 - 1) * 0 on device 0 and (1 - 1) * 52 on device 1; under GPipe 3 * 0 and 3 * 52."""
    pg, stages = _two_stages(_graph(tmp_path))
    plain = make_simulator(round_machine(2), RooflineCost()).evaluate(pg).peak_memory_bytes
    peaks = {}
    for schedule in Schedule:
        pipeline = Pipeline(stages, 4, schedule)
        sim = make_simulator(round_machine(2), RooflineCost(), pipeline=pipeline)
        peaks[schedule] = sim.evaluate(pg).peak_memory_bytes
    gpipe, one = peaks[Schedule.GPIPE], peaks[Schedule.ONE_F_ONE_B]
    assert one[0] == plain[0] + 64 + (2 - 1) * 0 + (2 - 1) * 64
    assert one[1] == plain[1] + 32 + (1 - 1) * 52 + (2 - 1) * 16
    assert gpipe[0] == plain[0] + 64 + 3 * 0 + (4 - 1) * 64
    assert gpipe[1] == plain[1] + 32 + 3 * 52 + (4 - 1) * 16


@pytest.mark.parametrize(
    ("schedule", "stages", "microbatches"),
    [
        (Schedule.ONE_F_ONE_B, 2, 4),
        (Schedule.ONE_F_ONE_B, 3, 4),
        (Schedule.ONE_F_ONE_B, 4, 8),
        (Schedule.GPIPE, 3, 4),
    ],
)
def test_open_microbatches_are_the_executors_slots(tmp_path, schedule, stages, microbatches):
    """``open_at_most`` against the executor's own program (``Program.slots``): a chain
    of Gemms cut into ``stages`` stages of one device each."""
    from executor.program import compile_program
    from onnx2soap.sim.pipeline_price import open_at_most

    graph = load_model(chain_of_gemms(tmp_path / "chain.onnx", stages), batch=microbatches).graph
    space = analyze(graph)
    names = [op.name for op in graph.ops]
    stage_of = {name: min(i, stages - 1) for i, name in enumerate(names)}
    configs = {n: ParallelConfig((1,) * len(space[n]), (stage_of[n],)) for n in names}
    cut = tuple(tuple(n for n in names if stage_of[n] == s) for s in range(stages))
    pg = Partitioner(graph).partition(Strategy(stages, configs))
    pipeline = Pipeline(cut, microbatches, schedule)
    for s in range(stages):
        want = compile_program(pg, s, pipeline=pipeline).slots
        assert open_at_most(schedule, s, stages, microbatches) == want, s


def chain_of_gemms(path: Path, count: int) -> Path:
    """x [B, 4] -> ``count`` Gemms of W [4, 4]: the last one's output the logits."""
    weights = [numpy_helper.from_array(np.ones((4, 4), np.float32), f"W{i}") for i in range(count)]
    names = ["x", *(f"h{i}" for i in range(count - 1)), "logits"]
    nodes = [
        helper.make_node("Gemm", [names[i], f"W{i}"], [names[i + 1]], name=f"g{i}")
        for i in range(count)
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", 4])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _cnn_data_parallel(example_onnx: Path, devices: int):
    graph = load_model(example_onnx, batch=8).graph
    space = analyze(graph)
    strategy = by_rule(Rule.DATA_PARALLEL, graph, space, devices)
    return Partitioner(graph).partition(strategy)


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("resume", [None, Resume(after=1e-6, cost=3e-6, slowdown=1e9)])
def test_one_stage_one_microbatch_is_the_plain_step(
    tmp_path, example_onnx, schedule, resume
) -> None:
    """A pipeline of one stage and one microbatch is the plain step: the same time (to
    rounding: its passes are timed apart and added), memory and bytes; on a machine
    with a resume cost too (each pass counts the waits inside it; paid at once here:
    what a pass leaves owed at its end is not carried into the next)."""
    machine = replace(round_machine(4), resume=resume)
    for pg in (_cnn_data_parallel(example_onnx, 4), _two_stages(_graph(tmp_path))[0]):
        stages = (tuple(op.name for op in pg.graph.ops),)
        pipeline = Pipeline(stages, 1, schedule)
        piped = make_simulator(machine, RooflineCost(), 2, pipeline=pipeline).evaluate(pg)
        plain = make_simulator(machine, RooflineCost(), 2).evaluate(pg)
        assert piped.step_time_s == pytest.approx(plain.step_time_s, rel=1e-12)
        assert piped.peak_memory_bytes == plain.peak_memory_bytes
        assert piped.bytes_moved == plain.bytes_moved and piped.fits == plain.fits
        assert plain.pipeline is None and piped.pipeline.stages[0].bubble == pytest.approx(0)


def test_a_plan_without_pipeline_prices_as_before(example_onnx) -> None:
    """No pipeline, no recomputation: the full simulation's makespan, memory.py's peak
    and the task graph's bytes, as ``evaluate`` gave them before pipelines."""
    pg = _cnn_data_parallel(example_onnx, 4)
    machine = round_machine(4)
    ev = make_simulator(machine, RooflineCost(), 2).evaluate(pg)
    tg = build_task_graph(pg, machine, RooflineCost())
    assert ev.step_time_s == simulate(tg).makespan
    assert ev.peak_memory_bytes == peak_memory(pg, 4, 4, None, 2, False, 0, optimizer_slots=2)
    assert ev.bytes_moved == int(tg.nbytes.sum()) and ev.pipeline is None


@pytest.mark.parametrize("resume", [None, Resume(after=1e-6, cost=3e-6)])
def test_one_class_is_the_full_simulation(example_onnx, resume) -> None:
    """``makespans`` with every task in one class is ``simulate``'s pass."""
    pg = _cnn_data_parallel(example_onnx, 4)
    tg = build_task_graph(pg, replace(round_machine(4), resume=resume), RooflineCost())
    one = makespans(tg, np.zeros(tg.size, dtype=np.int64), 1)
    assert one == [simulate(tg).makespan]
    if resume is not None:  # the rings' waits were charged
        plain = build_task_graph(pg, round_machine(4), RooflineCost())
        assert simulate(tg).makespan > simulate(plain).makespan


def test_tiny_gemm_stage_alone(tmp_path) -> None:
    """A one-op stage: x [4, 8] -> Gemm(W [8, 4]) and the loss, 2 microbatches on one
    device, GPipe: 2 forwards (128 + 32 ns each) then 2 backwards (256 + 64), W's update
    (2 * 32 ns) once."""
    graph = tiny_graph(tmp_path, batch=2)
    space = analyze(graph)
    configs = {op.name: ParallelConfig((1,) * len(space[op.name]), (0,)) for op in graph.ops}
    pg = Partitioner(graph).partition(Strategy(1, configs))
    pipeline = Pipeline((tuple(op.name for op in graph.ops),), 2, Schedule.GPIPE)
    ev = make_simulator(round_machine(1), RooflineCost(), pipeline=pipeline).evaluate(pg)
    one = (128 + 32 + 256 + 64) * NS
    assert ev.step_time_s == pytest.approx(2 * one + 64 * NS, rel=1e-9)
