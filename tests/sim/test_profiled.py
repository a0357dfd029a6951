"""The cost DB and ``ProfiledCost``: round trip, fingerprints, measured values exactly."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from onnx2soap.errors import UserError
from onnx2soap.measure.cost_writer import CostWriter
from onnx2soap.measure.profiler import (
    profile_items,
)
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim import Simulator
from onnx2soap.sim.calibration_plan import (
    calibration_plan,
    one_device_keys,
)
from onnx2soap.sim.costdb import (
    CostDB,
    DeviceKind,
    Fingerprint,
    InStep,
    Phase,
    Timing,
    cost_key,
    db_path_for,
    host_fingerprint,
    update_key,
)
from onnx2soap.sim.costs import RooflineCost
from onnx2soap.sim.machine import ComputeDevice
from onnx2soap.sim.presets import cpu
from onnx2soap.sim.profiled import (
    IDENTITY,
    Calibration,
    FingerprintMismatch,
    ProfiledCost,
    calibrate,
    calibrations,
    fit,
    one_device_copies,
)
from onnx2soap.soap import Partitioner, analyze
from onnx2soap.soap.candidates import candidates
from tests.sim.tiny import tiny_graph

HOST = Fingerprint(
    DeviceKind.CPU, "Test CPU", (("numpy", "2.0"), ("openblas", "0.3")), 1, "float32"
)
DEVICE = ComputeDevice("cpu-rank", 1e10, 1e10, 1 << 30, 1e-6)


def _timings(n: int = 3) -> list[Timing]:
    return [
        Timing(Phase.FORWARD, f"Relu k{i}", "Relu", 100.0 * i, 8.0 * i, 1e-5 * (i + 1), 2)
        for i in range(n)
    ]


def test_db_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "host.costs.sqlite"
    with CostWriter.open(path) as db:
        fp_id = db.add_fingerprint(HOST)
        assert db.add_fingerprint(HOST) == fp_id  # one id per fingerprint
        db.add(fp_id, _timings())
    with CostDB.open(path) as db:  # read-only
        assert db.fingerprints() == {fp_id: HOST}
        assert db.find(HOST) == fp_id
        assert db.timings(fp_id) == tuple(sorted(_timings(), key=lambda t: t.key))
        assert db.keys(fp_id) == {(Phase.FORWARD, t.key) for t in _timings()}
        other = replace(HOST, threads=2)
        assert db.find(other) is None


def test_db_next_to_the_machine_file() -> None:
    assert db_path_for("plans/host.yaml") == Path("plans/host.costs.sqlite")


def test_fingerprint_text_round_trip_and_differences() -> None:
    assert Fingerprint.from_json(HOST.to_json(), "x") == HOST
    there = replace(HOST, processor="Other CPU", libraries=(("numpy", "1.26"),))
    diffs = HOST.differences(there)
    assert any(d.startswith("processor 'Test CPU' vs 'Other CPU'") for d in diffs)
    assert "numpy 2.0 vs 1.26" in diffs and "openblas 0.3 vs absent" in diffs


def test_host_fingerprint_is_stable() -> None:
    a, b = host_fingerprint(DeviceKind.CPU, "float32"), host_fingerprint(DeviceKind.CPU, "float32")
    assert a == b and a.kind is DeviceKind.CPU and dict(a.libraries)["numpy"] == np.__version__
    assert host_fingerprint(DeviceKind.CPU, "float64") != a


def test_a_db_from_another_device_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "host.costs.sqlite"
    with CostWriter.open(path) as db:
        db.add(db.add_fingerprint(HOST), _timings())
    here = replace(HOST, processor="This CPU")
    with pytest.raises(FingerprintMismatch, match="processor 'This CPU' vs 'Test CPU'") as e:
        ProfiledCost.load(path, here, DEVICE)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    assert ProfiledCost.load(path, HOST, DEVICE).measured == 3


@pytest.mark.parametrize("opener", [CostDB, CostWriter])
@pytest.mark.parametrize("content", [b"not a database at all, just text" * 100, b"\0" * 4096])
def test_a_file_that_is_no_cost_db_is_one_line(tmp_path: Path, content: bytes, opener) -> None:
    path = tmp_path / "host.costs.sqlite"
    path.write_bytes(content)
    with pytest.raises(UserError, match="not a cost database"):
        opener.open(path)


@pytest.mark.parametrize("opener", [CostDB, CostWriter])
def test_another_sqlite_file_is_refused(tmp_path: Path, opener) -> None:
    path = tmp_path / "other.sqlite"
    sqlite3.connect(path).execute("CREATE TABLE t (x)").connection.commit()
    with pytest.raises(UserError, match="tables missing"):
        opener.open(path)


def test_the_reader_neither_makes_nor_changes_a_file(tmp_path: Path) -> None:
    """Planning opens the DB read-only: a missing file stays missing, and a DB from
    before calibration is read as it is (only a profile's writer adds the table)."""
    path = tmp_path / "host.costs.sqlite"
    with pytest.raises(UserError, match="no such cost database"):
        CostDB.open(path)
    assert not path.exists()
    with CostWriter.open(path) as db:
        db.add(db.add_fingerprint(HOST), _timings())
        db.conn.execute("DROP TABLE in_step")
    before = path.read_bytes()
    with CostDB.open(path) as db:
        assert not hasattr(db, "add") and len(db.timings(db.find(HOST))) == 3
    assert path.read_bytes() == before


def test_profiled_cost_answers_measured_values_exactly(tmp_path: Path) -> None:
    """Without in-step times (no calibration), a timed key costs its measured seconds."""
    graph = tiny_graph(tmp_path, batch=8, relu=True)
    space, partitioner = analyze(graph), Partitioner(graph)
    timings, expected = [], {}
    for k, op in enumerate(graph.ops):
        for config in candidates(space[op.name], 2):
            for task in partitioner.tasks(op, config):
                key = cost_key(op, task)
                for phase in (Phase.FORWARD, Phase.BACKWARD):
                    seconds = 1e-6 * (1 + len(expected)) + 1e-9 * k  # all different
                    expected.setdefault((phase, key), seconds)
    timings = [Timing(p, k, "any", 1.0, 1.0, s) for (p, k), s in expected.items()]
    timings.append(Timing(Phase.UPDATE, update_key(32), "SGD", 64, 384, 3.25e-6))
    cost = ProfiledCost.from_timings(timings, DEVICE, itemsize=4)
    for op in graph.ops:
        for config in candidates(space[op.name], 2):
            for task in partitioner.tasks(op, config):
                key = cost_key(op, task)
                assert cost.forward(op, task, DEVICE, 4) == expected[(Phase.FORWARD, key)]
                assert cost.backward(op, task, DEVICE, 4) == expected[(Phase.BACKWARD, key)]
    assert cost.update(32, DEVICE, 4) == 3.25e-6
    # Another device (a preset's GPU) or float width: no measured time is used.
    other = replace(DEVICE, name="gpu", peak_flops=1e13, kernel_overhead=7e-6)
    op = graph.ops[0]
    task = partitioner.tasks(op, candidates(space[op.name], 2)[0])[0]
    assert cost.forward(op, task, other, 4) == pytest.approx(7e-6, rel=1e-3)
    assert cost.update(32, DEVICE, 8) != 3.25e-6


def test_unknown_keys_get_the_fitted_roofline(tmp_path: Path) -> None:
    overhead, per_flop, per_byte = 2e-6, 1 / 5e9, 1 / 2e9
    rng = np.random.default_rng(0)
    timings = []
    for i in range(20):
        flops, nbytes = float(rng.integers(1, 10**7)), float(rng.integers(1, 10**7))
        seconds = overhead + flops * per_flop + nbytes * per_byte
        timings.append(Timing(Phase.FORWARD, f"Gemm {i}", "Gemm", flops, nbytes, seconds))
    f = fit(timings)
    assert f.overhead == pytest.approx(overhead, rel=1e-6)
    assert f.per_flop == pytest.approx(per_flop, rel=1e-6)
    assert f.per_byte == pytest.approx(per_byte, rel=1e-6)
    assert f.efficiency(DEVICE) == pytest.approx((0.5, 0.2), rel=1e-6)
    graph = tiny_graph(tmp_path, batch=8)
    op = graph.ops[0]
    (task,) = Partitioner(graph).tasks(op, candidates(analyze(graph)[op.name], 1)[0])
    cost = ProfiledCost.from_timings(timings, DEVICE, itemsize=4)
    from onnx2soap.sim.costs import task_bytes, task_flops

    want = overhead + task_flops(op, task) * per_flop + task_bytes(task, 4) * per_byte
    assert cost.forward(op, task, DEVICE, 4) == pytest.approx(want, rel=1e-6)
    # Nothing to fit for the backward: the roofline.
    assert cost.backward(op, task, DEVICE, 4) == RooflineCost().backward(op, task, DEVICE, 4)


def test_profile_items_cover_every_candidate_task(tmp_path: Path) -> None:
    """Measuring the profile's items leaves no task of any candidate unmeasured."""
    graph = tiny_graph(tmp_path, batch=8, relu=True)
    items = profile_items(graph, 4, 4)
    assert len({(x.phase, x.key) for x in items}) == len(items)
    timings = [Timing(x.phase, x.key, x.op_type, x.flops, x.nbytes, 1e-3) for x in items]
    cost = ProfiledCost.from_timings(timings, DEVICE, itemsize=4)
    space, partitioner = analyze(graph), Partitioner(graph)
    for op in graph.ops:
        for config in candidates(space[op.name], 4):
            for task in partitioner.tasks(op, config):
                assert cost.forward(op, task, DEVICE, 4) == 1e-3
    pg = partitioner.partition(data_parallel(graph, space, 4))
    for group in pg.groups[graph.ops[0].name]:
        from onnx2soap.soap.partition import rect_volume

        assert cost.update(rect_volume(group.rect), DEVICE, 4) == 1e-3


def test_simulator_takes_profiled_costs(tmp_path: Path) -> None:
    from onnx2soap.sim.presets import cpu

    graph = tiny_graph(tmp_path, batch=8)
    items = profile_items(graph, 2, 4)
    timings = [Timing(x.phase, x.key, x.op_type, x.flops, x.nbytes, 1e-3) for x in items]
    machine = cpu(2, DEVICE, 1e9, 1e-6)
    cost = ProfiledCost.from_timings(timings, DEVICE, itemsize=4)
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 2))
    ev = Simulator(machine, cost).evaluate(pg)
    # Forward and backward of two ops, one after the other, at 1 ms each, at least.
    assert ev.step_time_s >= 4e-3


