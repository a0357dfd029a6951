"""Strategies by rule side by side, as the simulator predicts them: per model and machine,
the step time and the largest per-device peak memory of data parallelism, ZeRO-1,
ZeRO-2, pipelines (GPipe and 1F1B, the pipeline rule's default shape) and Megatron-LM,
each without and with full recomputation (every op but the loss), and whether it fits.

    python -m benchmarks.strategies [--models gpt_1.3b,llama3_8b,wide_resnet]
        [--cells alpa-v100:16,dgx-h100:64] [--optimizer adam] [--models-dir DIR]
        [--budget 20] [--no-search]

Models are the suite's (``benchmarks/suite_models.py``), exported beforehand to
``--models-dir`` (``python -m benchmarks.suite_models -o DIR``; missing ones are
exported there) at ``per_device`` x devices samples (weak scaling; not the suite's
``devices_per_sample``, which gives LLaMA one sequence a node: a pipeline needs samples
to cut into microbatches, and every strategy here plans the same batch) in the suite's
precision, with roofline costs of the preset's datasheet. The pipeline is the rule's default shape
(``search/pipeline_rule.py``: a stage per node, at least 2; the most microbatches up to
4 a stage whose samples fill a stage's devices).

Each cell then gets a ``searched`` row: the plan ``onnx2soap plan MODEL --batch B
--machine M --budget S --seed 0 --json`` returns for the same batch, precision and
optimizer (run in this process, its plan written to a temporary folder), with the step
time and largest per-device peak of its ``predicted`` block and what it is (a pipeline
and its shape, whether the walk inside it moved it, ZeRO, recomputation, or the walk's
plan and the start it came from). The search chooses recomputation itself, so its
figures stand in the plain columns and the recompute ones say "—". Where no plan fits,
``plan`` exits 2 with one line: the row gives its gist. Each cell's HTML comment gives
the rules' seconds and the search's wall seconds (import, walk and pipeline choice;
``mcmc`` the walk's own, ``pipelines`` the choice's). ``--no-search`` leaves the row out.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass

DEFAULT_MODELS = "gpt_1.3b,llama3_8b,wide_resnet"
DEFAULT_CELLS = "alpa-v100:16,dgx-h100:64"
GIB = 2**30


@dataclass(frozen=True)
class Row:
    strategy: str
    plain: object  # sim.Evaluation
    recomputed: object


def _cells(text: str) -> list[tuple[str, int]]:
    out = []
    for cell in text.split(","):
        preset, devices = cell.split(":")
        out.append((preset, int(devices)))
    return out


def _model_path(name: str, folder: Path) -> Path:
    from benchmarks.suite_models import export_model, suite_model

    path = folder / f"{name}.onnx"
    if not path.exists():
        export_model(suite_model(name), folder)
    return path


def rows_for(path: Path, name: str, preset: str, devices: int, optimizer: str) -> tuple[int, list]:
    """(batch, rows) of one model on one machine."""
    from benchmarks.suite import machine_spec
    from benchmarks.suite_models import suite_model
    from onnx2soap.importer import load_model
    from onnx2soap.search.baselines import data_parallel
    from onnx2soap.search.megatron import megatron, node_size
    from onnx2soap.search.pipeline_rule import default_shape, full_recompute, pipeline_plan
    from onnx2soap.sim import RooflineCost, make_simulator, resolve_machine
    from onnx2soap.sim.memory import OPTIMIZER_SLOTS
    from onnx2soap.soap import Partitioner, analyze
    from onnx2soap.soap.pipeline import Pipeline, Schedule
    from onnx2soap.soap.zero import ZeroStage

    spec = suite_model(name)
    machine = resolve_machine(machine_spec(preset, devices))
    slots, precision = OPTIMIZER_SLOTS[optimizer], spec.precision
    batch = spec.per_device * devices
    graph = load_model(path, batch).graph
    space = analyze(graph)
    partitioner = Partitioner(graph)
    everything = full_recompute(graph)

    def both(pg, zero=ZeroStage.NONE, pipeline=None, names=everything):
        return tuple(
            make_simulator(
                machine, RooflineCost(), slots, precision, zero, pipeline, redo
            ).evaluate(pg)
            for redo in ((), names)
        )

    rows = []
    dp = partitioner.partition(data_parallel(graph, space, devices))
    rows.append(Row("data parallel", *both(dp)))
    rows.append(Row("ZeRO-1", *both(dp, ZeroStage.OPTIMIZER)))
    rows.append(Row("ZeRO-2", *both(dp, ZeroStage.GRADIENTS)))
    del dp
    shape = default_shape(machine, batch, len(graph.ops))
    if shape is not None:
        stages, microbatches = shape
        micro = load_model(path, batch // microbatches).graph
        micro_space = analyze(micro)
        plain = make_simulator(machine, RooflineCost(), slots, precision)
        built = pipeline_plan(micro, micro_space, plain, stages, microbatches)
        pg = Partitioner(micro).partition(built.strategy)
        for schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
            pipe = Pipeline(built.pipeline.stages, microbatches, schedule)
            label = f"pipeline {schedule.value} {stages}x{microbatches}"
            rows.append(Row(label, *both(pg, pipeline=pipe, names=full_recompute(micro))))
    mega = partitioner.partition(megatron(graph, space, devices, node_size(machine)))
    rows.append(Row("Megatron", *both(mega)))
    return batch, rows


@dataclass(frozen=True)
class Searched:
    """``plan``'s searched plan of a cell, or the one line it refused with."""

    what: str
    step_s: float | None = None  # None: no plan (``what`` says why)
    peak_bytes: int = 0
    fits: bool = False
    wall_s: float = 0.0
    mcmc_s: float | None = None  # the walk's seconds
    pipelines_s: float | None = None  # the pricing of pipelines and recomputation after it


