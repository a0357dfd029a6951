"""What the search's walk adds over its best start: the walk before issue 31 part 3 next
to the one with group moves and halving restarts, same seed, same number of proposals.

    python -m benchmarks.walk [--models cnn,gpt2,resnet18]
        [--machines flexflow-p100:2,flexflow-p100:4,dgx-h100:1,dgx-h100:2]
        [--max-evals 1000] [--seed 0] [--ilp-limit 30] [--json FILE]

Walks (``--walks``, any of):

- ``old``: ``Restarts.BEST``, no group moves: chains from the three fastest starts, a
  stalled chain restarted from the best so far or a random strategy;
- ``moves``: the old restarts with group moves (a quarter of the proposals);
- ``halving``: halving restarts without group moves;
- ``new``: both (the default search).

Each search stops on ``--max-evals`` proposals (the time budget is large; the ILP start
gets ``--ilp-limit`` seconds, against the search's default of at most 10) or, as it
does, when its best stalls, so the walks are compared at one number of proposals and every
figure is reproducible; the wall time is this machine's. Models: ``cnn`` the bundled
example at batch 64; ``gpt2`` GPT-2 small's shape (12 layers, width 768, 12 heads,
vocabulary 50,257; ``gpt_onnx.py``) at 16 sequences of 128 tokens; ``resnet18``
torchvision's at reduced width on 32x32 images (tests/torchvision_models.py) at batch 256.
Step times are the simulator's (roofline on the presets' datasheet figures). ``gain`` is
the best start's step time over the walk's final one (1.00: the walk added nothing).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import math
import tempfile
import time
from dataclasses import dataclass

from benchmarks.gpt_onnx import GPT2_SMALL, write_gpt
from benchmarks.models import model_path
from onnx2soap.importer import load_model
from onnx2soap.ir import Graph
from onnx2soap.search.mcmc import Restarts, SearchOptions, SearchResult, mcmc
from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
from onnx2soap.soap import analyze

REPO = Path(__file__).resolve().parents[1]
BATCH = {"cnn": 64, "gpt2": 16, "resnet18": 256}
WALKS = {
    "old": (Restarts.BEST, 0.0),
    "moves": (Restarts.BEST, 0.25),
    "halving": (Restarts.HALVING, 0.0),
    "new": (Restarts.HALVING, 0.25),
}


def load(name: str, folder: Path) -> Graph:
    if name == "cnn":
        return load_model(model_path("cnn"), BATCH[name]).graph
    if name == "gpt2":
        return load_model(write_gpt(folder, GPT2_SMALL, "gpt2"), BATCH[name]).graph
    sys.path.insert(0, str(REPO))
    from tests.torchvision_models import export_family

    return load_model(export_family(name, str(folder), "legacy"), BATCH[name]).graph


@dataclass(frozen=True)
class Row:
    model: str
    ops: int
    machine: str
    devices: int
    walk: str
    best_start: str
    start_ms: float
    final_ms: float
    gain: float
    found_by: str  # the start whose walk reached the final best ("-": the best start itself)
    proposals: int
    setup_s: float
    wall_s: float
    # per distinct start (halving walks): its names, step time and the best its walk
    # reached (ms; None: nothing that fits), proposals
    walks: tuple[tuple[str, float, float | None, int], ...] = ()


def found_by(result: SearchResult) -> str:
    if not result.walks:  # Restarts.BEST: its chains are no start's own
        return ""
    if result.walk_gain == 1.0:
        return "-"
    final = result.evaluation.step_time_s
    walked = [w.names[0] for w in result.walks if w.best_step_time_s == final]
    return walked[0] if walked else "?"


def run(name: str, graph: Graph, spec: str, walk: str, args) -> Row:
    machine = resolve_machine(spec)
    restarts, share = WALKS[walk]
    options = SearchOptions(
        budget_s=3600,
        seed=args.seed,
        max_evals=args.max_evals,
        restarts=restarts,
        group_share=share,
        ilp_time_limit_s=args.ilp_limit,
    )
    began = time.perf_counter()
    result = mcmc(graph, analyze(graph), Simulator(machine, RooflineCost()), options)
    wall = time.perf_counter() - began
    start = result.best_start or "-"
    start_s = result.starts[start].step_time_s if result.best_start else float("nan")
    final = result.evaluation.step_time_s
    return Row(
        name,
        len(graph.ops),
        spec,
        machine.size,
        walk,
        start,
        start_s * 1e3,
        final * 1e3,
        result.walk_gain or float("nan"),
        found_by(result),
        result.proposals,
        result.setup_s,
        wall,
        tuple(
            (
                "=".join(w.names),
                w.start_step_time_s * 1e3,
                w.best_step_time_s * 1e3 if math.isfinite(w.best_step_time_s) else None,
                w.proposals,
            )
            for w in result.walks
        ),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="cnn,gpt2,resnet18")
    parser.add_argument(
        "--machines", default="flexflow-p100:2,flexflow-p100:4,dgx-h100:1,dgx-h100:2"
    )
    parser.add_argument("--walks", default="old,new")
    parser.add_argument("--max-evals", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ilp-limit", type=float, default=30.0, help="the ILP start's time limit (s)"
    )
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    print(
        "| model | machine | devices | walk | best start | start ms | final ms | gain "
        "| found by | proposals | setup s | wall s |"
    )
    print("|---|---|---:|---|---|---:|---:|---:|---|---:|---:|---:|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            graph = load(name, Path(tmp))
            for spec in args.machines.split(","):
                for walk in args.walks.split(","):
                    row = run(name, graph, spec, walk, args)
                    rows.append(row)
                    print(
                        f"| {name} ({row.ops} ops) | {spec} | {row.devices} | {walk} "
                        f"| {row.best_start} | {row.start_ms:.3f} | {row.final_ms:.3f} "
                        f"| {row.gain:.3f} | {row.found_by} | {row.proposals} "
                        f"| {row.setup_s:.1f} | {row.wall_s:.1f} |",
                        flush=True,
                    )
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
