"""Step times computed by hand on 1, 2 and 3 devices, with transfers and an all-reduce.

Model: x [4, 8] -> Gemm(W [8, 4]) -> cross-entropy. FLOPs: Gemm forward 2*4*4*8 = 256,
loss forward 4 per (sample, class) point = 64; backward twice the forward; the SGD update
2 per weight element. Devices run 1 GFLOP/s with free memory traffic and no overhead, so
a task of F FLOPs takes F ns. Every route is two links (the sender's out-port and the
receiver's in-port), 1 us latency each, 1 byte/us: b bytes take 2 us + b us.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.machine import Cooling, Resume
from onnx2soap.sim.simulate import simulate
from onnx2soap.sim.taskgraph import TaskKind
from onnx2soap.soap import ParallelConfig, Partitioner, Strategy, analyze
from tests.sim.tiny import round_machine, tiny_graph

NS, US = 1e-9, 1e-6


def step_time(graph, strategy: Strategy, devices: int, use_compute: bool = False) -> float:
    sim = Simulator(round_machine(devices, use_compute=use_compute), RooflineCost())
    return sim.evaluate(Partitioner(graph).partition(strategy)).step_time_s


def config(graph, op: str, devices, **degrees) -> ParallelConfig:
    dims = analyze(graph)[op]
    return ParallelConfig(tuple(degrees.get(d.name, 1) for d in dims), tuple(devices))


def test_one_device(tmp_path) -> None:
    g = tiny_graph(tmp_path)
    s = Strategy(1, {"gemm": config(g, "gemm", [0]), "loss": config(g, "loss", [0])})
    # fwd gemm 256 + fwd loss 64 + bwd loss 128 + bwd gemm 512 + update 2*32
    assert step_time(g, s, 1) == pytest.approx((256 + 64 + 128 + 512 + 64) * NS, rel=1e-9)


def test_two_devices_data_parallel_with_ring_all_reduce(tmp_path) -> None:
    g = tiny_graph(tmp_path)
    s = Strategy(
        2, {"gemm": config(g, "gemm", [0, 1], n=2), "loss": config(g, "loss", [0, 1], n=2)}
    )
    compute = (128 + 32 + 64 + 256) * NS  # each device does half of every task
    # ring all-reduce of W (32 floats) over 2 devices: 2 steps of one 16-float chunk
    # (64 bytes) each way at once, on disjoint links: 2 * (2 us + 64 us)
    ring = 2 * (2 + 64) * US
    update = 64 * NS
    assert step_time(g, s, 2) == pytest.approx(compute + ring + update, rel=1e-9)


def test_a_ring_step_pays_the_machines_ring_latency(tmp_path) -> None:
    """``ring_step_latency`` (what a ring step costs the runtime) replaces the route's
    2 us in each of the ring's two steps; its 64 bytes still take 64 us, and messages
    keep the route's latency (the ring above, 2 * (2 + 64) us, becomes 2 * (9 + 64))."""
    g = tiny_graph(tmp_path)
    s = Strategy(
        2, {"gemm": config(g, "gemm", [0, 1], n=2), "loss": config(g, "loss", [0, 1], n=2)}
    )
    rings = replace(round_machine(2), ring_step_latency=9 * US)
    took = Simulator(rings, RooflineCost()).evaluate(Partitioner(g).partition(s)).step_time_s
    assert took - step_time(g, s, 2) == pytest.approx(2 * (9 - 2) * US, rel=1e-9)
    # No ring in this plan (the ops alternate devices): only its messages, unchanged.
    apart = Strategy(2, {"gemm": config(g, "gemm", [0], n=1), "loss": config(g, "loss", [1], n=1)})
    took = Simulator(rings, RooflineCost()).evaluate(Partitioner(g).partition(apart))
    assert took.step_time_s == pytest.approx(step_time(g, apart, 2), rel=1e-12)


def test_three_devices_transfers_queue_on_a_shared_link(tmp_path) -> None:
    g = tiny_graph(tmp_path)
    s = Strategy(3, {"gemm": config(g, "gemm", [0, 1], co=2), "loss": config(g, "loss", [2])})
    # Gemm halves (co) on devices 0 and 1: 128 ns each. Their [4, 2] tiles (32 bytes,
    # 34 us each) both enter device 2 through its one inbound link: one after the other.
    t = 128 * NS + 2 * 34 * US
    t += (64 + 128) * NS  # loss forward and backward on device 2
    # Gradient pieces leave device 2 through its one outbound link: 34 us, then 34 us;
    # device 1's piece is second, then its Gemm backward (256 ns) and update (16 weights).
    t += 2 * 34 * US + 256 * NS + 32 * NS
    assert step_time(g, s, 3) == pytest.approx(t, rel=1e-9)


