"""Simulator fidelity: predicted against measured step time and peak memory, many plans.

    python -m benchmarks.fidelity              # cnn, resnet18, gpt2, lstm_lm on cpu:2, cpu:4
    python -m benchmarks.fidelity --models cnn --ranks 2 --repeats 2 --costs roofline

Per machine (``onnx2soap machine probe -n N``: this host's N ranks, then ``onnx2soap
profile`` per model unless ``--costs roofline``) and model, ten plans: data parallel,
expert, single device, model parallel, five random seeds and an MCMC search. Each plan
runs ``--repeats`` times under mpiexec, every plan once a round, with ``--trace`` (steps
2-11: the ranks' peak memory) and ``--metrics``; a run's step is the median step time
of the steps after the traced ones (what a run without ``--trace`` takes: rank 0's step
up to the step's closing all-reduce of the loss, which every rank reaches), the plan's
the median over the runs (their spread is printed). Per model and machine: the mean
absolute error of the predicted step, Kendall's tau-b between predicted and measured
steps over the plans, and the mean absolute error of the predicted peak memory of every
rank the plan gives tasks.
Also the plans' common factor (the median of measured over predicted: the host faster or
slower than when it was profiled) and the step error once it is taken out, which is how
well the model tells plans apart; and what trusting the model gets a user: the plan it
predicts fastest, and the searched plan, each measured against the fastest plan measured.

N ranks above this host's cores share them: the table says so.
Needs torch and transformers (dev extras) for the models other than the example CNN.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import itertools
import json
import os
import statistics
import subprocess
import tempfile
from dataclasses import dataclass

from executor.trace import MEMORY_STEP, TRACED_STEPS

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BATCH = {"cnn": 32, "resnet18": 8, "gpt2": 16, "lstm_lm": 32}
RULES = ("data-parallel", "expert", "single-device", "model-parallel")
RANDOM_SEEDS = (1, 2, 3, 4, 5)
FIRST_UNTRACED = MEMORY_STEP + TRACED_STEPS  # metrics count steps from 1, as the tracer


@dataclass(frozen=True)
class Result:
    plan: str
    predicted_s: float
    measured_s: float  # median over runs
    spread: tuple[float, float]  # min, max over runs
    predicted_memory: tuple[int, ...]
    measured_memory: tuple[int, ...]
    working: tuple[int, ...] = ()  # the ranks the plan gives tasks


def export(name: str, folder: Path) -> Path:
    if name == "cnn":
        return ROOT / "examples" / "cnn.onnx"
    if name == "resnet18":
        from tests.torchvision_models import export_family

        return export_family("resnet18", folder, "legacy")
    from tests.sequence_models import export_sequence

    # GPT-2 as tests/sequences exports it: the legacy exporter cannot export aten::diff
    # (opset 17), dynamo (opset 18, optimize=False: one tied weight) can. The tiny config
    # (width 16, 2 layers, 8 tokens) keeps one fidelity run of it within minutes on cpu:2.
    return export_sequence(name, folder, "dynamo" if name == "gpt2" else "legacy")


def onnx2soap(*args: object) -> str:
    done = subprocess.run(
        [str(BIN / "onnx2soap"), *map(str, args)], capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise SystemExit(f"onnx2soap {' '.join(map(str, args))}: {done.stderr.strip()}")
    return done.stdout


def plans(model: Path, name: str, machine: Path, ranks: int, folder: Path, evals: int):
    common = ["--batch", BATCH[name], "--machine", machine, "--quiet"]
    made = []
    for rule in RULES:
        made.append((rule, ["--strategy", rule]))
    for seed in RANDOM_SEEDS:
        made.append((f"random-{seed}", ["--strategy", "random", "--seed", seed]))
    made.append(("searched", ["--max-evals", evals, "--seed", 0]))
    for label, extra in made:
        path = folder / f"{name}-{ranks}-{label}.json"
        onnx2soap("plan", model, *common, *extra, "-o", path)
        yield label, path


def measure(plan: Path, ranks: int, steps: int, folder: Path) -> tuple[float, tuple[int, ...]]:
    trace, metrics = folder / "trace.json", folder / "metrics.jsonl"
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", PYTHONPATH=str(ROOT))
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, "-m", "executor", "run"]
    command += [str(plan), "--steps", str(steps), "--trace", str(trace), "--metrics", str(metrics)]
    if ranks > (os.cpu_count() or 1):
        command[1:1] = ["--oversubscribe"] if _open_mpi() else []
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"{plan}: the executor failed:\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    untraced = [r["time_s"] for r in records if "time_s" in r and r["step"] >= FIRST_UNTRACED]
    peaks = json.loads(trace.read_text())["otherData"]["peak_memory_bytes"]
    return statistics.median(untraced), tuple(peaks)


def _open_mpi() -> bool:
    done = subprocess.run([str(BIN / "mpiexec"), "--version"], capture_output=True, text=True)
    return "Open MPI" in done.stdout or "OpenRTE" in done.stdout


def kendall_tau(xs, ys) -> float:
    """Kendall's tau-b (ties counted), O(n^2): a handful of plans."""
    concordant = discordant = tied_x = tied_y = 0
    n = len(xs)
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tied_x += 1
            elif dy == 0:
                tied_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    pairs = concordant + discordant
    denominator = ((pairs + tied_x) * (pairs + tied_y)) ** 0.5
    return (concordant - discordant) / denominator if denominator else float("nan")


