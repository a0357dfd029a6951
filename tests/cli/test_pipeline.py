"""``plan --strategy pipeline`` and ``--recompute``: the plan file's pipeline, priced by
``simulate`` (text and --json) and drawn by ``show``; bad input is one line, exit 2,
before any work."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from onnx2soap.cli import main as cli
from onnx2soap.importer import load_model
from tests.cli.test_io_errors import one_line

BATCH = "8"


@pytest.fixture(scope="module")
def plans(tmp_path_factory, example_onnx: Path) -> dict[str, Path]:
    """The example CNN on cpu:4: the rule's default pipeline (2 stages of 2 devices, 4
    microbatches of 2, 1F1B), GPipe, and data parallelism with full recomputation."""
    folder = tmp_path_factory.mktemp("pipeline")
    model = folder / "cnn.onnx"
    shutil.copy(example_onnx, model)
    argv = ["plan", str(model), "--batch", BATCH, "--devices", "4", "--strategy"]
    runs = {
        "1f1b": ("pipeline",),
        "gpipe": ("pipeline", "--stages", "2", "--microbatches", "4", "--schedule", "gpipe"),
        "redo": ("pipeline", "--stages", "2", "--microbatches", "4", "--recompute", "all"),
        "dp": ("data-parallel",),
        "dp-redo": ("data-parallel", "--recompute", "all"),
        "dp-selective": ("data-parallel", "--recompute", "selective"),
        "selective": (
            "pipeline",
            "--stages",
            "2",
            "--microbatches",
            "4",
            "--recompute",
            "selective",
        ),
    }
    out = {}
    for name, extra in runs.items():
        out[name] = folder / f"{name}.json"
        assert cli([*argv, *extra, "-o", str(out[name])]) == 0
    return out


def _simulate(plan: Path, capsys, *extra: str) -> dict:
    capsys.readouterr()
    assert cli(["simulate", str(plan), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_plan_holds_the_pipeline(plans, example_onnx) -> None:
    doc = json.loads(plans["1f1b"].read_text())
    pipe = doc["pipeline"]
    assert doc["model"]["batch"] == 8 and pipe["schedule"] == "1f1b" and pipe["microbatches"] == 4
    graph = load_model(example_onnx, 2).graph
    names = [op.name for op in graph.ops]
    assert [n for stage in pipe["stages"] for n in stage] == names  # contiguous, in order
    assert len(pipe["stages"]) == 2 and "recompute" not in doc
    stage_of = {n: s for s, stage in enumerate(pipe["stages"]) for n in stage}
    for op in doc["ops"]:  # data parallel over its stage's 2 devices, at 2 samples
        assert op["devices"] == ([0, 1] if stage_of[op["name"]] == 0 else [2, 3])
    baselines = doc["predicted"]["baselines"]
    assert {"pipeline", "zero"} <= set(baselines)
    assert baselines["pipeline"] == doc["predicted"]["step_time_s"]  # the default shape


def test_simulate_reports_the_stages(plans, capsys) -> None:
    saved = json.loads(plans["1f1b"].read_text())["predicted"]
    doc = _simulate(plans["1f1b"], capsys)
    assert doc["step_time_s"] == saved["step_time_s"]
    assert doc["peak_memory_bytes"] == saved["peak_memory_bytes"]
    pipe = doc["pipeline"]
    assert pipe["schedule"] == "1f1b" and pipe["microbatches"] == 4
    assert [s["held_microbatches"] for s in pipe["stages"]] == [2, 1]  # min(S - s, M)
    assert [s["devices"] for s in pipe["stages"]] == [[0, 1], [2, 3]]
    for s in pipe["stages"]:
        assert s["forward_s"] > 0 and s["backward_s"] > s["forward_s"] and 0 < s["bubble"] < 1
        assert s["tail_s"] >= 0 and s["send_forward_s"] >= 0
    # the step is at least the slowest stage's M passes and at least the fill and drain
    slowest = max(s["forward_s"] + s["backward_s"] for s in pipe["stages"])
    assert doc["step_time_s"] >= 4 * slowest
    gpipe = _simulate(plans["gpipe"], capsys)
    assert [s["held_microbatches"] for s in gpipe["pipeline"]["stages"]] == [4, 4]
    assert max(gpipe["peak_memory_bytes"]) > max(doc["peak_memory_bytes"])
    assert doc["recomputed_ops"] == 0 and _simulate(plans["dp"], capsys)["pipeline"] is None
    capsys.readouterr()
    assert cli(["simulate", str(plans["1f1b"])]) == 0
    text = capsys.readouterr().out
    assert "pipeline         2 stages, 4 microbatches of 2, 1f1b" in text
    assert "bubble" in text and "held" in text


def test_recompute_all(plans, capsys, example_onnx) -> None:
    """The CNN repeats no block: every op but the loss and up to round(sqrt(n))
    checkpoints of its n other ops (one op that takes more than a segment's time reaches
    two marks), written to the plan: more time, no more memory."""
    graph = load_model(example_onnx, 8).graph
    others = [op.name for op in graph.ops if op.name != graph.loss_op.name]
    for plain, redo in (("dp", "dp-redo"), ("1f1b", "redo")):
        doc = json.loads(plans[redo].read_text())
        kept = [name for name in others if name not in doc["recompute"]]
        assert doc["recompute"] == [name for name in others if name not in kept]
        assert 1 <= len(kept) <= round(math.sqrt(len(others)))
        a, b = _simulate(plans[plain], capsys), _simulate(plans[redo], capsys)
        assert b["recomputed_ops"] == len(others) - len(kept)
        assert b["step_time_s"] > a["step_time_s"]
        assert max(b["peak_memory_bytes"]) < max(a["peak_memory_bytes"])


def test_recompute_selective_keeps_the_products(plans, capsys, example_onnx) -> None:
    """Every op but the products (the CNN's Convs and Gemms) and the loss recomputed,
    written to the plan: more time, and less memory than keeping everything, though not
    on every device: a recomputed op keeps every input to run again (Flatten, Concat
    keep none otherwise), so the pipeline's second stage, of few activations, holds a
    little more, its first much less. ``all`` (a checkpoint or two kept, the products
    made again too) holds no more than ``selective``."""
    graph = load_model(example_onnx, 8).graph
    products = {op.name for op in graph.ops if op.type in ("Conv", "Gemm")}
    want = [op.name for op in graph.ops if op.name not in products and not op.is_loss]
    for plain, redo in (("dp", "dp-selective"), ("1f1b", "selective")):
        assert json.loads(plans[redo].read_text())["recompute"] == want
        a, b = _simulate(plans[plain], capsys), _simulate(plans[redo], capsys)
        assert b["recomputed_ops"] == len(want)
        assert b["step_time_s"] > a["step_time_s"]
        assert sum(b["peak_memory_bytes"]) < sum(a["peak_memory_bytes"])
        if plain == "dp":
            assert max(b["peak_memory_bytes"]) < max(a["peak_memory_bytes"])
    full = max(_simulate(plans["dp-redo"], capsys)["peak_memory_bytes"])
    assert full <= max(_simulate(plans["dp-selective"], capsys)["peak_memory_bytes"])


def test_recompute_selective_without_a_product_is_one_line(tmp_path, capsys) -> None:
    """A model of elementwise ops only has no product whose output selective
    recomputation keeps: one line naming what it keeps, exit 2, no plan written."""
    from onnx import TensorProto, helper, save

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 10])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])
    node = helper.make_node("Relu", ["x"], ["y"], name="relu")
    model = helper.make_model(
        helper.make_graph([node], "flat", [x], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    save(model, tmp_path / "flat.onnx")
    out = tmp_path / "p.json"
    argv = ["plan", str(tmp_path / "flat.onnx"), "--batch", BATCH, "--devices", "2"]
    assert (
        cli([*argv, "--strategy", "data-parallel", "--recompute", "selective", "-o", str(out)]) == 2
    )
    one_line(capsys, "--recompute selective", "MatMul, Gemm, Conv", "--recompute all")
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (("--strategy", "pipeline", "--stages", "5"), ("--stages 5: the machine has 4 devices",)),
        (("--strategy", "pipeline", "--microbatches", "3"), ("does not divide the batch of 8",)),
        (
            ("--strategy", "pipeline", "--stages", "2", "--microbatches", "8"),
            ("a microbatch of 1 samples cannot be split over a stage's 2 devices",),
        ),
        (("--stages", "2"), ("--stages goes with --strategy pipeline",)),
        (("--strategy", "expert", "--microbatches", "2"), ("--microbatches goes with --strategy",)),
        (("--strategy", "zero", "--schedule", "gpipe"), ("--schedule goes with --strategy",)),
        (("--recompute", "all"), ("--recompute goes with --strategy",)),
        (("--strategy", "pipeline", "--schedule", "zb"), ("--schedule", "invalid choice")),
        (("--strategy", "pipeline", "--stages", "0"), ("--stages",)),
    ],
)
def test_bad_pipeline_options_are_one_line(plans, tmp_path, capsys, extra, fragments) -> None:
    model = plans["1f1b"].parent / "cnn.onnx"
    argv = ["plan", str(model), "--batch", BATCH, "--devices", "4", "-o", str(tmp_path / "p.json")]
    assert cli([*argv, *extra]) == 2
    one_line(capsys, *fragments)
    assert not (tmp_path / "p.json").exists()


def test_stages_beyond_the_ops_are_refused(example_onnx, tmp_path, capsys) -> None:
    ops = len(load_model(example_onnx, 16).graph.ops)
    argv = ["plan", str(example_onnx), "--batch", "16", "--machine", "cpu:16"]
    extra = ["--strategy", "pipeline", "--stages", "16", "--microbatches", "1"]
    assert cli([*argv, *extra, "-o", str(tmp_path / "p.json")]) == 2
    one_line(capsys, f"--stages 16: the model has {ops} ops")


def test_pictures_and_traces_of_a_pipeline(plans, tmp_path, capsys) -> None:
    """No whole-step timeline of a pipeline yet: --trace, --gantt and compare -o refuse
    in one line naming themselves; show draws the grid alone."""
    plan = str(plans["1f1b"])
    capsys.readouterr()
    assert cli(["simulate", plan, "--trace", str(tmp_path / "t.json")]) == 2
    one_line(capsys, "--trace cannot show a pipeline plan")
    both = ["-o", str(tmp_path / "both.json")]
    assert cli(["compare", plan, str(tmp_path / "measured.json"), *both]) == 2
    one_line(capsys, "-o cannot show a pipeline plan")
    pytest.importorskip("matplotlib")
    out, gantt = tmp_path / "p.png", tmp_path / "g.png"
    assert cli(["show", plan, "-o", str(out), "--gantt", str(gantt)]) == 2
    one_line(capsys, "--gantt cannot show a pipeline plan")
    assert cli(["show", plan, "-o", str(out)]) == 0
    assert out.stat().st_size > 0 and not gantt.exists()


@pytest.mark.mpi
def test_compare_a_pipeline_run(example_onnx, tmp_path, capsys) -> None:
    """The executor runs the rule's plan on 2 ranks (2 stages, 8 microbatches of 1);
    compare puts every microbatch's predicted pass next to the measured ones: an op's
    predicted time is its task's duration in one microbatch's task graph times 8, its
    update once, and the predicted step the schedule's."""
    from onnx2soap.sim import RooflineCost, make_simulator, resolve_machine
    from onnx2soap.soap import Partitioner, analyze, load_plan
    from tests.executor.mpi import mpirun

    model = tmp_path / "cnn.onnx"
    shutil.copy(example_onnx, model)
    plan = tmp_path / "plan.json"
    argv = ["plan", str(model), "--batch", BATCH, "--devices", "2", "--strategy", "pipeline"]
    assert cli([*argv, "-o", str(plan)]) == 0
    trace = tmp_path / "measured.json"
    run = mpirun(plan, 2, tmp_path, "--steps", "3", "--trace", str(trace))
    assert run.returncode == 0, run.stderr[-2000:]
    capsys.readouterr()
    assert cli(["compare", str(plan), str(trace), "--costs", "roofline", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    loaded = load_plan(plan)
    graph = load_model(model, loaded.graph_batch).graph
    pg = Partitioner(graph).partition(loaded.strategy(graph, analyze(graph)))
    sim = make_simulator(resolve_machine("cpu:2"), RooflineCost(), pipeline=loaded.pipeline)
    tg = sim.task_graph(pg, names=True)
    rows = {(r["op"], r["phase"]): r for r in doc["ops"]}
    first = graph.ops[0].name
    one = tg.duration[tg.names.index(f"fwd {first}[0]")]
    assert rows[(first, "fwd")]["predicted_s"] == pytest.approx(8 * one)
    assert rows[(first, "fwd")]["measured_s"] > 0
    update = next(r for r in doc["ops"] if r["phase"] == "update")
    assert update["predicted_s"] == pytest.approx(
        tg.duration[tg.names.index(f"update {update['op']}")]
    )
    assert doc["step"]["predicted_s"] == sim.evaluate(pg).step_time_s
    assert len(doc["memory"]["predicted_bytes"]) == 2 == len(doc["memory"]["measured_bytes"])