def _gist(stderr: str) -> str:
    """``plan``'s one error line, shortened for a table cell."""
    line = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
    line = line.removeprefix("onnx2soap: error: ").split(";")[0]
    if "fits in device memory" in line:
        closest = line.partition("(the closest, ")[2].partition(")")[0]
        return "no plan fits" + (f" (closest: {closest})" if closest else "")
    return line if len(line) <= 100 else line[:99] + "…"


def _what(doc: dict, plan: dict) -> str:
    """What the searched plan is, from ``plan --json``'s summary and the plan file."""
    zero = f", ZeRO-{doc['zero_stage']}" if doc.get("zero_stage") else ""
    redo = f", recompute {len(plan['recompute'])} ops" if plan.get("recompute") else ""
    chosen = doc.get("pipeline_chosen")
    if chosen and chosen["stages"]:
        words = f"pipeline {chosen['stages']}x{chosen['microbatches']} {chosen['schedule']}"
        walk = doc.get("pipeline_walk")
        if chosen["walked"] and walk:
            degrees = "/".join(str(s["tensor_parallel"]) for s in walk["stages"])
            words += f", walked (tensor parallel {degrees})"
        return words + zero + redo
    if chosen and not chosen["recompute"]:  # the ``zero`` baseline, faster than the walk's
        return f"ZeRO-{doc['zero_stage']} data parallel"
    best, gain = doc.get("best_start"), doc.get("walk_gain") or 1.0
    if best is None:
        words = "the walk's own"
    elif gain > 1.0:
        words = f"walked from {best['name']} ({gain:.2f}x)"
    else:  # the walk found nothing faster than its best start
        words = f"{best['name']} (start kept)"
    return words + zero + redo