# --- in-step calibration ---------------------------------------------------------------------


def test_calibrate_recovers_scale_and_overhead() -> None:
    scale, overhead = 1.4, 25e-6
    isolated = [1e-6, 3e-6, 2e-5, 1e-4, 7e-4, 3e-3]
    pairs = [(x, scale * x + overhead) for x in isolated]
    c = calibrate(pairs)
    assert c.scale == pytest.approx(scale, rel=1e-9)
    assert c.overhead == pytest.approx(overhead, rel=1e-9)
    assert calibrate(pairs[:1]) == IDENTITY  # nothing to fit
    # Faster in the step than alone: no negative overhead, a scale through the origin.
    c = calibrate([(x, 0.9 * x - 1e-7) for x in isolated[2:]])
    assert c.overhead == 0.0 and 0.8 < c.scale < 0.9


def test_db_round_trip_of_in_step_times(tmp_path: Path) -> None:
    path = tmp_path / "host.costs.sqlite"
    timings = _timings(4)
    points = [InStep(t.phase, t.key, 2 * t.seconds + 3e-5) for t in timings]
    with CostWriter.open(path) as db:
        fp_id = db.add_fingerprint(HOST)
        db.add(fp_id, timings)
        db.add_in_step(fp_id, points)
    with CostDB.open(path) as db:
        assert db.in_step(fp_id) == tuple(sorted(points, key=lambda p: p.key))
        cost = ProfiledCost.load(path, HOST, DEVICE)
    c = cost.calibration[Phase.FORWARD]
    assert c.scale == pytest.approx(2.0) and c.overhead == pytest.approx(3e-5)
    assert calibrations(timings, points) == cost.calibration