def test_task_graph_counts_and_bytes(tmp_path) -> None:
    g = tiny_graph(tmp_path)
    s = Strategy(3, {"gemm": config(g, "gemm", [0, 1], co=2), "loss": config(g, "loss", [2])})
    tg = Simulator(round_machine(3), RooflineCost()).task_graph(Partitioner(g).partition(s))
    kinds = [TaskKind(int(k)) for k in tg.kind]
    assert kinds.count(TaskKind.FORWARD) == 3 and kinds.count(TaskKind.BACKWARD) == 3
    assert kinds.count(TaskKind.TRANSFER) == 4  # two tiles forward, two gradients back
    assert kinds.count(TaskKind.UPDATE) == 2  # two W shards, one device each: no all-reduce
    assert int(tg.nbytes.sum()) == 4 * 32
    timeline = simulate(tg)
    assert timeline.makespan == pytest.approx(step_time(g, s, 3))


def test_transfers_that_use_compute_hold_both_cores(tmp_path) -> None:
    """On CPU ranks a message is copied by the cores at both ends, so a rank cannot send
    and receive at once. Gemm split over samples on devices 0 and 1, the loss split over
    samples the other way round (loss[0] on device 1, loss[1] on device 0): each device
    sends its [2, 4] tile (32 bytes, 34 us) to the other. On separate links with copy
    engines the two go at once; when the cores copy, one after the other: 34 us more in
    the forward pass and 34 us more for the gradient pieces of the backward. So in each
    step of W's ring every core copies the chunk it sends and the one it receives: its
    64 bytes twice, 64 us more a step."""
    g = tiny_graph(tmp_path)
    s = Strategy(
        2, {"gemm": config(g, "gemm", [0, 1], n=2), "loss": config(g, "loss", [1, 0], n=2)}
    )
    overlapped, serialized = step_time(g, s, 2), step_time(g, s, 2, use_compute=True)
    # gemm fwd 128 ns, tile 34 us, loss fwd 32 ns and bwd 64 ns, gradient 34 us, gemm bwd
    # 256 ns, ring all-reduce of W 2 * 66 us, update 64 ns
    assert overlapped == pytest.approx((0.128 + 34 + 0.096 + 34 + 0.256 + 132 + 0.064) * US)
    assert serialized - overlapped == pytest.approx((2 * 34 + 2 * 64) * US, rel=1e-6)


def test_ranks_free_for_the_part_of_a_message_they_nap_through(tmp_path) -> None:
    """``message_busy`` (ranks that nap while they wait): of a message's 2 us latency
    only 0.5 us holds its end devices, with its 32 bytes (32.5 us); the other 1.5 us
    holds nothing (not the links either: latency is not occupancy). The plan of the
    test above: the second message of each pair starts when the first frees the
    devices, 32.5 us after it rather than 34, and every consumer still gets its tile
    the whole 34 us after it was sent: 2 * 32.5 us more than with copy engines, and W's
    ring's 2 * 64 us of the cores copying each chunk both ways."""
    g = tiny_graph(tmp_path)
    s = Strategy(
        2, {"gemm": config(g, "gemm", [0, 1], n=2), "loss": config(g, "loss", [1, 0], n=2)}
    )
    napping = replace(round_machine(2, use_compute=True), message_busy=0.5 * US)
    pg = Partitioner(g).partition(s)
    sim = Simulator(napping, RooflineCost())
    took = sim.evaluate(pg).step_time_s
    assert took - step_time(g, s, 2) == pytest.approx((2 * 32.5 + 2 * 64) * US, rel=1e-6)
    tg = sim.task_graph(pg, names=True)
    for i, name in enumerate(tg.names):
        held = set(tg.res_idx[tg.res_ptr[i] : tg.res_ptr[i + 1]].tolist())
        if name.startswith(("send ", "grad ")):
            assert tg.duration[i] == pytest.approx(32.5 * US) and {0, 1} <= held
        if name.startswith("in flight "):
            assert tg.duration[i] == pytest.approx(1.5 * US) and not held
    assert sum(n.startswith("in flight ") for n in tg.names) == 4
    # Spinning ranks (no message_busy, or one above the latency): the whole message.
    spinning = replace(napping, message_busy=5 * US)
    assert Simulator(spinning, RooflineCost()).evaluate(pg).step_time_s == pytest.approx(
        step_time(g, s, 2, use_compute=True), rel=1e-12
    )