def searched(path: Path, name: str, preset: str, devices: int, optimizer: str, budget: float):
    """``onnx2soap plan``'s searched plan for the cell, in this process."""
    from benchmarks.suite import machine_spec
    from benchmarks.suite_models import suite_model
    from onnx2soap.cli import main as onnx2soap_main
    from onnx2soap.sim import resolve_machine

    spec = suite_model(name)
    machine = machine_spec(preset, devices)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        argv = ["plan", str(path), "--batch", str(spec.per_device * devices)]
        argv += ["--machine", machine, "--budget", str(budget), "--seed", "0"]
        argv += ["--optimizer", optimizer, "--precision", spec.precision.value]
        argv += ["--json", "--quiet", "-o", str(out)]
        stdout, stderr = io.StringIO(), io.StringIO()
        began = time.perf_counter()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = onnx2soap_main(argv)
        wall = time.perf_counter() - began
        if code == 2:  # a user error: one line, e.g. no plan fits in device memory
            return Searched(_gist(stderr.getvalue()), wall_s=wall)
        if code != 0:
            raise SystemExit(f"{name} on {machine}: plan exited {code}:\n{stderr.getvalue()}")
        doc = json.loads(stdout.getvalue().strip().splitlines()[-1])
        plan = json.loads(out.read_text())
    predicted = plan["predicted"]
    peaks = predicted["peak_memory_bytes"]
    room = resolve_machine(machine).devices
    fits = all(m <= d.memory for m, d in zip(peaks, room, strict=False))
    return Searched(
        _what(doc, plan),
        predicted["step_time_s"],
        max(peaks),
        fits,
        wall,
        doc.get("search_time_s"),
        doc.get("pipeline_s"),
    )


def _searched_cells(s: Searched) -> str:
    if s.step_s is None:
        return "— | — | no | — | — | — |"
    fits = "yes" if s.fits else "no"
    return f"{s.step_s * 1e3:,.1f} | {s.peak_bytes / GIB:,.1f} | {fits} | — | — | — |"


def _cell(ev) -> str:
    fits = "yes" if ev.fits else "no"
    return f"{ev.step_time_s * 1e3:,.1f} | {max(ev.peak_memory_bytes) / GIB:,.1f} | {fits}"


HEADER = (
    "| model | machine | batch | strategy | step ms | peak GiB | fits "
    "| step ms (recompute) | peak GiB (recompute) | fits (recompute) |"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated suite names")
    parser.add_argument("--cells", default=DEFAULT_CELLS, help="PRESET:DEVICES, comma-separated")
    parser.add_argument("--optimizer", default="adam", help="its state counts in memory")
    parser.add_argument("--models-dir", type=Path, default=Path("build/suite/models"))
    parser.add_argument("--budget", type=float, default=20.0, help="the search's seconds")
    parser.add_argument("--no-search", action="store_true", help="no searched row")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.strategies " + " ".join(argv or sys.argv[1:])
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    host = f"{platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, Python "
    print(f"# {command.strip()}")
    print(f"# {now}; {host}{platform.python_version()}; optimizer {args.optimizer}")
    print(HEADER)
    print("|---" * (HEADER.count("|") - 1) + "|")
    for name in args.models.split(","):
        path = _model_path(name, args.models_dir)
        for preset, devices in _cells(args.cells):
            began = time.perf_counter()
            batch, rows = rows_for(path, name, preset, devices, args.optimizer)
            for row in rows:
                print(
                    f"| {name} | {preset}:{devices} | {batch} | {row.strategy} | "
                    f"{_cell(row.plain)} | {_cell(row.recomputed)} |",
                    flush=True,
                )
            took = time.perf_counter() - began
            if args.no_search:
                print(f"<!-- {name} on {preset}:{devices}: {took:.0f} s -->", flush=True)
                continue
            s = searched(path, name, preset, devices, args.optimizer, args.budget)
            print(
                f"| {name} | {preset}:{devices} | {batch} | searched: {s.what} | "
                f"{_searched_cells(s)}",
                flush=True,
            )
            parts = [f"mcmc {s.mcmc_s:.0f} s"] if s.mcmc_s is not None else []
            parts += [f"pipelines {s.pipelines_s:.0f} s"] if s.pipelines_s is not None else []
            mcmc = f" ({', '.join(parts)})" if parts else ""
            print(
                f"<!-- {name} on {preset}:{devices}: rules {took:.0f} s; search "
                f"{s.wall_s:.0f} s wall{mcmc}, budget {args.budget:g} s -->",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