def test_a_db_from_before_calibration_reads_and_gets_the_table(tmp_path: Path) -> None:
    path = tmp_path / "old.costs.sqlite"
    with CostWriter.open(path) as db:
        fp_id = db.add_fingerprint(HOST)
        db.add(fp_id, _timings())
        db.conn.execute("DROP TABLE in_step")
    with CostDB.open(path) as db:  # read-only, as planning opens it: no calibration
        assert db.in_step(fp_id) == ()
    assert ProfiledCost.load(path, HOST, DEVICE).calibration == {}
    with CostWriter.open(path) as db:  # the profile adds it
        db.add_in_step(fp_id, [InStep(Phase.FORWARD, "Relu k1", 1e-4)])
        assert len(db.in_step(fp_id)) == 1


def test_in_step_times_of_an_older_method_are_refused_until_a_profile_redoes_them(
    tmp_path: Path,
) -> None:
    """A database calibrated before statistics ops counted whole (no method in meta):
    reading its in-step times is one line naming the field and what to run; opening it
    to profile drops them (the timings stay) and marks it current."""
    path = tmp_path / "old.costs.sqlite"
    timings = _timings(4)
    with CostWriter.open(path) as db:
        fp_id = db.add_fingerprint(HOST)
        db.add(fp_id, timings)
        db.add_in_step(fp_id, [InStep(t.phase, t.key, 2 * t.seconds) for t in timings])
        with db.conn:
            db.conn.execute("DELETE FROM meta WHERE name = 'in_step_method'")
    with pytest.raises(UserError, match=r"meta.in_step_method: '1'.*run onnx2soap profile"):
        ProfiledCost.load(path, HOST, DEVICE)
    with CostWriter.open(path) as db:
        assert db.in_step(fp_id) == () and db.timings(fp_id) == tuple(timings)
    assert ProfiledCost.load(path, HOST, DEVICE).calibration == {}


