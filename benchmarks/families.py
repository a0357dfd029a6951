"""The torchvision CNN families (reduced widths): import both ways, then the predicted step
time of every baseline the search could have returned next to MCMC's.

    python -m benchmarks.families [--batch 32] [--machine flexflow-p100:4] [--evals 2000]

Needs torch and torchvision (the dev extras). Times are the simulator's (analytic
roofline on the preset's datasheet figures): ratios of predicted times, not hardware
measurements. "no fit" marks a strategy whose peak memory exceeds a device's.
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse

from onnx2soap.errors import UserError
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import Rule, by_rule
from onnx2soap.search.mcmc import SearchOptions, mcmc
from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
from onnx2soap.soap import Partitioner, analyze
from tests.families.conftest import FAMILIES
from tests.torchvision_models import export_family

RULES = (Rule.DATA_PARALLEL, Rule.EXPERT, Rule.MODEL_PARALLEL, Rule.SINGLE_DEVICE)


def _cell(evaluation) -> str:
    text = f"{evaluation.step_time_s * 1e3:8.3f}"
    return text + ("*" if not evaluation.fits else " ")


def _imports(name: str, directory: Path, batch: int) -> dict[str, str]:
    status = {}
    for exporter in ("legacy", "dynamo"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = export_family(name, directory, exporter)
        try:
            graph = load_model(path, batch).graph
            status[exporter] = f"{len(graph.ops)} ops"
        except UserError as e:
            status[exporter] = f"refused: {str(e)[:60]}"
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--machine", default="flexflow-p100:4")
    parser.add_argument("--evals", type=int, default=2000)
    args = parser.parse_args()
    machine = resolve_machine(args.machine)
    sim = Simulator(machine, RooflineCost())
    names = ("data-par", "expert", "model-par", "single")
    print(f"{args.machine}, batch {args.batch}; predicted ms per step (* = does not fit)")
    header = f"{'family':<20}{'legacy':>10}{'dynamo':>10}" + "".join(f"{n:>10}" for n in names)
    header += f"{'MCMC':>10}{'vs DP':>7}{'search':>8}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for name in FAMILIES:
            status = _imports(name, Path(tmp), args.batch)
            graph = load_model(Path(tmp) / f"{name}_legacy.onnx", args.batch).graph
            space = analyze(graph)
            partitioner = Partitioner(graph)
            rules = [
                sim.evaluate(partitioner.partition(by_rule(r, graph, space, machine.size)))
                for r in RULES
            ]
            start = time.perf_counter()
            options = SearchOptions(budget_s=600, seed=0, max_evals=args.evals)
            best = mcmc(graph, space, sim, options).evaluation
            spent = time.perf_counter() - start
            print(
                f"{name:<20}{status['legacy']:>10}{status['dynamo']:>10}"
                + "".join(f"{_cell(e):>10}" for e in rules)
                + f"{_cell(best):>10}{rules[0].step_time_s / best.step_time_s:>6.2f}x"
                + f"{spent:>7.1f}s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
