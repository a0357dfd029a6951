"""ZeRO in the simulator, against costs computed by hand (the model and machine of
test_makespan.py: 1 FLOP takes 1 ns, every route is two links of 1 us latency and 1
byte/us, so b bytes take 2 us + b us).

x [6, 8] -> Gemm(W [8, 4]) -> cross-entropy, data parallel over 3 devices (2 samples
each). W's 8 rows shard 3, 3, 2: flat runs of 12, 12 and 8 floats (48, 48, 32 bytes).
Each device computes Gemm forward 2*2*4*8 = 128 ns, the loss 32 ns forward and 64 ns
backward, Gemm backward 256 ns: 480 ns. Then:

- data parallelism: a ring all-reduce of W's 32 floats (chunks 11, 11, 10): 4 steps of
  its widest chunk, 4 * (2 + 44) us; every device updates all of W, 2 * 32 ns;
- ZeRO: a reduce-scatter, 2 steps of the widest shard, 2 * (2 + 48) us; each device
  updates its rows, 2 * 12 ns at most; after every update an all-gather, 2 * (2 + 48) us;
- ZeRO-3: an all-gather before Gemm's forward; none before its backward, which does not
  read W (W's gradient reads x alone, and x, the data, takes none); no all-gather after
  the update: two half rings, an all-reduce's bytes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from onnx2soap.importer import load_model
from onnx2soap.precision import Precision
from onnx2soap.sim import RooflineCost, make_simulator
from onnx2soap.sim.delta import DeltaSimulator
from onnx2soap.sim.memory import OpMemory, _op_bytes, total
from onnx2soap.sim.simulate import simulate
from onnx2soap.soap import ParallelConfig, Partitioner, Strategy, analyze
from onnx2soap.soap.buckets import scatter_name
from onnx2soap.soap.zero import ZeroStage
from tests.sim.tiny import round_machine, tiny_graph
from tests.soap.test_buckets import three_gemms

NS, US = 1e-9, 1e-6
ADAM = 2


def _setup(tmp_path):
    graph = tiny_graph(tmp_path, batch=6)
    space = analyze(graph)
    configs = {
        op.name: ParallelConfig(tuple(3 if d.name == "n" else 1 for d in space[op.name]), (0, 1, 2))
        for op in graph.ops
    }
    strategy = Strategy(3, configs)
    return Partitioner(graph), strategy


def _simulator(zero: ZeroStage):
    return make_simulator(round_machine(3), RooflineCost(), ADAM, zero=zero)


def test_data_parallel_step_by_hand(tmp_path) -> None:
    partitioner, strategy = _setup(tmp_path)
    ev = _simulator(ZeroStage.NONE).evaluate(partitioner.partition(strategy))
    assert ev.step_time_s == pytest.approx(480 * NS + 4 * (2 + 44) * US + 64 * NS, rel=1e-9)


@pytest.mark.parametrize("stage", [ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS])
def test_zero_step_by_hand(tmp_path, stage: ZeroStage) -> None:
    partitioner, strategy = _setup(tmp_path)
    pg = partitioner.partition(strategy)
    sim = _simulator(stage)
    ev = sim.evaluate(pg)
    ring = 2 * (2 + 48) * US
    assert ev.step_time_s == pytest.approx(480 * NS + ring + 24 * NS + ring, rel=1e-9)
    tg = sim.task_graph(pg, names=True)
    timeline = simulate(tg)
    named = {}
    for i, name in enumerate(tg.names):
        named.setdefault(name, []).append(i)
    (scatter,) = named[scatter_name(0, (0, 1, 2))]  # W's bucket's
    (gather,) = named["all-gather W"]
    updates = named["update W"]
    assert [tg.duration[i] for i in updates] == pytest.approx([24 * NS, 24 * NS, 16 * NS])
    assert tg.duration[scatter] == pytest.approx(ring) == tg.duration[gather]
    # the all-gather waits for every member's update; the updates for the reduce-scatter
    assert timeline.start[gather] == pytest.approx(max(timeline.end[i] for i in updates))
    assert min(timeline.start[i] for i in updates) == pytest.approx(timeline.end[scatter])
    # the two halves move what the all-reduce moves: 2 (k - 1) / k of W per member
    plain = _simulator(ZeroStage.NONE).evaluate(pg)
    assert ev.bytes_moved == plain.bytes_moved == 2 * 2 * 32 * 4
    # delta simulation (the search's) gives the full simulation's figures
    delta = DeltaSimulator(sim, partitioner)
    assert delta.evaluate(strategy)[0] == ev


def test_zero3_step_by_hand(tmp_path) -> None:
    partitioner, strategy = _setup(tmp_path)
    pg = partitioner.partition(strategy)
    sim = _simulator(ZeroStage.PARAMETERS)
    ev = sim.evaluate(pg)
    ring = 2 * (2 + 48) * US
    # gather, Gemm 128 ns, the loss 32 + 64 ns, Gemm 256 ns, reduce-scatter, update
    assert ev.step_time_s == pytest.approx(2 * ring + 480 * NS + 24 * NS, rel=1e-9)
    tg = sim.task_graph(pg, names=True)
    timeline = simulate(tg)
    named: dict[str, list[int]] = {}
    for i, name in enumerate(tg.names):
        named.setdefault(name, []).append(i)
    (gather,) = named["all-gather W"]  # none for the backward: it does not read W
    first_forward = min(timeline.start[i] for i in named["fwd gemm[0]"])
    assert timeline.end[gather] == pytest.approx(first_forward)
    assert len(named["update W"]) == 3
    assert ev.bytes_moved == 2 * 2 * 32 * 4  # a gather and a reduce-scatter
    assert DeltaSimulator(sim, partitioner).evaluate(strategy)[0] == ev


def test_zero_memory_by_hand(tmp_path) -> None:
    """W is 32 floats (128 bytes); a device's rows are 48, 48 and 32 bytes. ZeRO-1 keeps
    Adam's two moments of a device's rows only: 2 * (128 - rows) bytes less held, and its
    update's three temporaries (memory.UPDATE_TEMPORARIES) are of the rows, not of W.
    ZeRO-2 also keeps only the rows of the summed gradient once reduced; the whole
    gradient exists while the backward makes it and while its reduce-scatter runs."""
    partitioner, strategy = _setup(tmp_path)
    pg = partitioner.partition(strategy)
    gemm = pg.graph.ops[0]
    assert gemm.type == "Gemm"

    def pieces(zero: ZeroStage) -> OpMemory:
        tasks, groups = pg.tasks[gemm.name], pg.groups[gemm.name]
        return _op_bytes(pg.graph, gemm, tasks, groups, 4, ADAM, True, 0, zero, ADAM)

    plain, one, two, three = (pieces(z) for z in ZeroStage)
    rows = [48, 48, 32]

    def diff(a, b) -> list[int]:
        return [dict(a)[d] - dict(b)[d] for d in range(3)]

    assert diff(plain.held, one.held) == [2 * (128 - r) for r in rows]
    assert diff(one.held, two.held) == [128 - r for r in rows]
    assert dict(plain.update) == {d: 3 * 128 for d in range(3)}
    assert dict(one.update) == dict(two.update) == {d: 3 * r for d, r in enumerate(rows)}
    assert not one.inflight and dict(two.inflight) == {d: 128 - r for d, r in enumerate(rows)}
    assert diff(two.backward, one.backward) == [128 - r for r in rows]
    # ZeRO-3 keeps the rows of W itself; the whole W is gathered for the forward's
    # kernels (float32 here: no half-format copy), not for the backward, which does
    # not read it; recomputed, the Gemm keeps the forward's to its backward
    assert diff(two.held, three.held) == [128 - r for r in rows]
    assert diff(three.forward, two.forward) == [128] * 3
    assert dict(three.backward) == dict(two.backward)
    tasks, groups = pg.tasks[gemm.name], pg.groups[gemm.name]
    zero3 = ZeroStage.PARAMETERS
    redone = _op_bytes(pg.graph, gemm, tasks, groups, 4, ADAM, True, 0, zero3, ADAM, True)
    assert dict(redone.kept_inputs) == {d: 128 for d in range(3)} and not three.kept_inputs
    peaks = [_simulator(z).evaluate(pg).peak_memory_bytes for z in ZeroStage]
    for d in range(3):
        assert peaks[0][d] - peaks[1][d] >= 2 * (128 - rows[d])
        assert peaks[2][d] <= peaks[1][d]


def test_zero3_holds_the_next_ops_gather_through_the_op_before() -> None:
    """The executor starts an op's ZeRO-3 gathers as the op before it begins (FSDP's
    prefetch): their float32 arrays live through that op's kernels, forward and
    backward (the backward's next op is the one before in graph order)."""
    first = OpMemory(((0, 0),), (), (), ((0, 10),), ((0, 20),))
    second = OpMemory(((0, 0),), (), (), ((0, 5),), ((0, 5),))
    gathering = replace(second, gathering=((0, 100),))
    assert total([0], [first, second])[0] == 20
    assert total([0], [first, gathering])[0] == 110  # the first's forward kernel, beside it
    regathering = replace(first, regathering=((0, 300),))
    assert total([0], [regathering, second])[0] == 305  # the second's backward kernel


def test_zero3_in_bf16_gathers_the_half_format_copy(tmp_path) -> None:
    """bf16: each device keeps its float32 rows of W, no half-format copy (ZeRO-2
    keeps one of W whole, 64 bytes), and gathers its rows narrowed, W's 64 bytes, for
    the forward: the ring moves 2 bytes an element (its widest shard 24 bytes a step),
    the reduce-scatter of the float32 gradient 4."""
    partitioner, strategy = _setup(tmp_path)
    pg = partitioner.partition(strategy)
    gemm = pg.graph.ops[0]
    tasks, groups = pg.tasks[gemm.name], pg.groups[gemm.name]

    def pieces(zero: ZeroStage) -> OpMemory:
        slots, rounding, stored = ADAM + 1, 9, 2
        args = (4, slots, True, rounding, zero, ADAM, False, (), stored)
        return _op_bytes(pg.graph, gemm, tasks, groups, *args)

    two, three = pieces(ZeroStage.GRADIENTS), pieces(ZeroStage.PARAMETERS)
    rows = [48, 48, 32]  # float32 bytes
    held = [dict(two.held)[d] - dict(three.held)[d] for d in range(3)]
    assert held == [(128 - r) + 64 for r in rows]
    assert [dict(three.forward)[d] - dict(two.forward)[d] for d in range(3)] == [64] * 3
    assert dict(three.gathering) == {d: 64 for d in range(3)}
    sim = make_simulator(
        round_machine(3), RooflineCost(), ADAM, Precision.BF16, ZeroStage.PARAMETERS
    )
    tg = sim.task_graph(pg, names=True)
    (gather,) = [i for i, name in enumerate(tg.names) if name == "all-gather W"]
    assert tg.duration[gather] == pytest.approx(2 * (2 + 24) * US, rel=1e-9)
    assert sim.evaluate(pg).bytes_moved == 2 * 32 * 2 + 2 * 32 * 4


def test_a_buckets_sharded_gradients_reduce_scatter_together(tmp_path) -> None:
    """Three Gemms with biases (tests/soap/test_buckets.py: 484 floats of weights, one
    bucket), data parallel over 2 devices under ZeRO-2: one reduce-scatter of all six
    sharded gradients after the first Gemm's backward, where there had been one per
    weight. Laid out shard-major, each member's runs are 242 floats: one lock-step step
    of 968 bytes, 2 us + 968 us. Every update waits for it; delta simulation agrees."""
    graph = load_model(three_gemms(tmp_path / "m.onnx"), batch=4).graph
    space = analyze(graph)
    configs = {
        op.name: ParallelConfig(tuple(2 if d.name == "n" else 1 for d in space[op.name]), (0, 1))
        for op in graph.ops
    }
    strategy = Strategy(2, configs)
    partitioner = Partitioner(graph)
    pg = partitioner.partition(strategy)
    sim = make_simulator(round_machine(2), RooflineCost(), ADAM, zero=ZeroStage.GRADIENTS)
    tg = sim.task_graph(pg, names=True)
    timeline = simulate(tg)
    scatters = [i for i, n in enumerate(tg.names) if n.startswith("reduce-scatter")]
    assert [tg.names[i] for i in scatters] == [scatter_name(0, (0, 1))]
    (scatter,) = scatters
    assert tg.duration[scatter] == pytest.approx((2 + 968) * US)
    first_backward = max(i for i, n in enumerate(tg.names) if n.startswith("bwd gemm1"))
    assert timeline.start[scatter] >= timeline.end[first_backward]
    updates = [i for i, n in enumerate(tg.names) if n.startswith("update ")]
    assert len(updates) == 2 * 6
    assert min(timeline.start[i] for i in updates) >= timeline.end[scatter]
    ev = sim.evaluate(pg)
    assert DeltaSimulator(sim, partitioner).evaluate(strategy)[0] == ev