def test_profiled_cost_applies_the_calibration_exactly(tmp_path: Path) -> None:
    """A timed key costs its isolated seconds taken into the step by its phase's stored
    calibration, bit for bit; a fitted roofline is taken in too; another device is not."""
    graph = tiny_graph(tmp_path, batch=8, relu=True)
    items = profile_items(graph, 2, 4)
    timings = [
        Timing(x.phase, x.key, x.op_type, x.flops, x.nbytes, 1e-5 * (1 + i))
        for i, x in enumerate(items)
    ]
    by_key = {(t.phase, t.key): t.seconds for t in timings}
    cal = {
        Phase.FORWARD: Calibration(1.5, 2e-5),
        Phase.BACKWARD: Calibration(1.25, 4e-5),
        Phase.UPDATE: Calibration(3.0, 1e-6),
    }
    plain = ProfiledCost.from_timings(timings, DEVICE, itemsize=4)
    cost = replace(plain, calibration=cal)
    space, partitioner = analyze(graph), Partitioner(graph)
    for op in graph.ops:
        for config in candidates(space[op.name], 2):
            for task in partitioner.tasks(op, config):
                key = cost_key(op, task)
                f, b = by_key[(Phase.FORWARD, key)], by_key[(Phase.BACKWARD, key)]
                assert cost.forward(op, task, DEVICE, 4) == 1.5 * f + 2e-5
                assert cost.backward(op, task, DEVICE, 4) == 1.25 * b + 4e-5
    for (phase, key), seconds in by_key.items():
        if phase is Phase.UPDATE:
            numel = int(key.split("=")[1])
            assert cost.update(numel, DEVICE, 4) == 3.0 * seconds + 1e-6
    # An unmeasured shard size: the fitted roofline, taken into the step as well.
    assert cost.update(12345, DEVICE, 4) == 3.0 * plain.update(12345, DEVICE, 4) + 1e-6
    # A preset's GPU: the efficiencies on its peaks, no calibration of this host's step.
    other = replace(DEVICE, name="gpu", peak_flops=1e13, kernel_overhead=7e-6)
    op = graph.ops[0]
    task = partitioner.tasks(op, candidates(space[op.name], 2)[0])[0]
    assert cost.forward(op, task, other, 4) == plain.forward(op, task, other, 4)


def test_the_calibration_plan_is_data_parallelism_on_one_device(tmp_path: Path) -> None:
    """Built in the simulator without the search's baselines, and still the plan that
    ``data_parallel`` makes on one device: every op whole on device 0."""
    graph = tiny_graph(tmp_path)
    ours = calibration_plan(graph)
    theirs = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))
    assert ours.strategy == theirs.strategy
    assert all(len(ours.tasks[op.name]) == 1 for op in graph.ops)


