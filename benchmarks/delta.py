"""Delta simulation: evaluations per second, full vs delta.

    python -m benchmarks.delta [--proposals 200] [--batch 64] [--repeats 3]

Full: ``Partitioner.partition`` and ``Simulator.evaluate`` (whole task graph, whole
pass), as the search did before. Delta: ``DeltaSimulator.evaluate`` from the previous
state. Both evaluate the same random walk (one op's config replaced by a random
candidate per proposal) of the example CNN, and agree exactly. Cold: fresh simulators,
so nearly every proposal meets configs never seen (its partition math and segments are
built, for full and delta alike); warm: the same walk again on the same simulators, as a
search that revisits configs sees it. Each rate is the best of ``--repeats`` runs,
full and delta interleaved (the machine is shared). The Inception-v3 search on 64
simulated GPUs is ``benchmarks/inception_search.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import time

import numpy as np

from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
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


def rates(graph, spec: str, proposals: int, repeats: int) -> tuple[int, dict[str, float]]:
    """Evaluations per second of the walk: full and delta, cold and warm (best of runs)."""
    machine = resolve_machine(spec)
    space = analyze(graph)
    strategies = walk(graph, space, machine.size, proposals)
    best: dict[str, float] = {}
    for _ in range(repeats):
        partitioner, full = Partitioner(graph), Simulator(machine, RooflineCost())
        delta = DeltaSimulator(Simulator(machine, RooflineCost()), Partitioner(graph))
        _, start = delta.evaluate(data_parallel(graph, space, machine.size))
        for phase in ("cold", "warm"):
            began = time.perf_counter()
            expected = [full.evaluate(partitioner.partition(s)) for s in strategies]
            full_s = time.perf_counter() - began
            began, state, got = time.perf_counter(), start, []
            for s in strategies:
                ev, state = delta.evaluate(s, state)
                got.append(ev)
            delta_s = time.perf_counter() - began
            assert got == expected, "delta and full simulation disagree"
            for key, seconds in ((f"full {phase}", full_s), (f"delta {phase}", delta_s)):
                best[key] = max(best.get(key, 0.0), proposals / seconds)
    return machine.size, best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proposals", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    graph = load_model(REPO / "examples" / "cnn.onnx", args.batch).graph
    print(f"example CNN, batch {args.batch}, {args.proposals} random proposals")
    head = ("full", "delta", "speed-up", "full warm", "delta warm", "speed-up")
    print(f"{'machine':<18}{'devices':>8}" + "".join(f"{h:>12}" for h in head))
    for spec in ("flexflow-p100:1", "flexflow-p100:4", "flexflow-p100:16"):
        devices, r = rates(graph, spec, args.proposals, args.repeats)
        cells = []
        for phase in ("cold", "warm"):
            full, delta = r[f"full {phase}"], r[f"delta {phase}"]
            cells += [f"{full:>12.1f}", f"{delta:>12.1f}", f"{delta / full:>11.1f}x"]
        print(f"{spec:<18}{devices:>8}" + "".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
