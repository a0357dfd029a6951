"""Gradient buckets (soap/buckets.py) as the simulator prices them, bucket size by size.

    python -m benchmarks.buckets [--sizes 0.0001 1 8 16 25]

Data parallelism over every device of the preset, the roofline's compute:

- ``chain``: 64 Gemm weights of 256 KiB (16 MiB of gradients), batch 32, on dgx-h100:2;
- ``resnet50``: torchvision's ResNet-50 at 10 classes and 32x32 inputs (161 weight
  tensors in 107 ops; ``benchmarks/models.py``, exported once), batch 32, on alpa-v100:2.

Per bucket size: the rings a step runs, their summed time, when the backward and the last
ring end, and the step. 0.0001 MiB gives every op a bucket of its own (one ring of its
weights together); before buckets every weight tensor had a ring.

    python -m benchmarks.buckets --measure [--ranks 2] [--rounds 8]

The chain's data-parallel step measured on this host's CPU ranks under mpiexec, at each
bucket size, the plans timed side by side in one set of ranks (``benchmarks.interleave``:
the host's slow spells fall on every plan alike), next to the simulator's step for the
``machine probe`` file of those ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.models import BUILD, model_path
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import data_parallel
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.presets import resolve_machine
from onnx2soap.sim.simulate import simulate
from onnx2soap.sim.taskgraph import TaskKind
from onnx2soap.soap import Partitioner, analyze

LAYERS, WIDTH, BATCH = 64, 256, 32


def chain_model() -> Path:
    """The chain, exported once into the build folder."""
    path = BUILD / "chain64_mean.onnx"
    if not path.exists():
        BUILD.mkdir(parents=True, exist_ok=True)
        write_chain(path)
    return path


def write_chain(path: Path) -> Path:
    """x [B, 256] -> 64 x Gemm(W [256, 256], no bias): 64 weights of 256 KiB, each
    entry 1/256 (every layer takes its input's mean: the measured steps stay finite)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    weights = [
        numpy_helper.from_array(np.full((WIDTH, WIDTH), 1 / WIDTH, np.float32), f"W{k}")
        for k in range(LAYERS)
    ]
    names = ["x", *(f"h{k}" for k in range(1, LAYERS)), "logits"]
    nodes = [
        helper.make_node("Gemm", [names[k], f"W{k}"], [names[k + 1]], name=f"gemm{k}")
        for k in range(LAYERS)
    ]
    io = [
        helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["batch", WIDTH])
        for n in ("x", "logits")
    ]
    graph = helper.make_graph(nodes, "chain", io[:1], io[1:], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def row(pg, machine, bucket_mb: float) -> str:
    tg = Simulator(machine, RooflineCost(), bucket_mb=bucket_mb).task_graph(pg, names=True)
    timeline = simulate(tg)
    rings = [i for i, name in enumerate(tg.names) if name.startswith("allreduce bucket")]
    backward = timeline.end[tg.kind == int(TaskKind.BACKWARD)].max()
    summed = tg.duration[rings].sum()
    return (
        f"| {bucket_mb:g} | {len(rings)} | {summed * 1e3:,.2f} | {backward * 1e3:,.2f} | "
        f"{timeline.end[rings].max() * 1e3:,.2f} | {timeline.makespan * 1e3:,.2f} |"
    )


def measure(sizes: list[float], ranks: int, rounds: int) -> None:
    """The chain's data-parallel step on ``ranks`` CPU ranks at each bucket size,
    measured side by side and priced on this host's probed machine file."""
    from benchmarks.fidelity import Setting, _mpiexec, onnx2soap
    from executor.kinds import DeviceKind

    setting = Setting(DeviceKind.CPU, ranks)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        machine = setting.make_machine(folder / "machine.yaml")
        plans, predicted = [], []
        for size in sizes:
            plan = folder / f"chain-{size:g}.json"
            onnx2soap(
                "plan",
                chain_model(),
                "--batch",
                BATCH,
                "--machine",
                machine,
                "--strategy",
                "data-parallel",
                "--bucket-mb",
                size,
                "-o",
                plan,
                "--quiet",
            )
            plans.append(plan)
            predicted.append(json.loads(plan.read_text())["predicted"]["step_time_s"])
        out = folder / "times.json"
        timing = ["--rounds", rounds, "--steps", 12, "--json", out, *setting.executor_args]
        _mpiexec(ranks, "benchmarks.interleave", "benchmarks.interleave", *plans, *timing)
        times = json.loads(out.read_text())
    print(f"\nchain on {ranks} CPU ranks, data parallel, batch {BATCH} (ms)\n")
    print("| bucket MiB | measured step (median) | rounds' medians | simulated step |")
    print("|---|---|---|---|")
    for size, plan, sim in zip(sizes, plans, predicted, strict=True):
        t = times[str(plan)]
        spread = ", ".join(f"{x * 1e3:.2f}" for x in t["round_medians"])
        print(
            f"| {size:g} | {statistics.median(t['times']) * 1e3:.2f} | {spread} | {sim * 1e3:.2f} |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[0.0001, 1, 8, 16, 25])
    p.add_argument("--measure", action="store_true", help="time the chain on CPU ranks")
    p.add_argument("--ranks", type=int, default=2, help="with --measure: MPI ranks")
    p.add_argument("--rounds", type=int, default=8, help="with --measure: timed rounds")
    args = p.parse_args(argv)
    if args.measure:
        measure(args.sizes, args.ranks, args.rounds)
        return 0
    cases = (
        ("chain", chain_model(), "dgx-h100:2"),
        ("resnet50", model_path("resnet50"), "alpa-v100:2"),
    )
    for name, path, spec in cases:
        graph = load_model(path, BATCH).graph
        machine = resolve_machine(spec)
        pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), machine.size))
        print(f"\n{name} on {spec}, data parallel, batch {BATCH} (ms)\n")
        print("| bucket MiB | rings | rings summed | backward ends | last ring ends | step |")
        print("|---|---|---|---|---|---|")
        for size in args.sizes:
            print(row(pg, machine, size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
