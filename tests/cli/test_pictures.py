"""`onnx2soap show` and `onnx2soap plot`: valid PNGs of the requested size, one cell per
task drawn in its split's colour, bars for every task, one-line refusals of bad input."""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from onnx2soap.cli import main as cli
from onnx2soap.importer import load_model
from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
from onnx2soap.sim.simulate import simulate
from onnx2soap.soap import PartitionedGraph, Partitioner, analyze, import_loss, load_plan
from onnx2soap.viz.layout import gantt_chart, plan_grid, split_label
from onnx2soap.viz.metrics import read_metrics
from tests.conftest import REPO

PLANS = REPO / "plans"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib"
)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature."""
    assert data[:8] == PNG_SIGNATURE, data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def partitioned(plan_file: Path) -> tuple[PartitionedGraph, dict]:
    plan = load_plan(plan_file)
    graph = load_model(plan.model_path, plan.batch, import_loss(plan)).graph
    space = analyze(graph)
    return Partitioner(graph).partition(plan.strategy(graph, space)), space


def one_line(capsys, *fragments: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err


# --- what is drawn (pure, no matplotlib) ----------------------------------------------------


@pytest.mark.parametrize("name", ["cnn-data-parallel-4.json", "cnn-random-4.json"])
def test_one_cell_per_task_inside_its_slot(name: str) -> None:
    pg, space = partitioned(PLANS / name)
    grid = plan_grid(pg, space)
    assert len(grid.cells) == sum(len(pg.tasks[op.name]) for op in pg.graph.ops)
    assert {(c.op, c.task) for c in grid.cells} == {
        (i, t.index) for i, op in enumerate(pg.graph.ops) for t in pg.tasks[op.name]
    }
    for c in grid.cells:
        assert c.op - 0.5 < c.x and c.x + c.width < c.op + 0.5
        assert c.device - 0.5 < c.y and c.y + c.height < c.device + 0.5
    # Stacked cells of one op on one device do not overlap.
    by_slot: dict[tuple[int, int], list] = {}
    for c in grid.cells:
        by_slot.setdefault((c.op, c.device), []).append(c)
    for cells in by_slot.values():
        spans = sorted((c.y, c.y + c.height) for c in cells)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_splits_and_transfers_of_the_random_plan() -> None:
    pg, space = partitioned(PLANS / "cnn-random-4.json")
    grid = plan_grid(pg, space)
    conv = [c for c in grid.cells if c.op == 0]  # conv1: n4 on devices [1, 1, 3, 1]
    assert {c.split for c in conv} == {"n4"} and sorted(c.device for c in conv) == [1, 1, 1, 3]
    assert "n2·c2" in grid.splits and len(grid.splits) == len(set(grid.splits))
    crossing = {
        (e.producer, s.index, e.consumer, d.index)
        for e, _, s, d in pg.moves()
        if s.device != d.device
    }
    assert grid.transfers_total == len(crossing) == len(grid.transfers) > 0
    capped = plan_grid(pg, space, max_transfers=7)
    assert len(capped.transfers) == 7 and capped.transfers_total == len(crossing)
    # An even sample of all the lines, not the first few edges only.
    assert set(capped.transfers) <= set(grid.transfers)
    assert capped.transfers[-1] not in grid.transfers[:7]


def test_split_labels() -> None:
    pg, space = partitioned(PLANS / "cnn-p100x4-mcmc.json")
    op = pg.graph.ops[0]
    assert split_label(space[op.name], pg.strategy[op.name].degrees) == "single"
    assert plan_grid(pg, space).splits == ("single",)


def test_gantt_has_a_bar_per_task_and_resource() -> None:
    pg, _ = partitioned(PLANS / "cnn-random-4.json")
    machine = resolve_machine("cpu:4")
    simulator = Simulator(machine, RooflineCost())
    tg = simulator.task_graph(pg, names=True)
    gantt = gantt_chart(tg, simulate(tg), machine)
    assert len(gantt.bars) == len(tg.res_idx)
    assert gantt.rows[:4] == ("rank0", "rank1", "rank2", "rank3") and len(gantt.rows) > 4
    assert {b.row for b in gantt.bars} == set(range(len(gantt.rows)))  # no idle link rows
    assert set(gantt.kinds) == {"forward", "backward", "transfer", "allreduce", "update"}
    assert gantt.makespan == pytest.approx(simulator.evaluate(pg).step_time_s)


# --- pictures -------------------------------------------------------------------------------


@needs_matplotlib
@pytest.mark.parametrize("name", ["cnn-data-parallel-4.json", "cnn-random-4.json"])
def test_cells_are_drawn_in_their_split_colours(name: str) -> None:
    from matplotlib.image import imread

    from onnx2soap.viz.render import Size, render_plan, split_colours

    pg, space = partitioned(PLANS / name)
    grid = plan_grid(pg, space)
    picture = render_plan(grid, None, Size(1200, 700, 100))
    assert png_size(picture.png) == (1200, 700)
    assert len(picture.cell_pixels) == len(grid.cells)
    image = imread(io.BytesIO(picture.png), format="png")
    colours = split_colours(grid.splits)
    for cell, (x, y) in zip(grid.cells, picture.cell_pixels, strict=True):
        pixel = image[int(y), int(x), :3]
        assert np.allclose(pixel, colours[cell.split][:3], atol=2 / 255), (cell, pixel)


@needs_matplotlib
def test_show_writes_grid_and_gantt(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.png"
    plan = str(PLANS / "cnn-random-4.json")
    assert cli(["show", plan, "-o", str(out), "--size", "997x613", "--dpi", "97"]) == 0
    assert png_size(out.read_bytes()) == (997, 613)
    grid, gantt = tmp_path / "grid.png", tmp_path / "sub" / "gantt.png"
    args = ["show", plan, "-o", str(grid), "--gantt", str(gantt), "--size", "800x500"]
    assert cli(args) == 0
    assert png_size(grid.read_bytes()) == png_size(gantt.read_bytes()) == (800, 500)
    assert grid.read_bytes() != gantt.read_bytes()
    # Another machine of the same size: its own Gantt rows.
    args = ["show", plan, "-o", str(out), "--machine", "flexflow-p100:1"]
    assert cli(args) == 0 and png_size(out.read_bytes()) == (1600, 1000)


@needs_matplotlib
def test_show_refuses_bad_input_in_one_line(tmp_path: Path, capsys) -> None:
    plan = str(PLANS / "cnn-data-parallel-4.json")
    out = str(tmp_path / "p.png")
    assert cli(["show", str(tmp_path / "missing.json"), "-o", out]) == 2
    one_line(capsys, "missing.json")
    (tmp_path / "file").write_text("")
    assert cli(["show", plan, "-o", str(tmp_path / "file" / "p.png")]) == 2
    one_line(capsys, "file/p.png", "cannot write")
    assert cli(["show", plan, "-o", str(tmp_path)]) == 2
    one_line(capsys, "folder")
    assert cli(["show", plan, "-o", out, "--gantt", out]) == 2
    one_line(capsys, "--gantt")
    assert cli(["show", plan, "-o", out, "--machine", "cpu:2"]) == 2
    one_line(capsys, "4 devices")
    for size in ("10x10", "100", "1e3x500", "800x90000"):
        assert cli(["show", plan, "-o", out, "--size", size]) == 2
        one_line(capsys, "--size")
    assert not (tmp_path / "p.png").exists()


def test_without_matplotlib_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails, find_spec says None
    plan = str(PLANS / "cnn-data-parallel-4.json")
    assert cli(["show", plan, "-o", str(tmp_path / "p.png")]) == 2
    one_line(capsys, "needs matplotlib: pip install 'onnx2soap[plots]'")
    metrics = write_run(tmp_path / "run.jsonl")
    assert cli(["plot", str(metrics), "-o", str(tmp_path / "l.png")]) == 2
    one_line(capsys, "needs matplotlib")


# --- loss curves ----------------------------------------------------------------------------


def write_run(path: Path, steps: int = 50, accuracy: bool = True) -> Path:
    lines = [json.dumps({"ranks": ["0=host:1"]})]  # not a metric: ignored
    for s in range(1, steps + 1):
        loss = 2.3 * math.exp(-s / 20)
        lines.append(
            json.dumps({"step": s, "loss": loss, "lr": 0.01, "time_s": 0.03, "samples_per_s": 1e3})
        )
        if s % 10 == 0:
            ev = {"step": s, "eval_loss": loss + 0.1, "new_key": [1]}
            if accuracy:
                ev["eval_accuracy"] = 1 - loss / 2.3
            lines.append(json.dumps(ev))
    lines += [json.dumps({"summary": {"steps": steps}}), ""]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_metrics(tmp_path: Path) -> None:
    metrics = read_metrics(write_run(tmp_path / "run.jsonl"))
    assert [p.step for p in metrics.train] == list(range(1, 51))
    assert [p.step for p in metrics.eval] == [10, 20, 30, 40, 50]
    assert all(p.accuracy is not None for p in metrics.eval) and metrics.nonfinite == 0
    plain = read_metrics(write_run(tmp_path / "mse.jsonl", accuracy=False))
    assert all(p.accuracy is None for p in plain.eval)
    nan = tmp_path / "nan.jsonl"
    nan.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": NaN}\n')
    assert read_metrics(nan).nonfinite == 1


@needs_matplotlib
@pytest.mark.parametrize("accuracy", [True, False])
def test_plot_writes_a_png(tmp_path: Path, accuracy: bool, capsys) -> None:
    run = write_run(tmp_path / "run.jsonl", accuracy=accuracy)
    out = tmp_path / "loss.png"
    assert cli(["plot", str(run), "-o", str(out), "--size", "640x480"]) == 0
    assert png_size(out.read_bytes()) == (640, 480)
    assert "50 training and 5 evaluation points" in capsys.readouterr().out


@needs_matplotlib
@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n', "line 2: not JSON"),
        ('{"step": 1, "loss": 2.0}\n[1, 2]\n', "line 2: not a JSON object"),
        ('\n{"step": "3", "loss": 2.0}\n', "line 2: 'step' must be"),
        ('{"step": true, "loss": 2.0}\n', "line 1: 'step' must be"),
        ('{"step": 1, "loss": "low"}\n', "line 1: 'loss' must be a number"),
        ('{"step": 1, "eval_loss": 1, "eval_accuracy": "x"}\n', "line 1: 'eval_accuracy'"),
        ('{"step": 1, "loss": 1}\n' + "[" * 100_000 + "\n", "line 2:"),
        ('{"summary": {}}\n', "no training or evaluation lines"),
        ("", "no training or evaluation lines"),
    ],
)
def test_plot_refuses_bad_lines(tmp_path: Path, text: str, fragment: str, capsys) -> None:
    run = tmp_path / "run.jsonl"
    run.write_text(text)
    assert cli(["plot", str(run), "-o", str(tmp_path / "l.png")]) == 2
    one_line(capsys, str(run), fragment)
    assert not (tmp_path / "l.png").exists()


@needs_matplotlib
def test_plot_refuses_bad_paths(tmp_path: Path, capsys) -> None:
    assert cli(["plot", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "l.png")]) == 2
    one_line(capsys, "none.jsonl", "no such metrics file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    (tmp_path / "file").write_text("")
    # The output is checked before the metrics are read.
    assert cli(["plot", str(bad), "-o", str(tmp_path / "file" / "l.png")]) == 2
    one_line(capsys, "file/l.png", "cannot write")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b'{"step": 1, "loss": 1}\n\xff\xfe\n')
    assert cli(["plot", str(binary), "-o", str(tmp_path / "l.png")]) == 2
    one_line(capsys, "line 2: not UTF-8")