def test_ranks_sharing_one_core_take_turns(tmp_path) -> None:
    """Two ranks on one core (``Machine.cores``): the data-parallel plan's halves run one
    after the other, so the compute costs what one device doing it all would; the ring,
    on the links alone, is unchanged. Each half: gemm fwd 128 ns, loss fwd 32 and bwd
    64 ns, gemm bwd 256 ns; ring 2 * 66 us; the two updates, 64 ns each, in turn too."""
    g = tiny_graph(tmp_path)
    s = Strategy(
        2, {"gemm": config(g, "gemm", [0, 1], n=2), "loss": config(g, "loss", [0, 1], n=2)}
    )
    shared = replace(round_machine(2), cores=1)
    sim = Simulator(shared, RooflineCost())
    took = sim.evaluate(Partitioner(g).partition(s)).step_time_s
    assert took == pytest.approx(2 * 480 * NS + 132 * US + 2 * 64 * NS, rel=1e-9)
    assert step_time(g, s, 2) == pytest.approx(480 * NS + 132 * US + 64 * NS, rel=1e-9)


def test_shared_cores_are_extra_rows_and_tasks_keep_their_devices(tmp_path) -> None:
    """Where ranks share a core, a task still belongs to its device (compare attributes
    compute to ranks by it) and the core is one more row in traces and pictures."""
    from onnx2soap.sim.compare import Predicted
    from onnx2soap.sim.trace import trace_events
    from onnx2soap.viz.layout import gantt_chart

    g = tiny_graph(tmp_path)
    s = Strategy(
        2, {"gemm": config(g, "gemm", [0, 1], n=2), "loss": config(g, "loss", [0, 1], n=2)}
    )
    shared = replace(round_machine(2), cores=1)
    tg = Simulator(shared, RooflineCost()).task_graph(Partitioner(g).partition(s), names=True)
    timeline = simulate(tg)
    devices = {name: d for name, _, d, _ in Predicted(tg, timeline, shared).compute()}
    assert devices["fwd gemm[0]"] == 0 and devices["fwd gemm[1]"] == 1
    rows = {e["args"]["name"] for e in trace_events(tg, timeline, shared) if e["ph"] == "M"}
    assert {"rank0", "rank1", "core0"} <= rows
    gantt = gantt_chart(tg, timeline, shared)
    assert gantt.rows[-1] == "core0" and len(gantt.rows) == 2 + 1 + len(
        {int(r) for r in tg.res_idx if 2 <= r < 2 + len(shared.links)}
    )


def test_a_rank_that_slept_through_a_wait_resumes_slowly(tmp_path) -> None:
    """``Machine.resume``: the gemm on device 0, the loss on device 1. Device 1 waits
    for the gemm's [4, 4] tile (256 ns + 66 us) before its loss forward, device 0 for
    the tile and the gradient (132 us) before its gemm backward: past ``after`` (10 us),
    each of those two tasks runs ``cost`` (7 us) longer, and nothing else does
    (``slowdown`` unbounded: the first task pays it all). With ``after`` at 70 us only
    device 0's wait passes it; at 140 us none does. At a slowdown of 6 each compute
    task pays at most 6 times its duration: device 1's loss forward 6 x 64 ns and
    backward 6 x 128, device 0's gemm backward 6 x 512 and update 6 x 64: 4.608 us."""
    g = tiny_graph(tmp_path)
    apart = Strategy(2, {"gemm": config(g, "gemm", [0], n=1), "loss": config(g, "loss", [1], n=1)})
    pg = Partitioner(g).partition(apart)
    slept = replace(round_machine(2), resume=Resume(after=10 * US, cost=7 * US, slowdown=1e9))
    sim = Simulator(slept, RooflineCost())
    assert sim.evaluate(pg).step_time_s - step_time(g, apart, 2) == pytest.approx(14 * US)
    tg = sim.task_graph(pg, names=True)
    timeline = simulate(tg)
    longer = {
        name: (timeline.end[i] - timeline.start[i]) - tg.duration[i]
        for i, name in enumerate(tg.names)
    }
    assert {n for n, x in longer.items() if x > 1e-12} == {"fwd loss[0]", "bwd gemm[0]"}
    assert longer["fwd loss[0]"] == pytest.approx(7 * US)
    for after, extra in ((70 * US, 7 * US), (140 * US, 0.0)):
        calm = replace(slept, resume=Resume(after=after, cost=7 * US, slowdown=1e9))
        took = Simulator(calm, RooflineCost()).evaluate(pg).step_time_s
        assert took - step_time(g, apart, 2) == pytest.approx(extra, abs=1e-15)
    paced = replace(slept, resume=Resume(after=10 * US, cost=7 * US, slowdown=6))
    took = Simulator(paced, RooflineCost()).evaluate(pg).step_time_s
    assert took - step_time(g, apart, 2) == pytest.approx(4.608 * US, rel=1e-9)


