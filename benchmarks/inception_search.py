"""Inception-v3 search on 64 simulated P100s (FlexFlow §8, Table 4): every baseline, the
search's best, and when the search got within 1 % of it.

    python -m benchmarks.inception_search [--width reduced|full] [--per-gpu N]
        [--budget 120] [--seed 0] [--machine flexflow-p100:16] [--region-share 0.25]

FlexFlow trains Inception-v3 with 64 samples per GPU (weak scaling: its Figure 7 plots
samples/s per GPU against an ideal flat line), so the global batch is 64 x devices.

``--width reduced`` (default): torchvision's Inception3 with every conv a quarter as
wide on 75x75 images (tests/torchvision_models.py), 64 per GPU. ``--width full``:
torchvision's Inception3 itself (299x299, 1000 classes, no aux head; exporting it takes
about 20 s); at 64 per GPU even data parallelism needs more than a P100's 16 GiB in our
memory model, so the default there is 32 per GPU.

Times are wall-clock on this machine, in three parts: import (export to ONNX and load),
setup (``mcmc`` until its first proposal: partitioner and simulator, every start
simulated in full) and the search loop. The time to within 1 % of the final best is
counted from the first proposal, so it measures the search, not the setup; when the best
is a strategy built by rule (``from`` names it) the loop found nothing better and that
time is 0. Step times are the simulator's (roofline on the preset's datasheet figures);
``search is`` is a strategy's step time over the search's best.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import tempfile
import time

from benchmarks.search import add_region_share
from onnx2soap.importer import load_model
from onnx2soap.search.mcmc import SearchOptions, SearchResult, mcmc
from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
from onnx2soap.soap import analyze

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PER_GPU = {"reduced": 64, "full": 32}


def export_inception(width: str, directory: str) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.models import export
    from tests.torchvision_models import export_family, import_torchvision

    if width == "reduced":
        return export_family("inception_v3", directory, "legacy")
    import torch

    import_torchvision()
    from torchvision.models.inception import Inception3

    torch.manual_seed(0)
    model = Inception3(num_classes=1000, aux_logits=False, init_weights=False).train()
    example = torch.randn(2, 3, 299, 299)
    return export(model, example, Path(directory) / "inception_v3_full.onnx", "legacy")


def within(result: SearchResult, fraction: float = 0.01) -> float:
    """Seconds after the first proposal at which the best first came within ``fraction``
    of the final best."""
    final = result.evaluation.step_time_s
    return next(h.after_s for h in result.history if h.step_time_s <= final * (1 + fraction))


def table(result: SearchResult, batch: int) -> list[str]:
    best = result.evaluation.step_time_s
    rows = [f"{'strategy':<18}{'step (ms)':>12}{'samples/s':>12}{'search is':>11}  note"]
    for name, ev in result.starts.items():
        note = "" if ev.fits else f"INFEASIBLE ({max(ev.peak_memory_bytes) / 2**30:.1f} GiB)"
        if name == result.best_from:
            note = "= search's best"
        speed = f"{ev.step_time_s / best:>10.2f}x" if ev.fits else f"{'-':>11}"
        rate = batch / ev.step_time_s
        rows.append(f"{name:<18}{ev.step_time_s * 1e3:>12.3f}{rate:>12.0f}{speed}  {note}")
    rows.append(
        f"{'MCMC best':<18}{best * 1e3:>12.3f}{batch / best:>12.0f}{'':>11}  "
        f"from {result.best_from}"
    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", choices=["reduced", "full"], default="reduced")
    parser.add_argument("--per-gpu", type=int, help="samples per GPU (64 reduced, 32 full)")
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--machine", default="flexflow-p100:16")
    add_region_share(parser)
    args = parser.parse_args()
    machine = resolve_machine(args.machine)
    per_gpu = args.per_gpu or DEFAULT_PER_GPU[args.width]
    batch = per_gpu * machine.size

    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        graph = load_model(export_inception(args.width, tmp), batch=batch).graph
    space = analyze(graph)
    import_s = time.perf_counter() - began
    sim = Simulator(machine, RooflineCost())
    options = SearchOptions(budget_s=args.budget, seed=args.seed, region_share=args.region_share)
    result = mcmc(graph, space, sim, options)
    loop_s = result.time_s - result.setup_s

    print(
        f"inception_v3 ({args.width} width, {len(graph.ops)} ops), batch {batch} "
        f"({per_gpu} per GPU) on {args.machine} ({machine.size} devices), seed {args.seed}, "
        f"budget {args.budget:g} s, region share {args.region_share:g}"
    )
    print("\n".join(table(result, batch)))
    last = result.history[-1]
    print(
        f"time: import {import_s:.1f} s, setup {result.setup_s:.1f} s "
        f"({len(result.starts)} starts simulated in full), search loop {loop_s:.1f} s "
        f"({result.proposals} proposals, {result.evaluated} strategies simulated, "
        f"{result.proposals / max(loop_s, 1e-9):.1f} proposals/s)"
    )
    print(
        f"search: within 1 % of its final best {within(result):.1f} s after the first "
        f"proposal; {len(result.history) - 1} improvements on the best start, the last "
        f"{last.after_s:.1f} s in ({last.proposals} proposals); final best "
        f"{result.history[0].step_time_s / last.step_time_s:.4f}x the best start"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
