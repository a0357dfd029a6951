"""Machine files and presets: routes, YAML round trip, errors naming the field, probe."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from executor.transport import SLEEPS_AFTER_S
from onnx2soap.cli import main as cli
from onnx2soap.errors import MachineError
from onnx2soap.measure.probe import CPU_RANKS_MARGIN
from onnx2soap.sim.costs import RooflineCost
from onnx2soap.sim.machine import (
    Cooling,
    Resume,
    RingCurve,
    dump_machine,
    load_machine_file,
    machine_from_dict,
)
from onnx2soap.sim.presets import preset, resolve_machine
from onnx2soap.sim.taskgraph import Costs, Memo


@pytest.mark.parametrize(
    ("name", "devices"),
    [
        ("flexflow-p100:2", 8),
        ("flexflow-k80:3", 12),
        ("alpa-v100:2", 16),
        ("dgx-h100:1", 8),
        ("grand-teton:2", 16),
        ("dgx-a100:1", 8),
        ("cpu:3", 3),
    ],
)
def test_presets_have_a_route_for_every_pair(name: str, devices: int) -> None:
    m = preset(name)
    assert m.size == devices
    for a in range(devices):
        for b in range(devices):
            if a != b:
                assert m.route(a, b), (a, b)


def test_intra_node_routes_avoid_the_nic_and_inter_node_routes_use_it() -> None:
    m = preset("flexflow-p100:2")
    names = lambda a, b: [m.links[i].name for i in m.route(a, b)]  # noqa: E731
    assert names(0, 1) == ["nvlink-0-1"]
    assert names(0, 4) == ["nic0-out", "nic1-in"]
    k80 = preset("flexflow-k80:2")
    assert [k80.links[i].name for i in k80.route(0, 5)] == [
        "pcie-gpu0-out", "nic0-out", "nic1-in", "pcie-gpu5-in",
    ]  # fmt: skip
    # the slowest hop sets the rate, every hop adds its latency
    assert m.transfer_time(0, 4, 12_500_000) == pytest.approx(1e-3 + 2 * 2e-6)


def test_yaml_round_trip(tmp_path: Path) -> None:
    shared = replace(preset("cpu:4"), cores=2)
    napping = replace(shared, message_busy=4e-5)
    rings = replace(preset("cpu:2"), ring_step_latency=2.3e-5)
    slept = replace(napping, resume=Resume(after=3.7e-4, cost=6e-4))
    doubted = replace(slept, margin=0.1)
    cooled = replace(rings, cooling=Cooling(cost=1.7e-4, after=4.5e-3))
    machines = (preset("flexflow-k80:2"), preset("cpu:4"), shared, napping, rings, slept, doubted)
    machines += (preset("dgx-h100:2"),)  # its nodes, for NCCL's model
    curved = RingCurve(((1024, 9e-6), (1 << 20, 1.4e-4), (1 << 24, 2.6e-3)))
    machines += (replace(rings, ring_step_curve=curved),)
    for m in (*machines, cooled):
        path = tmp_path / "m.yaml"
        path.write_text(dump_machine(m))
        assert load_machine_file(path) == m
        assert resolve_machine(str(path)) == m


def test_hand_written_exponents_are_numbers(tmp_path: Path) -> None:
    """YAML 1.1 (PyYAML) reads 5e-6 and 9.3e12 as strings; a machine file reads them as
    the numbers a person writing one means, in every numeric field."""
    text = dump_machine(preset("cpu:2"))
    doc = yaml.safe_load(text)
    doc["devices"][0].update(peak_flops="PEAK", kernel_overhead="OVERHEAD")
    doc["links"][0]["latency"] = "LATENCY"
    doc.update(message_busy="BUSY", ring_step_latency="RING")
    path = tmp_path / "hand.yaml"
    written = yaml.safe_dump(doc, sort_keys=False)
    for key, value in [("PEAK", "9.3e12"), ("OVERHEAD", "5e-6"), ("LATENCY", "2E-6"),
                       ("BUSY", "3e-5"), ("RING", "1.5e-5")]:  # fmt: skip
        written = written.replace(key, value)
    assert yaml.safe_load(written)["message_busy"] == "3e-5"  # what PyYAML alone makes of it
    path.write_text(written)
    m = load_machine_file(path)
    assert m.devices[0].peak_flops == 9.3e12 and m.devices[0].kernel_overhead == 5e-6
    assert m.links[0].latency == 2e-6
    assert (m.message_busy, m.ring_step_latency) == (3e-5, 1.5e-5)
    assert yaml.safe_load("x: 5e-6")["x"] == "5e-6"  # PyYAML's own loader is left as it was


def _doc() -> dict:
    return yaml.safe_load(dump_machine(preset("cpu:2")))


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["devices"][1].pop("peak_flops"), "devices[1].peak_flops"),
        (lambda d: d["devices"][0].update(memory=-1), "devices[0].memory"),
        (lambda d: d["devices"][0].update(memory_bandwidth="fast"), "devices[0].memory_bandwidth"),
        (lambda d: d["links"][0].update(bandwidth=0), "links[0].bandwidth"),
        (lambda d: d["links"][1].update(latency=-1), "links[1].latency"),
        (lambda d: d["routes"][0].update(src=7), "routes[0].src"),
        (lambda d: d["routes"][1].update(links=["nowhere"]), "routes[1].links"),
        (lambda d: d["routes"].pop(), "routes"),
        (lambda d: d.update(devices=[]), "devices"),
        (lambda d: d.update(transfers_use_compute="yes"), "transfers_use_compute"),
        (lambda d: d.update(cores=-1), "cores"),
        (lambda d: d.update(cores=1.5), "cores"),
        (lambda d: d.update(message_busy=-1e-6), "message_busy"),
        (lambda d: d.update(message_busy="soon"), "message_busy"),
        (lambda d: d.update(ring_step_latency=-1e-6), "ring_step_latency"),
        (lambda d: d.update(ring_step_latency=float("nan")), "ring_step_latency"),
        (lambda d: d.update(resume=6e-4), "resume"),
        (lambda d: d.update(resume={"cost": 6e-4}), "resume"),
        (lambda d: d.update(resume={"after": 1e-4, "cost": -1.0}), "resume.cost"),
        (lambda d: d.update(resume={"after": "soon", "cost": 1e-4}), "resume.after"),
        (lambda d: d.update(cooling=1e-4), "cooling"),
        (lambda d: d.update(cooling={"cost": 1e-4}), "cooling"),
        (lambda d: d.update(cooling={"cost": -1e-4, "after": 1e-3}), "cooling.cost"),
        (lambda d: d.update(cooling={"cost": 1e-4, "after": 0}), "cooling.after"),
        (lambda d: d.update(margin=-0.1), "margin"),
        (lambda d: d.update(margin=1.0), "margin"),  # a whole step: nothing trusted
        (lambda d: d.update(margin="a tenth"), "margin"),
        (lambda d: d.update(ring_step_curve=[[1024, 1e-5]]), "ring_step_curve"),
        (lambda d: d.update(ring_step_curve=[[1024, 1e-5], [512, 2e-5]]), "ring_step_curve"),
        (lambda d: d.update(ring_step_curve=[[1024, 1e-5], [2048, 1e-6]]), "ring_step_curve"),
        (lambda d: d.update(ring_step_curve=[[1024, 1e-5], [2048.5, 2e-5]]), "ring_step_curve"),
        (lambda d: d.update(ring_step_curve=[[1024, 1e-5], [2048, "slow"]]), "ring_step_curve"),
        (lambda d: d.update(ring_step_curve={"1024": 1e-5}), "ring_step_curve"),
        (lambda d: d.update(nodes=[0, 1]), "nodes"),
        (lambda d: d.update(nodes={"of": [0, 1], "fabric": "ib"}), "nodes"),
        (lambda d: d.update(nodes={"of": [0]}), "nodes.of"),
        (lambda d: d.update(nodes={"of": [0, -1]}), "nodes.of"),
        (lambda d: d.update(nodes={"of": [0, True]}), "nodes.of"),
        (lambda d: d.update(nodes={"of": [0, 1], "intra": "nvswitch"}), "nodes.intra"),
        (lambda d: d.update(nodes={"of": [0, 1], "nvlink_share": 0}), "nodes.nvlink_share"),
        (lambda d: d.update(nodes={"of": [0, 1], "nvlink_share": 1.2}), "nodes.nvlink_share"),
        (lambda d: d.update(nodes={"of": [0, 1], "nvlink_share": True}), "nodes.nvlink_share"),
        (lambda d: d.update(nodes={"of": [0, 1], "nvls": "yes"}), "nodes.nvls"),
    ],
)
def test_bad_machine_file_names_the_field(edit, field: str) -> None:
    doc = _doc()
    edit(doc)
    with pytest.raises(MachineError, match=re.escape(f"m.yaml: {field}")):
        machine_from_dict(doc, "m.yaml")


def test_a_ring_step_costs_its_latency_and_the_curves_rise() -> None:
    """Measured steps of 9 us at 1 KiB chunks, 140 us at 1 MiB and 2.6 ms at 16 MiB:
    a step of 512 KiB costs the probed latency plus half-way up the first segment; one
    of 32 MiB the last segment's slope on; the route's bandwidth is not used."""
    curve = RingCurve(((1024, 9e-6), (1 << 20, 1.4e-4), (1 << 24, 2.6e-3)))
    assert curve.extra(512) == 0.0 == curve.extra(1024)
    half = 1024 + ((1 << 20) - 1024) / 2
    assert curve.extra(int(half)) == pytest.approx((1.4e-4 - 9e-6) / 2)
    slope = (2.6e-3 - 1.4e-4) / ((1 << 24) - (1 << 20))
    assert curve.extra(1 << 25) == pytest.approx(2.6e-3 - 9e-6 + slope * (1 << 24))
    m = replace(preset("cpu:2"), ring_step_latency=2e-5, ring_step_curve=curve)
    costs = Costs(m, RooflineCost(), 4, Memo())
    assert costs.ring_step_time(0, 1, 1 << 24) == pytest.approx(2e-5 + 2.6e-3 - 9e-6)
    seconds, _, _ = costs.ring((0, 1), 1 << 23)  # 2 steps of 16 MiB chunks
    assert seconds == pytest.approx(2 * (2e-5 + 2.6e-3 - 9e-6))


def test_ranks_sharing_cores_take_turns_on_core_d_mod_cores() -> None:
    shared = replace(preset("cpu:4"), cores=2)
    links = len(shared.links)  # the cores' resources come after the devices' and links'
    assert shared.shares_cores and shared.resources == 4 + links + 2
    assert [shared.core(d) for d in range(4)] == [4 + links, 5 + links, 4 + links, 5 + links]
    own = preset("cpu:4")  # 0: a core each; as many cores as ranks shares none either
    assert not own.shares_cores and not replace(own, cores=4).shares_cores
    assert own.core(0) is None and own.resources == 4 + links


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(MachineError, match="flexflow-p100:N"):
        preset("tpu-v4:8")
    with pytest.raises(MachineError, match="positive integer"):
        preset("cpu:0")


def test_machine_cli(capsys, tmp_path: Path) -> None:
    assert cli(["machine", "list"]) == 0
    assert "dgx-h100:N" in capsys.readouterr().out
    assert cli(["machine", "show", "flexflow-p100:1"]) == 0
    out = capsys.readouterr().out
    assert "4 devices" in out and "route 0 -> 1: nvlink-0-1" in out
    # the all-reduce's busbw over the machine, as the simulator prices it (NCCL's model:
    # 1 GiB over 16 H100s of two nodes: NVLS in each node, a tree of the two, at its
    # per-channel cap; tests/sim/test_collectives.py has it by hand)
    assert cli(["machine", "show", "dgx-h100:2"]) == 0
    out = capsys.readouterr().out
    assert "all-reduce over all 16 devices (NCCL's model)" in out
    assert "1 GiB: 4,428.3 us, busbw 455GB/s, nvls-tree/Simple" in out
    assert cli(["machine", "show", "cpu:2", "--yaml"]) == 0
    path = tmp_path / "cpu2.yaml"
    path.write_text(capsys.readouterr().out)
    assert load_machine_file(path) == preset("cpu:2")
    assert cli(["machine", "show", "nonsense:2"]) == 2
    assert "unknown machine" in capsys.readouterr().err


@pytest.mark.mpi
def test_probe_measures_this_host(tmp_path: Path) -> None:
    out = tmp_path / "host.yaml"
    assert cli(["machine", "probe", "-n", "2", "-o", str(out), "--seconds", "0.05"]) == 0
    m = load_machine_file(out)
    assert m.size == 2 and m.transfers_use_compute
    assert m.cores == (0 if (os.cpu_count() or 1) >= 2 else os.cpu_count())
    for d in m.devices:
        assert d.peak_flops > 1e8 and d.memory_bandwidth > 1e8 and d.memory > 0
        assert 0 < d.kernel_overhead < 1e-2
    assert all(0 < x.latency < 1e-2 and x.bandwidth > 1e6 for x in m.links)
    # A core each: a waiting rank spins, busy throughout; sharing one: it naps.
    assert (m.message_busy is None) == (m.cores == 0)
    # Measured on the runtime's own rings, as the messages are.
    assert m.ring_step_latency is not None and 0 <= m.ring_step_latency < 1e-2
    # and what a step's bytes add, by chunk size: rising, at most the copies' and sum's
    # few passes over a 32 MiB chunk at 0.2-20 GB/s
    curve = m.ring_step_curve
    assert curve is not None and [b for b, _ in curve.points] == [
        2 << 10,
        128 << 10,
        1 << 20,
        8 << 20,
        32 << 20,
    ]
    assert curve.points[-1][1] > curve.points[0][1]
    assert curve.extra(32 << 20) * 20e9 > 32 << 20 and curve.extra(32 << 20) * 0.2e9 < 32 << 20
    # What a rank that slept through a wait pays, past the transport's naps: where
    # ranks share cores. With a core each they spin, never asleep: no resume.
    if m.cores:
        assert m.resume is not None and m.resume.after == SLEEPS_AFTER_S
        assert 0 <= m.resume.cost < 1e-2
    else:
        assert m.resume is None
    # Ranks that spin pay for a silence instead (a ring after 10 ms costs more than one
    # back to back on any host this runs on; the fit's time constant is on its grid).
    if m.cores:
        assert m.cooling is None
    else:
        assert m.cooling is not None and 0 < m.cooling.cost < 1e-2
        assert 5e-5 <= m.cooling.after <= 5e-2
    # Not probed: the step error fidelity measures on CPU ranks, for the search.
    assert m.margin == CPU_RANKS_MARGIN


@pytest.mark.mpi
def test_probe_says_which_cores_ranks_share(tmp_path: Path) -> None:
    """More ranks than this host has cores: the file says they share its cores."""
    ranks = (os.cpu_count() or 1) + 1
    out = tmp_path / "host.yaml"
    assert cli(["machine", "probe", "-n", str(ranks), "-o", str(out), "--seconds", "0.05"]) == 0
    m = load_machine_file(out)
    assert m.size == ranks and m.cores == os.cpu_count() and m.shares_cores
    # Napping ranks: a message holds its ends for part of its latency (two links').
    assert 0 < m.message_busy <= 2 * m.links[0].latency
    # Napping ranks sleep through long waits: they owe a resume after.
    assert m.resume is not None and m.resume.after == SLEEPS_AFTER_S
    assert 0 <= m.resume.cost < 1e-2
    assert m.cooling is None  # what they pay for a silence is the resume's