def test_a_message_after_a_silence_costs_its_cooling(tmp_path) -> None:
    """``Machine.cooling``: the gemm on device 0, the loss on device 1, on ranks whose
    messages hold both ends. The tile goes out after the gemm's forward, a silence of
    its start since the step began; the gradient comes back after the loss's forward
    and backward, a silence of its start less the tile's end. Each costs
    ``cost (1 - exp(-silence / after))`` more, both on the step's path, computed here
    from the uncooled timeline (the cooling delays everything after the tile alike);
    no compute task takes longer. Without devices in a message's resources (a GPU's
    copy engines) nothing cools."""
    import math

    g = tiny_graph(tmp_path)
    apart = Strategy(2, {"gemm": config(g, "gemm", [0], n=1), "loss": config(g, "loss", [1], n=1)})
    pg = Partitioner(g).partition(apart)
    cores = round_machine(2, use_compute=True)
    plain = Simulator(cores, RooflineCost())
    tg = plain.task_graph(pg, names=True)
    timeline = simulate(tg)
    sent = [i for i, k in enumerate(tg.kind) if k == TaskKind.TRANSFER]
    assert len(sent) == 2 and all(k != TaskKind.ALLREDUCE for k in tg.kind)
    tile, grad = sorted(sent, key=lambda i: timeline.start[i])
    cost, after = 30 * US, 200 * NS  # the silences: the gemm's and the loss's compute
    silences = (timeline.start[tile], timeline.start[grad] - timeline.end[tile])
    expected = sum(cost * (1 - math.exp(-x / after)) for x in silences)
    assert expected > 30 * US  # each silence about an ``after``: most of a cost each
    cooled = Simulator(replace(cores, cooling=Cooling(cost, after)), RooflineCost())
    base = plain.evaluate(pg).step_time_s
    assert cooled.evaluate(pg).step_time_s - base == pytest.approx(expected, rel=1e-9)
    ctg = cooled.task_graph(pg, names=True)
    ctimeline = simulate(ctg)
    longer = {
        ctg.names[i]
        for i in range(ctg.size)
        if ctimeline.end[i] - ctimeline.start[i] - ctg.duration[i] > 1e-12
    }
    assert longer == {tg.names[tile], tg.names[grad]}
    copied = Simulator(replace(round_machine(2), cooling=Cooling(cost, after)), RooflineCost())
    assert copied.evaluate(pg).step_time_s == pytest.approx(step_time(g, apart, 2), rel=1e-12)


def test_a_wait_for_a_shared_core_is_not_a_sleep(tmp_path) -> None:
    """Two ranks on one core, each op split by samples: device 1's tasks wait for the
    core while device 0 runs (128 ns and more, past ``after`` at 1 ns), but a runnable
    rank has not slept; only the updates, which wait 132 us for the ring, pay ``cost``
    (the second in the core's turn after the first)."""
    g = tiny_graph(tmp_path)
    s = Strategy(
        2, {"gemm": config(g, "gemm", [0, 1], n=2), "loss": config(g, "loss", [0, 1], n=2)}
    )
    shared = replace(round_machine(2), cores=1)
    slept = replace(shared, resume=Resume(after=1 * NS, cost=5 * US, slowdown=1e9))
    pg = Partitioner(g).partition(s)
    tg = Simulator(slept, RooflineCost()).task_graph(pg, names=True)
    timeline = simulate(tg)
    longer = {
        name
        for i, name in enumerate(tg.names)
        if timeline.end[i] - timeline.start[i] - tg.duration[i] > 1e-12
    }
    assert longer == {"update W"}  # both devices' (one name)
    plain = Simulator(shared, RooflineCost()).evaluate(pg).step_time_s
    assert simulate(tg).makespan - plain == pytest.approx(2 * 5 * US, rel=1e-9)
