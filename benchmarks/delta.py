"""Delta simulation: evaluations per second, full vs delta, and an Inception-v3 search.

    python -m benchmarks.delta [--proposals 200] [--budget 120] [--batch 64]

Full: ``Partitioner.partition`` and ``Simulator.evaluate`` (whole task graph, whole
pass), as the search did before. Delta: ``DeltaSimulator.evaluate`` from the previous
state. Both evaluate the same random walk (one op's config replaced by a random
candidate per proposal) of the example CNN, and agree exactly. Then an MCMC search of the
reduced-width Inception-v3 (tests/torchvision_models.py) on flexflow-p100:16 (64 GPUs):
the time at which its best first came within 1 % of its final best.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import tempfile
import time

import numpy as np

from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.search.mcmc import Progress, SearchOptions, mcmc
from onnx2soap.sim import RooflineCost, Simulator, resolve_machine
from onnx2soap.sim.delta import DeltaSimulator
from onnx2soap.soap import Partitioner, analyze, candidates

REPO = Path(__file__).resolve().parents[1]


def walk(graph, space, devices: int, proposals: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    moves = {op.name: candidates(space[op.name], devices) for op in graph.ops}
    strategy, out = data_parallel(graph, space, devices), []
    for _ in range(proposals):
        op = graph.ops[int(rng.integers(len(graph.ops)))].name
        strategy = strategy.replace(op, moves[op][int(rng.integers(len(moves[op])))])
        out.append(strategy)
    return out


def rates(graph, spec: str, proposals: int) -> tuple[int, float, float]:
    machine = resolve_machine(spec)
    space = analyze(graph)
    strategies = walk(graph, space, machine.size, proposals)
    partitioner = Partitioner(graph)
    full = Simulator(machine, RooflineCost())
    began = time.perf_counter()
    expected = [full.evaluate(partitioner.partition(s)) for s in strategies]
    full_s = time.perf_counter() - began
    delta = DeltaSimulator(Simulator(machine, RooflineCost()), Partitioner(graph))
    _, state = delta.evaluate(data_parallel(graph, space, machine.size))
    began = time.perf_counter()
    got = []
    for s in strategies:
        ev, state = delta.evaluate(s, state)
        got.append(ev)
    delta_s = time.perf_counter() - began
    assert got == expected, "delta and full simulation disagree"
    return machine.size, proposals / full_s, proposals / delta_s


def inception_search(budget: float, batch: int) -> tuple[float, float, float, int]:
    sys.path.insert(0, str(REPO))
    from tests.torchvision_models import export_family

    with tempfile.TemporaryDirectory() as tmp:
        graph = load_model(export_family("inception_v3", tmp, "legacy"), batch=batch).graph
    trace: list[tuple[float, float]] = []

    def progress(p: Progress) -> None:
        trace.append((p.elapsed_s, p.best_step_time_s))

    sim = Simulator(resolve_machine("flexflow-p100:16"), RooflineCost())
    result = mcmc(graph, analyze(graph), sim, SearchOptions(budget_s=budget), progress)
    final = result.evaluation.step_time_s
    within = next((t for t, best in trace if best <= 1.01 * final), result.time_s)
    return within, result.time_s, final, len(graph.ops)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proposals", type=int, default=200)
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--skip-inception", action="store_true")
    args = parser.parse_args()
    graph = load_model(REPO / "examples" / "cnn.onnx", args.batch).graph
    print(f"example CNN, batch {args.batch}, {args.proposals} random proposals")
    print(f"{'machine':<18}{'devices':>8}{'full/s':>10}{'delta/s':>10}{'speed-up':>10}")
    for spec in ("flexflow-p100:1", "flexflow-p100:4", "flexflow-p100:16"):
        devices, full, delta = rates(graph, spec, args.proposals)
        print(f"{spec:<18}{devices:>8}{full:>10.1f}{delta:>10.1f}{delta / full:>9.1f}x", flush=True)
    if not args.skip_inception:
        within, total, final, ops = inception_search(args.budget, args.batch)
        print(
            f"inception_v3 (reduced width, {ops} ops, batch {args.batch}) on flexflow-p100:16: "
            f"best within 1 % of final ({final * 1e3:.3f} ms) after {within:.1f} s "
            f"of a {total:.1f} s search"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
