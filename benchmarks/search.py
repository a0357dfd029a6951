"""Predicted step time of every baseline and of MCMC, and search time.

    python -m benchmarks.search [--budget 30] [--max-evals N] [--models cnn,alexnet,mlp]
        [--machines flexflow-p100:1,flexflow-p100:4] [--seed 0]

All times are the simulator's (analytic roofline on the preset's datasheet figures), so
this measures the search, not the hardware: speed-ups are ratios of predicted times.
The baselines are every plan the search could have returned by rule: data parallel,
expert, single device and model parallel, and data parallelism over the first k devices
(``dp:k``, the fastest k shown; the search starts from these too); one that does not fit
in memory is marked ``*`` and is no reference. ``vs best`` is the best of them that fits
over MCMC; ``from`` says whether the best is one of them or the search's own find.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse

from benchmarks.models import model_path
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import BASELINES
from onnx2soap.search.mcmc import SearchOptions, mcmc
from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
from onnx2soap.soap import analyze

BATCH = {"cnn": 64, "alexnet": 256, "mlp": 64}


def _cell(evaluation) -> str:
    mark = "" if evaluation.fits else "*"
    return f"{evaluation.step_time_s * 1e3:.3f} ms{mark}"


def _fastest_narrow(starts) -> str:
    """The fastest data-parallel:k start that fits, as 'k: time' (or '-')."""
    narrow = {n: e for n, e in starts.items() if n.startswith("data-parallel:") and e.fits}
    if not narrow:
        return "-"
    name = min(narrow, key=lambda n: narrow[n].step_time_s)
    return f"{name.split(':')[1]}: {_cell(narrow[name])}"


def add_region_share(parser: argparse.ArgumentParser) -> None:
    """``--region-share``, for the search benchmarks to compare region moves with none."""
    parser.add_argument(
        "--region-share",
        type=float,
        default=SearchOptions.region_share,
        help="share of proposals that move a region (0: one op at a time)",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=30.0)
    parser.add_argument("--models", default="cnn,alexnet,mlp")
    parser.add_argument("--machines", default="flexflow-p100:1,flexflow-p100:4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-evals", type=int, help="stop after N proposals (reproducible)")
    add_region_share(parser)
    args = parser.parse_args()
    header = (
        f"{'model':<8}{'batch':>6}  {'machine':<16}{'devices':>8}"
        + "".join(f"{n:>12}" for n in ("data-par", "expert", "single", "model-par"))
        + f"{'dp:k':>18}{'MCMC':>12}{'vs DP':>7}{'vs best':>8}{'from':>18}"
        + f"{'search':>8}{'sims':>7}"
    )
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        graph = load_model(model_path(name), BATCH[name]).graph
        space = analyze(graph)
        for spec in args.machines.split(","):
            machine = resolve_machine(spec)
            sim = Simulator(machine, RooflineCost())
            options = SearchOptions(
                args.budget, args.seed, max_evals=args.max_evals, region_share=args.region_share
            )
            result = mcmc(graph, space, sim, options)
            rules = [result.baselines[r.value] for r in BASELINES]
            best = result.evaluation.step_time_s
            feasible = min(e.step_time_s for e in result.starts.values() if e.fits)
            narrow = _fastest_narrow(result.starts)
            dp = result.baselines["data-parallel"]
            vs_dp = f"{dp.step_time_s / best:>6.2f}x" if dp.fits else f"{'*':>7}"
            print(
                f"{name:<8}{BATCH[name]:>6}  {spec:<16}{machine.size:>8}"
                + "".join(f"{_cell(e):>12}" for e in rules)
                + f"{narrow:>18}{best * 1e3:>9.3f} ms{vs_dp}{feasible / best:>7.2f}x"
                + f"{result.best_from:>18}{result.time_s:>7.1f}s{result.evaluated:>7}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
