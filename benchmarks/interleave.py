"""Time several plans of one model step by step side by side, in one set of ranks.

    mpiexec -n N python -m benchmarks.interleave PLAN... --rounds R --steps K --json OUT
    mpiexec -n N python -m benchmarks.interleave PLAN... --json OUT --device cuda \
        --transport mpi-host          # ranks sharing one GPU

Why: this host's speed changes by half within seconds (a shared VM: a tiny loop runs
at 50 or 80 thousand iterations a second, in spells from 20 ms to 5 s). Plans measured
one after another, each in its own mpiexec, each see their own spells: the same plan
measured 15-36 % apart from run to run, more than the error we try to measure. Here
every round runs each plan for K steps through the executor's own ``train`` (the step a
user's run takes, setup not timed), so the host's slow spells fall on all plans alike;
each round in an order of its own (``round_order``).

A first round, not timed, runs every plan for ``WARM_STEPS`` steps: what a process makes
once (imports, caches) is made before any plan is timed. A plan's step times are those
of rounds 1..R less the first ``WARM_STEPS`` of each (the first step of a run allocates
what the later ones reuse); a step's time is rank 0's, up to the step's closing
all-reduce of the loss, as ``python -m executor run --metrics`` writes it. Peak memory
is not measured here: the process's one-off allocations would fall on the first plan
only, so ``benchmarks/fidelity.py`` measures it in a run of each plan's own. Rank 0
writes JSON: per plan, the timed steps and each round's median.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import random
import statistics

# One BLAS thread per rank, as `python -m executor` sets it, before numpy is imported.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from executor.cli import add_device_options  # noqa: E402  (numpy after the variables)
from executor.kinds import DeviceKind, TransportKind  # noqa: E402

WARM_STEPS = 2  # a round's first steps, not timed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.interleave", description=__doc__)
    p.add_argument("plans", nargs="+", type=Path)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--steps", type=int, default=12, help="steps a plan runs a round")
    p.add_argument("--json", type=Path, required=True, help="where rank 0 writes results")
    add_device_options(p)  # as python -m executor run takes them
    args = p.parse_args(argv)
    if not args.json.parent.is_dir():
        p.error(f"--json {args.json}: no such folder {args.json.parent}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.steps <= WARM_STEPS:
        p.error(f"--steps must be more than {WARM_STEPS}: the first {WARM_STEPS} are not timed")
    return args


def measure_all(
    comm,
    plans: list[Path],
    rounds: int,
    steps: int,
    device: DeviceKind | None = None,  # the executor's default: a GPU where cupy sees one
    transport: TransportKind = TransportKind.AUTO,
) -> dict:
    """Every plan's timed steps and each round's median (meaningful on rank 0)."""
    from executor.train import RunOptions, train

    def run(plan: Path, count: int):
        return train(comm, RunOptions(plan=plan, steps=count, device=device, transport=transport))

    results = {str(p): {"times": [], "round_medians": []} for p in plans}
    for plan in plans:  # the process's one-off work, before anything is timed
        run(plan, WARM_STEPS)
    for r in range(rounds):
        for plan in round_order(plans, r):
            done = run(plan, steps)
            timed = [r.time_s for r in done.steps[WARM_STEPS:]]
            results[str(plan)]["times"] += timed
            results[str(plan)]["round_medians"].append(statistics.median(timed))
    return results


def round_order(plans: list[Path], r: int) -> list[Path]:
    """Round ``r``'s order, a shuffle seeded by ``r`` (the same on every rank): what a
    plan leaves behind (its heap, the cores' state) falls on another plan each round,
    and no plan runs at one point of every round, as in a fixed order it did."""
    return random.Random(r).sample(plans, len(plans))


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    device = DeviceKind(args.device) if args.device else None
    transport = TransportKind(args.transport)
    results = measure_all(comm, args.plans, args.rounds, args.steps, device, transport)
    if comm.Get_rank() == 0:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