def ordered_apart(results: list[Result]) -> tuple[int, int]:
    """Of the pairs of plans whose runs do not overlap (one plan's slowest run faster
    than the other's fastest: the host told them apart), how many the prediction
    orders as measured, and how many such pairs there are. Kendall's tau counts every
    pair, near-ties whose order is the host's noise too."""
    right = total = 0
    for a, b in itertools.combinations(results, 2):
        if a.spread[1] < b.spread[0] or b.spread[1] < a.spread[0]:
            total += 1
            right += (a.predicted_s < b.predicted_s) == (a.measured_s < b.measured_s)
    return right, total


def summary(results: list[Result]) -> dict:
    step_err = [abs(r.predicted_s - r.measured_s) / r.measured_s for r in results]
    mem_err = [
        abs(r.predicted_memory[d] - r.measured_memory[d]) / r.measured_memory[d]
        for r in results
        for d in r.working  # a rank the plan gives nothing holds only Python's objects
    ]
    noise = [(r.spread[1] - r.spread[0]) / r.measured_s for r in results]
    # The plans' common factor (the host faster or slower than when it was profiled)
    # taken out: how well the model predicts plans relative to each other.
    bias = statistics.median(r.measured_s / r.predicted_s for r in results)
    relative = [abs(bias * r.predicted_s - r.measured_s) / r.measured_s for r in results]
    # What a user gets from trusting the model: the plan it predicts fastest (plans it
    # predicts alike, as the search's plan often is the one-device plan: their mean),
    # and the searched plan, each as measured against the fastest plan measured.
    fastest = min(r.measured_s for r in results)
    quickest = min(r.predicted_s for r in results)
    picks = [r.measured_s for r in results if r.predicted_s <= quickest * (1 + 1e-9)]
    searched = [r for r in results if r.plan == "searched"]
    return {
        "plans": len(results),
        "step_error": statistics.mean(step_err),
        "tau": kendall_tau([r.predicted_s for r in results], [r.measured_s for r in results]),
        "ordered_apart": ordered_apart(results),
        "memory_error": statistics.mean(mem_err),
        "memory_worst": max(mem_err),
        "noise": statistics.median(noise),
        "bias": bias,
        "relative_error": statistics.mean(relative),
        "pick_over_fastest": statistics.mean(picks) / fastest,
        "searched_over_fastest": searched[0].measured_s / fastest if searched else None,
    }


def over_fastest(ratio: float | None) -> str:
    """A plan's measured step against the fastest measured: "fastest" or "+N %"."""
    if ratio is None:
        return "-"
    return "fastest" if ratio <= 1.0 else f"+{(ratio - 1) * 100:.0f} %"