def test_a_model_is_taken_into_the_step_by_its_own_calibration(tmp_path: Path) -> None:
    """Two models calibrated in one DB: the tiny model's tasks run 2x their isolated
    time in the step, the other model's 1x + 50 us. ``for_graph`` fits the tiny model's
    points alone (2x, no overhead), where the DB-wide fit mixes both; a model the DB
    never calibrated keeps the DB-wide fit."""
    graph = tiny_graph(tmp_path)
    keys = sorted(one_device_keys(graph), key=lambda k: (k[0].value, k[1]))
    assert {op.name for op in graph.ops} == {"gemm", "loss"}
    assert len(keys) == 5  # two ops forward and backward, one weight's update
    own = [Timing(p, k, "Gemm", 0, 0, 1e-5 * (i + 1)) for i, (p, k) in enumerate(keys)]
    other = [Timing(p, f"other {i}", "Conv", 0, 0, 3e-4 * (i + 1)) for i, p in enumerate(Phase)]
    other += [Timing(p, f"more {i}", "Conv", 0, 0, 7e-4 * (i + 1)) for i, p in enumerate(Phase)]
    points = [InStep(t.phase, t.key, 2 * t.seconds) for t in own]
    points += [InStep(t.phase, t.key, t.seconds + 5e-5) for t in other]
    cost = ProfiledCost.from_timings([*own, *other], DEVICE, itemsize=4, in_step=points)
    mixed = cost.calibration[Phase.FORWARD]
    assert abs(mixed.scale - 2.0) > 0.1  # the DB-wide fit is neither model's
    mine = cost.for_graph(graph)
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        c = mine.calibration[phase]
        assert c.scale == pytest.approx(2.0, rel=1e-9) and c.overhead == pytest.approx(0, abs=1e-12)
    assert mine.calibration == calibrations([*own, *other], points, graph)
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))
    (gemm,) = pg.tasks["gemm"]
    op = next(o for o in graph.ops if o.name == "gemm")
    isolated = {(t.phase, t.key): t.seconds for t in own}[(Phase.FORWARD, cost_key(op, gemm))]
    assert mine.forward(op, gemm, DEVICE, 4) == pytest.approx(2 * isolated, rel=1e-9)
    # Not calibrated: no in-step time for one of its forward tasks.
    partial = [p for p in points if p.key != cost_key(op, gemm)]
    uncalibrated = ProfiledCost.from_timings([*own, *other], DEVICE, itemsize=4, in_step=partial)
    assert uncalibrated.for_graph(graph) == uncalibrated


def test_the_copies_the_simulator_costs_apart_leave_the_calibration() -> None:
    """The example CNN on one device: ``pool1``'s output feeds a padded convolution and
    a padded average pool (each copies it into its buffer: 2 passes) and takes their two
    gradients summed (2 pieces, 4 passes each), at the machine's copy bandwidth. Those
    copies run inside the tasks' own instructions, so in-step times of 2x isolated plus
    them calibrate to exactly 2x once taken out, and not without the machine."""
    from onnx2soap.importer import load_model

    graph = load_model(Path(__file__).parents[2] / "examples" / "cnn.onnx", batch=4).graph
    machine = cpu(2)
    ops = {op.name: op for op in graph.ops}
    pool1 = ops["/pool1/MaxPool"]
    nbytes = 4 * int(np.prod(graph.tensors[pool1.output].shape))
    rate = machine.devices[0].memory_bandwidth
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 1))

    def key(name: str, phase: Phase) -> tuple[Phase, str]:
        (task,) = pg.tasks[name]
        return phase, cost_key(ops[name], task)

    copies = one_device_copies(graph, machine, 4)
    wanted = {
        key("/branch_a/conv/Conv", Phase.FORWARD): 2 * nbytes / rate,
        key("/branch_b/pool/AveragePool", Phase.FORWARD): 2 * nbytes / rate,
        key("/pool1/MaxPool", Phase.BACKWARD): 2 * 4 * nbytes / rate,
    }
    assert copies.keys() == wanted.keys()
    for k, seconds in wanted.items():
        assert copies[k] == pytest.approx(seconds, rel=1e-12)
    keys = sorted(one_device_keys(graph), key=lambda k: (k[0].value, k[1]))
    own = [Timing(p, k, "op", 0, 0, 1e-5 * (i + 1)) for i, (p, k) in enumerate(keys)]
    points = [InStep(t.phase, t.key, 2 * t.seconds + copies.get((t.phase, t.key), 0)) for t in own]
    cost = ProfiledCost.from_timings(own, DEVICE, itemsize=4, in_step=points)
    taken_out = cost.for_graph(graph, machine).calibration
    left_in = cost.for_graph(graph).calibration
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert taken_out[phase].scale == pytest.approx(2.0, rel=1e-9)
        assert taken_out[phase].overhead == pytest.approx(0.0, abs=1e-12)
        assert left_in[phase] != taken_out[phase]
    assert calibrations(own, points, graph, machine) == taken_out
