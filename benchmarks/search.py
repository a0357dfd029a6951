"""Predicted step time of data parallelism, the expert strategy and MCMC, and search time.

    python -m benchmarks.search [--budget 30] [--models cnn,alexnet,mlp]
        [--machines flexflow-p100:1,flexflow-p100:4] [--seed 0]

All times are the simulator's (analytic roofline on the preset's datasheet figures), so
this measures the search, not the hardware: speed-ups are ratios of predicted times.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse

from benchmarks.models import model_path
from onnx2soap.importer import load_model
from onnx2soap.search.mcmc import SearchOptions, mcmc
from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
from onnx2soap.soap import analyze

BATCH = {"cnn": 64, "alexnet": 256, "mlp": 64}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=30.0)
    parser.add_argument("--models", default="cnn,alexnet,mlp")
    parser.add_argument("--machines", default="flexflow-p100:1,flexflow-p100:4")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    header = (
        f"{'model':<8}{'batch':>6}  {'machine':<16}{'devices':>8}{'data-par':>11}"
        f"{'expert':>11}{'MCMC':>11}{'vs DP':>7}{'vs exp':>7}{'search':>8}{'sims':>7}"
    )
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        graph = load_model(model_path(name), BATCH[name]).graph
        space = analyze(graph)
        for spec in args.machines.split(","):
            machine = resolve_machine(spec)
            sim = Simulator(machine, RooflineCost())
            result = mcmc(graph, space, sim, SearchOptions(budget_s=args.budget, seed=args.seed))
            dp = result.baselines["data-parallel"].step_time_s
            ex = result.baselines["expert"].step_time_s
            best = result.evaluation.step_time_s
            print(
                f"{name:<8}{BATCH[name]:>6}  {spec:<16}{machine.size:>8}{dp * 1e3:>8.3f} ms"
                f"{ex * 1e3:>8.3f} ms{best * 1e3:>8.3f} ms{dp / best:>6.2f}x{ex / best:>6.2f}x"
                f"{result.time_s:>7.1f}s{result.evaluated:>7}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
