"""The papers' suite through ``onnx2soap plan``: the walk, then ZeRO, pipelines and
recomputation (issue 31, part 4).

    python -m benchmarks.suite_plan [--models gpt_1.3b,...] [--presets alpa-v100,...]
        [--devices 8,16,64] [--budget 20] [--optimizer sgd] [--work DIR]

``benchmarks/suite.py`` times the walk alone: where no plain plan fits a device, its row
says so. A user runs ``plan``, which after the walk prices pipelines, recomputation and
ZeRO and returns the fastest that fits. This runs ``plan`` on each cell (the suite's
models, exported once into ``--work``; the suite's batch and precision; the costs
``plan`` picks for the preset: ``--costs auto``, the published kernel rates of H100s and
A100s, the datasheet's roofline for the papers' V100s and P100s) in a process of its
own, timed from start to exit with its own peak RSS, and prints a row per cell:

``returns`` the plan ``plan`` wrote; ``step`` its predicted step; ``best rule`` the
fastest plan a rule builds that fits (the baselines, the pipeline rule's shapes and the
rules' plans recomputing, each as ``plan`` priced it); ``rule/plan`` their ratio;
``walk + setup s``, ``pipeline s`` the seconds of the walk and of the choice after it
(``plan --json``'s ``search_time_s`` and ``pipeline_s``); ``wall s``, ``peak GB`` the
whole command's, import included. A cell ``plan`` refuses shows its one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import math

from benchmarks.peak_rss import measure
from benchmarks.suite import GB, TARGET_GAIN, Cell, _ms, exported, machine_spec
from benchmarks.suite_models import suite_model

MODELS = ("gpt_1.3b", "gpt_2.6b", "moe_2.4b", "wide_resnet")
PRESETS = ("alpa-v100",)
DEVICES = (8, 16, 64)

HEADER = (
    "| model | preset | devices | batch | returns | step | best rule that fits | rule/plan "
    "| walk + setup s | pipeline s | wall s | peak GB |"
)


def plan_cell(cell: Cell, model: Path, work: Path, budget: float, optimizer: str) -> dict:
    """``onnx2soap plan`` on the cell: its JSON, or its one-line refusal, with the
    command's wall time and peak RSS."""
    spec = suite_model(cell.model)
    batch = spec.batch(cell.devices)
    out = work / "plans" / f"{cell.key}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "onnx2soap", "plan", str(model), "--batch", str(batch)]
    argv += ["--machine", machine_spec(cell.preset, cell.devices), "--budget", str(budget)]
    argv += ["--precision", spec.precision.value, "--optimizer", optimizer, "--seed", "0"]
    argv += ["--json", "-o", str(out)]
    printed = out.with_suffix(".out.json")  # plan --json's report (measure keeps no stdout)
    printed.unlink(missing_ok=True)
    got = measure(["sh", "-c", 'exec "$@" > "$0"', str(printed), *argv], None)
    doc: dict = {"batch": batch, "wall_s": got.wall_s, "peak_rss": got.peak_rss}
    if got.exit_code:  # its last line whole (``got.error`` is cut at 160 characters)
        lines = got.stderr.strip().splitlines()
        doc["error"] = lines[-1] if lines else f"exit {got.exit_code}"
        return doc
    doc.update(json.loads(printed.read_text()))
    return doc


def returned(doc: dict) -> str:
    """The plan ``plan`` wrote, in words."""
    chosen, zero = doc.get("pipeline_chosen"), doc.get("zero_stage", 0)
    if chosen is None:
        words = "the walk's plan"
    elif chosen["stages"] > 0:
        words = f"{chosen['stages']} stages × {chosen['microbatches']} microbatches, "
        words += chosen["schedule"]
        walk = doc.get("pipeline_walk")
        if chosen["walked"] and walk:
            degrees = "/".join(str(s["tensor_parallel"]) for s in walk["stages"])
            words += f", tensor parallel {degrees} (walked)"
        zero = chosen["zero_stage"]
    elif chosen["recompute"]:
        words = "the walk's plan" if chosen["of"] == "walk" else chosen["of"]
        zero = chosen["zero_stage"]
    else:
        words = "data parallel"
        zero = chosen["zero_stage"]
    if chosen and chosen["recompute"]:
        words += ", recomputing"
    return words + (f", ZeRO-{zero}" if zero else "")


def best_rule(doc: dict) -> tuple[str, float] | None:
    """The fastest plan a rule built that fits: a baseline, a shape of the pipeline
    rule, or a rule's plan recomputing; None where none fits."""
    infeasible = set(doc["infeasible_baselines"])
    found = {n: s for n, s in doc["baselines"].items() if n not in infeasible}
    for t in doc.get("pipeline_tried") or ():
        if not t["fits"] or t["walked"] or t["of"] == "walk":
            continue
        redo = " recomputing" if t["recompute"] else ""
        if t["stages"] > 0:
            name = f"pipeline {t['stages']}×{t['microbatches']} {t['schedule']}{redo}"
        else:
            name = f"{t['of']}{redo}"
        found[name] = min(t["step_time_s"], found.get(name, math.inf))
    if not found:
        return None
    name = min(found, key=found.get)
    return name, found[name]


def row(cell: Cell, doc: dict) -> str:
    head = f"| {cell.model} | {cell.preset} | {cell.devices} | {doc['batch']} | "
    tail = f"{doc['wall_s']:.0f} | {doc['peak_rss'] / GB:.1f} |"
    if "error" in doc:  # plan's one line, without its prefix and its advice
        why = doc["error"].removeprefix("onnx2soap: error: ").split("; use a machine")[0]
        return head + why.replace("|", "/")[:200] + " | | | | | | " + tail
    step = doc["predicted_step_time_s"]
    rule = best_rule(doc)
    if rule is None:
        rule_words, ratio = "none fits", "no rule fits"
    else:
        rule_words, gain = f"{rule[0]}, {_ms(rule[1])}", rule[1] / step
        ratio = f"**{gain:.2f}×**" if gain >= TARGET_GAIN else f"{gain:.2f}×"
    pipeline_s = doc.get("pipeline_s")
    cells = [
        returned(doc),
        _ms(step),
        rule_words,
        ratio,
        f"{doc['search_time_s']:.1f}",
        "-" if pipeline_s is None else f"{pipeline_s:.1f}",
    ]
    return head + " | ".join(cells) + " | " + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--devices", default=",".join(map(str, DEVICES)))
    parser.add_argument("--budget", type=float, default=20.0, help="plan's --budget a cell")
    parser.add_argument("--optimizer", default="sgd", help="plan's --optimizer (the suite's)")
    parser.add_argument("--work", type=Path, default=Path("build/suite"), help="cache folder")
    args = parser.parse_args(argv)
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    for name in args.models.split(","):
        model, _ = exported(name, args.work)
        for preset in args.presets.split(","):
            for devices in map(int, args.devices.split(",")):
                cell = Cell(name, preset, devices)
                doc = plan_cell(cell, model, args.work, args.budget, args.optimizer)
                print(row(cell, doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