def run_model(name, ranks, machine, args, folder) -> list[Result]:
    model = export(name, folder)
    if args.costs != "roofline":
        onnx2soap("profile", model, "--batch", BATCH[name], "--machine", machine, "--quiet")
    made = list(plans(model, name, machine, ranks, folder, args.search_evals))
    predicted = {
        label: json.loads(onnx2soap("simulate", plan, "--json", "--costs", args.costs))
        for label, plan in made
    }
    # Round by round, every plan once a round: the host's drift over minutes falls on
    # all plans alike instead of on the plans measured last.
    runs: dict[str, list] = {label: [] for label, _ in made}
    for _ in range(args.repeats):
        for label, plan in made:
            runs[label].append(measure(plan, ranks, args.steps, folder))
    results = []
    for label, plan in made:
        times = [t for t, _ in runs[label]]
        peaks = tuple(max(m[d] for _, m in runs[label]) for d in range(ranks))
        working = sorted({d for op in json.loads(plan.read_text())["ops"] for d in op["devices"]})
        doc = predicted[label]
        result = Result(
            label,
            doc["step_time_s"],
            statistics.median(times),
            (min(times), max(times)),
            tuple(doc["peak_memory_bytes"]),
            peaks,
            tuple(working),
        )
        print(
            f"  {name:9} cpu:{ranks} {label:15} predicted {result.predicted_s * 1e3:8.2f} ms  "
            f"measured {result.measured_s * 1e3:8.2f} ms ({min(times) * 1e3:.2f}-"
            f"{max(times) * 1e3:.2f})  memory "
            + " ".join(
                f"{(p - m) / m * 100:+.0f}%"
                for p, m in zip(result.predicted_memory, peaks, strict=True)
            ),
            flush=True,
        )
        results.append(result)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="cnn,resnet18,gpt2,lstm_lm")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=3, help="runs per plan (default 3)")
    p.add_argument(
        "--steps",
        type=int,
        default=FIRST_UNTRACED + 12,
        help=f"steps per run (2-{FIRST_UNTRACED - 1} traced, then timed; default "
        f"{FIRST_UNTRACED + 12})",
    )
    p.add_argument("--search-evals", type=int, default=300)
    p.add_argument("--costs", choices=["auto", "profiled", "roofline"], default="profiled")
    p.add_argument("--json", help="write every result to this file")
    args = p.parse_args(argv)
    if args.steps < FIRST_UNTRACED + 3:
        p.error(f"--steps: at least {FIRST_UNTRACED + 3}, so that 3 steps run untraced")
    table, everything = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for ranks in args.ranks:
            machine = folder / f"host-{ranks}.yaml"
            onnx2soap("machine", "probe", "-n", ranks, "-o", machine)
            for name in args.models.split(","):
                results = run_model(name, ranks, machine, args, folder)
                everything[f"{name}@cpu:{ranks}"] = [r.__dict__ for r in results]
                table.append((name, ranks, summary(results)))
    cores = os.cpu_count()
    print(
        "\n| model | machine | plans | step error | Kendall tau | pairs apart ordered right "
        "| memory error (worst) | run-to-run spread | measured/predicted | step error after it "
        "| predicted fastest, measured | searched, measured |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, ranks, s in table:
        over = " (oversubscribed)" if ranks > (cores or 1) else ""
        print(
            f"| {name} | cpu:{ranks}{over} | {s['plans']} | {s['step_error'] * 100:.0f} % | "
            f"{s['tau']:.2f} | {s['ordered_apart'][0]} of {s['ordered_apart'][1]} | "
            f"{s['memory_error'] * 100:.1f} % ({s['memory_worst'] * 100:.0f} %) | "
            f"{s['noise'] * 100:.0f} % | {s['bias']:.2f} | {s['relative_error'] * 100:.0f} % | "
            f"{over_fastest(s['pick_over_fastest'])} | "
            f"{over_fastest(s['searched_over_fastest'])} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"results": everything, "summary": table}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
