"""`onnx2soap compare PLAN MEASURED`: the simulator's step next to a 2-rank run's trace.

One mpiexec run of the example CNN with --trace; the per-op measured times are checked
against a sum computed here from the trace file, the step against the latest event end
per step, the Perfetto output for both timelines, the chart for its size, and bad input
for one-line refusals."""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from onnx2soap.cli import main as cli
from tests.cli.test_pictures import needs_matplotlib, one_line, png_size
from tests.executor.mpi import make_plan, mpirun

pytestmark = pytest.mark.mpi
BATCH, STEPS = 8, 4  # steps 2..4 are traced


@pytest.fixture(scope="module")
def traced(example_onnx: Path, tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("compare")
    plan = folder / "plan.json"
    make_plan(example_onnx, plan, 2, BATCH, "random", 1)
    trace = folder / "measured.json"
    run = mpirun(plan, 2, folder, "--steps", str(STEPS), "--trace", str(trace))
    assert run.returncode == 0, run.stderr[-2000:]
    return plan, trace


def compare_json(plan: Path, trace: Path, capsys, *extra: str) -> dict:
    assert cli(["compare", str(plan), str(trace), "--costs", "roofline", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_measured_times_are_the_trace_s(traced, capsys) -> None:
    plan, trace = traced
    doc = compare_json(plan, trace, capsys)
    written = json.loads(trace.read_text())
    events = [e for e in written["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["args"]["step"] for e in events}) == list(range(2, STEPS + 1))
    # Step 2 ran under tracemalloc (the file says so): the medians are over the others.
    assert written["otherData"]["memory_step"] == 2
    steps = list(range(3, STEPS + 1))
    events = [e for e in events if e["args"]["step"] != 2]
    sums: dict[tuple[str, str], dict[int, float]] = defaultdict(lambda: dict.fromkeys(steps, 0.0))
    ends = dict.fromkeys(steps, 0.0)
    for e in events:
        ends[e["args"]["step"]] = max(ends[e["args"]["step"]], (e["ts"] + e["dur"]) / 1e6)
        name = e["name"]
        if e["cat"] == "update":
            key = (name.removeprefix("update "), "update")
        elif e["cat"] in ("forward", "backward"):
            key = (name.split("[")[0].split(" ", 1)[1], name[:3])
        else:
            continue
        sums[key][e["args"]["step"]] += e["dur"] / 1e6
    rows = {(r["op"], r["phase"]): r for r in doc["ops"]}
    assert set(rows) == set(sums)
    for key, per_step in sums.items():
        assert rows[key]["measured_s"] == pytest.approx(statistics.median(per_step.values()))
        assert rows[key]["predicted_s"] > 0
    measured = [r["measured_s"] for r in doc["ops"]]
    assert measured == sorted(measured, reverse=True)
    # Per rank: compute, other instructions, waits (and the step after the rank's last
    # instruction), the rest between instructions; medians over the steps.
    parts: dict[tuple[int, int], list[float]] = {}
    for r in (0, 1):
        for s in steps:
            mine = [e for e in events if e["pid"] == r and e["args"]["step"] == s]
            busy = [sum(e["dur"] for e in mine if e["cat"] in ("forward", "backward", "update"))]
            busy.append(
                sum(
                    e["dur"]
                    for e in mine
                    if e["cat"] not in ("forward", "backward", "update")
                    and not e["name"].startswith("wait ")
                )
            )
            waits = sum(e["dur"] for e in mine if e["name"].startswith("wait "))
            last = max(e["ts"] + e["dur"] for e in mine)
            between = last - busy[0] - busy[1] - waits
            parts[(r, s)] = [x / 1e6 for x in (*busy, waits + ends[s] * 1e6 - last, between)]
    assert [row["rank"] for row in doc["ranks"]] == [0, 1]
    for row in doc["ranks"]:
        got = row["measured"]
        for k, name in enumerate(("compute_s", "messages_s", "waiting_s", "between_s")):
            want = statistics.median(parts[(row["rank"], s)][k] for s in steps)
            assert got[name] == pytest.approx(want, abs=1e-9)
        assert got["compute_s"] > 0 and got["messages_s"] > 0 and got["between_s"] > 0
    assert doc["step"]["measured_steps_s"] == pytest.approx([ends[s] for s in steps])
    assert doc["step"]["measured_s"] == pytest.approx(statistics.median(ends.values()))
    simulated = compare_json(plan, trace, capsys)["step"]["predicted_s"]
    assert cli(["simulate", str(plan), "--costs", "roofline", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert simulated == alone["step_time_s"]
    assert doc["memory"]["predicted_bytes"] == alone["peak_memory_bytes"]
    assert (
        doc["memory"]["measured_bytes"]
        == json.loads(trace.read_text())["otherData"]["peak_memory_bytes"]
    )


def test_table_and_both_timelines(traced, tmp_path: Path, capsys) -> None:
    plan, trace = traced
    both = tmp_path / "both.json"
    assert cli(["compare", str(plan), str(trace), "--costs", "roofline", "-o", str(both)]) == 0
    out = capsys.readouterr().out
    assert "/conv1/Conv fwd" in out and "step: predicted" in out and "device 1" in out
    events = json.loads(both.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[0] == "predicted device 0" and names[1] == "predicted device 1"
    assert names[100] == "measured rank 0" and names[101] == "measured rank 1"
    timed = {e["pid"] for e in events if e["ph"] == "X"}
    assert {0, 1, 100, 101} <= timed
    assert "per rank, predicted / measured" in out
    # The predicted parts: the device's compute tasks and the other tasks that hold it,
    # summed from the predicted timeline written for Perfetto; the rest is waiting.
    doc = compare_json(plan, trace, capsys)
    step = doc["step"]["predicted_s"]
    for row in doc["ranks"]:
        d, got = row["rank"], row["predicted"]
        held = [e for e in events if e["ph"] == "X" and e["pid"] == d]
        compute = sum(e["dur"] for e in held if e["cat"] in ("forward", "backward", "update"))
        other = sum(e["dur"] for e in held) - compute
        assert got["compute_s"] == pytest.approx(compute / 1e6)
        assert got["messages_s"] == pytest.approx(other / 1e6)
        assert got["waiting_s"] == pytest.approx(step - (compute + other) / 1e6)
        assert got["between_s"] == 0


@needs_matplotlib
def test_chart_has_the_requested_size(traced, tmp_path: Path, capsys) -> None:
    plan, trace = traced
    chart = tmp_path / "chart.png"
    args = ["compare", str(plan), str(trace), "--chart", str(chart), "--size", "900x700"]
    assert cli([*args, "--costs", "roofline"]) == 0
    assert png_size(chart.read_bytes()) == (900, 700)


def test_refusals_in_one_line(traced, example_onnx: Path, tmp_path: Path, capsys, monkeypatch):
    plan, trace = traced
    base = ["compare", str(plan)]
    assert cli([*base, str(tmp_path / "missing.json")]) == 2
    one_line(capsys, "missing.json")
    simulated = tmp_path / "simulated.json"
    assert cli(["simulate", str(plan), "--trace", str(simulated)]) == 0
    capsys.readouterr()
    assert cli([*base, str(simulated)]) == 2
    one_line(capsys, "not a measured trace")
    other = tmp_path / "other.json"
    make_plan(example_onnx, other, 2, BATCH, "model-parallel")
    capsys.readouterr()
    assert cli(["compare", str(other), str(trace)]) == 2
    one_line(capsys, "not a trace of this plan")
    four = tmp_path / "four.json"
    make_plan(example_onnx, four, 4, BATCH, "data-parallel")
    capsys.readouterr()
    assert cli(["compare", str(four), str(trace)]) == 2
    one_line(capsys, "2 ranks", "4 devices")
    (tmp_path / "file").write_text("")
    assert cli([*base, str(trace), "-o", str(tmp_path / "file" / "both.json")]) == 2
    one_line(capsys, "cannot write")
    assert cli([*base, str(trace), "-o", str(tmp_path)]) == 2
    one_line(capsys)
    doc = json.loads(trace.read_text())
    doc["otherData"]["memory_step"] = "2"
    bad = tmp_path / "bad_memory_step.json"
    bad.write_text(json.dumps(doc))
    assert cli([*base, str(bad)]) == 2
    one_line(capsys, "otherData.memory_step must be an integer")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli([*base, str(trace), "--chart", str(tmp_path / "c.png")]) == 2
    one_line(capsys, "needs matplotlib: pip install 'onnx2soap[plots]'")
