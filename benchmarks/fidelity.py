"""Simulator fidelity: predicted against measured step time and peak memory, many plans.

    python -m benchmarks.fidelity              # cnn, resnet18, gpt2, lstm_lm on cpu:2, cpu:4
    python -m benchmarks.fidelity --models cnn --ranks 2 --repeats 2 --costs roofline
    python -m benchmarks.fidelity --export-only --models-dir build/fidelity-models
    python -m benchmarks.fidelity --device cuda --models-dir build/fidelity-models

Per machine (``onnx2soap machine probe -n N``: this host's N ranks, then ``onnx2soap
profile`` per model unless ``--costs roofline``) and model, twelve plans: data parallel,
expert, single device, model parallel, Megatron-LM's tensor parallelism, Alpa's ILP,
five random seeds and an MCMC search. The plans
of a model are timed side by side in one mpiexec (``benchmarks/interleave.py``):
``--repeats`` rounds of a few steps of each plan, so that the host's slow spells
(seconds long on this VM) fall on every plan alike. A step's time is rank 0's, up to the
step's closing all-reduce of the loss, which every rank reaches; a plan's is the median
of its timed steps, and the spread of its rounds' medians is printed. The ranks' peak
memory comes from a traced run of each plan's own (steps 2-11). ``--separate`` times
each plan in its own mpiexec runs instead, as a user runs it (``--repeats`` runs, every
plan once a round, the median of each run's untraced steps, the median over the runs).
Per model and machine: the mean absolute error of the predicted step, Kendall's tau-b
between predicted and measured steps over the plans, and the mean absolute error of the
predicted peak memory of every rank the plan gives tasks.
Also the plans' common factor (the median of measured over predicted: the host faster or
slower than when it was profiled) and the step error once it is taken out, which is how
well the model tells plans apart; and what trusting the model gets a user: the plan it
predicts fastest, and the searched plan, each measured against the fastest plan measured;
the searched plan also round by round against the fastest plan in the same round, which
tells a miss the model makes from one the host's drift makes (``by_round``).

N ranks above this host's cores share them: the table says so.

``--device cuda``: N ranks share one GPU (NCCL refuses two ranks on one device, so they
move tiles through page-locked host memory, ``--transport mpi-host``). The machine file
is ``benchmarks/multirank.py``'s (each rank a 1/N share of an H200's peaks, host-staged
links of assumed bandwidth and latency: ``machine probe`` measures CPU ranks only); the
task costs are ``onnx2soap profile --device cuda``'s, kernels and in-step calibration
timed on the GPU. Memory is the ranks' cupy pools.

Needs torch and transformers (dev extras) for the models other than the example CNN; a
machine without them (the lent GPU's may be one) takes the models from ``--models-dir``,
exported into it beforehand with ``--export-only``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import tempfile
from dataclasses import dataclass

import yaml

from benchmarks.interleave import WARM_STEPS
from benchmarks.multirank import shared_gpu_machine
from executor.kinds import DeviceKind
from executor.trace import MEMORY_STEP, TRACED_STEPS
from onnx2soap.cli.machine_cmd import find_mpiexec
from onnx2soap.files import write_atomic

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BATCH = {"cnn": 32, "resnet18": 8, "gpt2": 16, "lstm_lm": 32}
RULES = ("data-parallel", "expert", "single-device", "model-parallel", "megatron", "ilp")
RANDOM_SEEDS = (1, 2, 3, 4, 5)
ROUNDS = 24  # side by side: 8 rounds left three plans that equal 13 % apart (cnn)
RUNS = 3  # --separate: each a set of mpiexec runs of every plan
FIRST_UNTRACED = MEMORY_STEP + TRACED_STEPS  # metrics count steps from 1, as the tracer


@dataclass(frozen=True)
class Setting:
    """Where the plans run: ``ranks`` MPI ranks of this host's CPU, or sharing one GPU."""

    device: DeviceKind
    ranks: int

    @property
    def on_cpu(self) -> bool:
        return self.device is DeviceKind.CPU

    @property
    def label(self) -> str:
        return f"cpu:{self.ranks}" if self.on_cpu else f"gpu/{self.ranks}"

    @property
    def executor_args(self) -> list[str]:
        """How ``python -m executor run`` and ``benchmarks.interleave`` are told (the
        executor's own default is a GPU wherever cupy sees one)."""
        if self.on_cpu:
            return ["--device", "cpu"]
        return ["--device", "cuda", "--transport", "mpi-host"]

    def make_machine(self, path: Path) -> Path:
        if self.on_cpu:
            onnx2soap("machine", "probe", "-n", self.ranks, "-o", path)
        else:
            path.write_text(yaml.safe_dump(shared_gpu_machine(self.ranks)))
        return path


@dataclass(frozen=True)
class Result:
    plan: str
    predicted_s: float
    measured_s: float  # the median of its timed steps (or, --separate, of its runs)
    spread: tuple[float, float]  # min, max over the rounds (or runs) of the plan
    predicted_memory: tuple[int, ...]
    measured_memory: tuple[int, ...]
    working: tuple[int, ...] = ()  # the ranks the plan gives tasks
    rounds: tuple[float, ...] = ()  # each round's median (or run's step), in round order


def export(name: str, folder: Path) -> Path:
    """The model's ONNX file in ``folder``, exported unless it is there already."""
    if name == "cnn":
        return ROOT / "examples" / "cnn.onnx"
    # GPT-2 as tests/sequences exports it: the legacy exporter cannot export aten::diff
    # (opset 17), dynamo (opset 18, optimize=False: one tied weight) can. The tiny config
    # (width 16, 2 layers, 8 tokens) keeps one fidelity run of it within minutes on cpu:2.
    exporter = "dynamo" if name == "gpt2" else "legacy"
    path = folder / f"{name}_{exporter}.onnx"  # the name both exports give it
    if path.exists():
        return path
    if name == "resnet18":
        from tests.torchvision_models import export_family

        return export_family("resnet18", folder, exporter)
    from tests.sequence_models import export_sequence

    return export_sequence(name, folder, exporter)


def _env() -> dict[str, str]:
    """This checkout importable (before what the caller's PYTHONPATH holds: the GPU
    stand-in, say), and mpiexec beside this Python found first."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", PYTHONPATH=os.pathsep.join(paths))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def onnx2soap(*args: object) -> str:
    """``python -m onnx2soap``: a machine where the project is not installed (the lent
    GPU's) has no ``onnx2soap`` command."""
    command = [sys.executable, "-m", "onnx2soap", *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), check=False)
    if done.returncode:
        raise SystemExit(f"onnx2soap {' '.join(map(str, args))}: {done.stderr.strip()}")
    return done.stdout


def plans(model: Path, name: str, machine: Path, setting: Setting, folder: Path, evals: int):
    common = ["--batch", BATCH[name], "--machine", machine, "--quiet"]
    made = []
    for rule in RULES:
        made.append((rule, ["--strategy", rule]))
    for seed in RANDOM_SEEDS:
        made.append((f"random-{seed}", ["--strategy", "random", "--seed", seed]))
    made.append(("searched", ["--max-evals", evals, "--seed", 0]))
    for label, extra in made:
        path = folder / f"{name}-{setting.device.value}{setting.ranks}-{label}.json"
        onnx2soap("plan", model, *common, *extra, "-o", path)
        yield label, path


def measure(plan: Path, setting: Setting, steps: int, folder: Path) -> tuple[float, tuple]:
    """One run of the plan in its own mpiexec: the median of its untraced steps, and the
    peak memory of every rank over the traced ones."""
    records, peaks = _traced_run(plan, setting, steps, folder)
    untraced = [r["time_s"] for r in records if "time_s" in r and r["step"] >= FIRST_UNTRACED]
    return statistics.median(untraced), peaks


def _traced_run(plan: Path, setting: Setting, steps: int, folder: Path) -> tuple[list, tuple]:
    trace, metrics = folder / "trace.json", folder / "metrics.jsonl"
    run = ["run", plan, "--steps", steps, "--trace", trace, "--metrics", metrics]
    _mpiexec(setting.ranks, f"{plan}: the executor", "executor", *run, *setting.executor_args)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    peaks = json.loads(trace.read_text())["otherData"]["peak_memory_bytes"]
    return records, tuple(peaks)


def same_plans(made) -> dict[str, str]:
    """Each plan's label -> the label of the first plan identical to it (itself if
    none). Plans differ only in what they predict and how they were found: the search's
    plan is often a baseline's, and timing it twice under two names measured one plan
    6.4 and 4.6 ms in the same run: the host's noise, not two plans."""
    first: dict[str, str] = {}
    seen: dict[str, str] = {}
    for label, path in made:
        doc = json.loads(path.read_text())
        key = json.dumps({k: v for k, v in doc.items() if k not in ("predicted", "search")})
        first[label] = seen.setdefault(key, label)
    return first


def distinct(made, first: dict[str, str]) -> list:
    """The plans to measure: one of each set of identical plans (``first``:
    ``same_plans(made)``)."""
    return [(label, path) for label, path in made if first[label] == label]


def measure_separately(made, first: dict[str, str], setting: Setting, args, folder: Path) -> dict:
    """Per plan: its step (the median over runs), each run's step, the ranks' peaks.
    Round by round, every plan once a round: the host's drift over minutes falls on all
    plans alike instead of on the plans measured last."""
    unique = distinct(made, first)
    runs: dict[str, list] = {label: [] for label, _ in unique}
    for _ in range(args.repeats):
        for label, plan in unique:
            runs[label].append(measure(plan, setting, args.steps, folder))
    measured = {}
    for label, _ in made:
        times = [t for t, _ in runs[first[label]]]
        peaks = tuple(max(m[d] for _, m in runs[first[label]]) for d in range(setting.ranks))
        measured[label] = (statistics.median(times), times, peaks)
    return measured


def measure_interleaved(made, first: dict[str, str], setting: Setting, args, folder: Path) -> dict:
    """Per plan: the median of its timed steps, each round's median (all plans timed side
    by side in one mpiexec: benchmarks/interleave.py), and the ranks' peak memory, from a
    traced run of the plan's own (a process's one-off allocations are each run's)."""
    out = folder / "interleaved.json"
    timing = ["--rounds", args.repeats, "--steps", args.round_steps, "--json", out]
    timing += setting.executor_args
    interleave = "benchmarks.interleave"
    unique = distinct(made, first)
    _mpiexec(setting.ranks, interleave, interleave, *(p for _, p in unique), *timing)
    doc = json.loads(out.read_text())
    own = {}
    for label, plan in unique:
        r = doc[str(plan)]
        _, peaks = _traced_run(plan, setting, FIRST_UNTRACED, folder)
        own[label] = (statistics.median(r["times"]), r["round_medians"], peaks)
    return {label: own[first[label]] for label, _ in made}


def _mpiexec(ranks: int, what: str, module: str, *args: object) -> None:
    """``mpiexec -n ranks python -m module args``; a failure stops the benchmark."""
    command = [find_mpiexec(), *_oversubscribe(ranks), "-n", str(ranks), sys.executable]
    command += ["-m", module, *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), check=False)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-2000:]}")


def _oversubscribe(ranks: int) -> list[str]:
    """Open MPI refuses more ranks than cores unless told; MPICH needs no flag."""
    return ["--oversubscribe"] if ranks > (os.cpu_count() or 1) and _open_mpi() else []


@functools.cache  # asked before every mpiexec: the answer does not change
def _open_mpi() -> bool:
    done = subprocess.run([find_mpiexec(), "--version"], capture_output=True, text=True)
    return "Open MPI" in done.stdout or "OpenRTE" in done.stdout


def memory_errors(result: Result) -> list[str]:
    """Per rank, the predicted peak memory's error against the measured one: "idle" for a
    rank the plan gives nothing (it holds only Python's objects on a CPU, nothing in its
    pool on a GPU), "none measured" where a working rank's peak reads 0."""
    pairs = zip(result.predicted_memory, result.measured_memory, strict=True)
    return [
        "idle" if d not in result.working else "none measured" if m == 0 else f"{(p - m) / m:+.0%}"
        for d, (p, m) in enumerate(pairs)
    ]


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
        "searched_by_round": by_round(searched[0], results) if searched else None,
    }


def by_round(plan: Result, results: list[Result]) -> tuple[float, float, float] | None:
    """``plan`` against the fastest plan measured, round by round: the least, median
    and greatest of its round's step over the fastest plan's in the same round. A round
    times every plan within seconds of the others, so the host's slow spells, which
    move a plan's rounds by a fifth and more here, fall on both steps of a ratio: a
    miss that every round shows is the model's; one that some rounds reverse is the
    host's. None where ``plan`` is the fastest, or without rounds for both (or of
    unequal counts)."""
    best = min(results, key=lambda r: r.measured_s)
    paired = plan.rounds and len(plan.rounds) == len(best.rounds)
    if plan.measured_s <= best.measured_s or not paired:
        return None
    ratios = sorted(a / b for a, b in zip(plan.rounds, best.rounds, strict=True))
    return ratios[0], statistics.median(ratios), ratios[-1]


def over_fastest_by_round(ratios: tuple[float, float, float] | None) -> str:
    """``by_round``'s ratios, the median first, which is what the plans' rounds tell
    apart from the host's toss (three cnn plans that measure within 3 % in 40 rounds,
    one of them 11 % over the fastest by 24 rounds' medians), then the least and greatest:
    "(rounds +5 %, -3 to +20 %)"."""
    if ratios is None:
        return ""
    low, median, high = ((r - 1) * 100 for r in ratios)
    return f" (rounds {median:+.0f} %, {low:+.0f} to {high:+.0f} %)"


def over_fastest(ratio: float | None) -> str:
    """A plan's measured step against the fastest measured: "fastest" or "+N %"."""
    if ratio is None:
        return "-"
    return "fastest" if ratio <= 1.0 else f"+{(ratio - 1) * 100:.0f} %"


def run_model(name: str, setting: Setting, machine: Path, args, models: Path) -> list[Result]:
    folder = machine.parent
    model = export(name, models)
    if args.costs != "roofline":
        profile = ["--batch", BATCH[name], "--machine", machine, "--device", setting.device.value]
        onnx2soap("profile", model, *profile, "--quiet")
    made = list(plans(model, name, machine, setting, folder, args.search_evals))
    predicted = {
        label: json.loads(onnx2soap("simulate", plan, "--json", "--costs", args.costs))
        for label, plan in made
    }
    first = same_plans(made)  # identical plans are timed once
    if args.separate:
        measured = measure_separately(made, first, setting, args, folder)
    else:
        measured = measure_interleaved(made, first, setting, args, folder)
    results = []
    for label, plan in made:
        step_s, times, peaks = measured[label]
        working = sorted({d for op in json.loads(plan.read_text())["ops"] for d in op["devices"]})
        doc = predicted[label]
        result = Result(
            label,
            doc["step_time_s"],
            step_s,
            (min(times), max(times)),
            tuple(doc["peak_memory_bytes"]),
            peaks,
            tuple(working),
            tuple(times),
        )
        print(
            f"  {name:9} {setting.label} {label:15} predicted "
            f"{result.predicted_s * 1e3:8.2f} ms  measured {result.measured_s * 1e3:8.2f} ms "
            f"({min(times) * 1e3:.2f}-{max(times) * 1e3:.2f})  memory "
            + " ".join(memory_errors(result))
            + (f"  (the {first[label]} plan, timed once)" if first[label] != label else ""),
            flush=True,
        )
        results.append(result)
    return results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="cnn,resnet18,gpt2,lstm_lm")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument(
        "--device",
        choices=[k.value for k in DeviceKind],
        default=DeviceKind.CPU.value,
        help="this host's CPU ranks, or ranks sharing one GPU (default cpu)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"rounds of every plan (default {ROUNDS}: in 8, the fastest of plans "
        f"that equal was the host's toss), or with --separate runs (default {RUNS})",
    )
    p.add_argument(
        "--round-steps",
        type=int,
        default=8,
        help=f"steps a plan runs a round, the first {WARM_STEPS} not timed (default 8)",
    )
    p.add_argument(
        "--separate",
        action="store_true",
        help="measure each plan in its own mpiexec runs, as a user runs it",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=FIRST_UNTRACED + 12,
        help=f"with --separate, steps per run (2-{FIRST_UNTRACED - 1} traced, then timed; "
        f"default {FIRST_UNTRACED + 12})",
    )
    p.add_argument("--search-evals", type=int, default=300)
    p.add_argument("--costs", choices=["auto", "profiled", "roofline"], default="profiled")
    p.add_argument("--json", type=Path, help="write every result to this file")
    p.add_argument(
        "--keep",
        type=Path,
        help="keep the machine files, cost databases and plans in this folder (to look "
        "into a figure afterwards; a plan's file is named MODEL-DEVICE-RANKS-PLAN.json)",
    )
    p.add_argument(
        "--models-dir",
        type=Path,
        help="the exported models: used where there, exported into it where not "
        "(default: a temporary folder)",
    )
    p.add_argument(
        "--export-only",
        action="store_true",
        help="export the models into --models-dir and stop (for a machine without the dev extras)",
    )
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = RUNS if args.separate else ROUNDS
    if args.repeats < 1:
        p.error("--repeats: at least 1")
    unknown = sorted(set(args.models.split(",")) - set(BATCH))
    if unknown:
        p.error(f"--models: no model {', '.join(unknown)}; choose from {', '.join(BATCH)}")
    if args.round_steps <= WARM_STEPS:
        p.error(f"--round-steps: more than {WARM_STEPS}, so that a step of each round is timed")
    if args.steps < FIRST_UNTRACED + 3:
        p.error(f"--steps: at least {FIRST_UNTRACED + 3}, so that 3 steps run untraced")
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json {args.json}: no such folder {args.json.parent}")
    if args.export_only and args.models_dir is None:
        p.error("--export-only: give --models-dir, the folder to export into")
    if args.models_dir is not None and args.models_dir.exists() and not args.models_dir.is_dir():
        p.error(f"--models-dir {args.models_dir}: not a folder")
    if DeviceKind(args.device) is DeviceKind.CUDA and not args.export_only:
        from executor.device import cupy_module

        if cupy_module() is None:
            p.error("--device cuda: cupy is not installed or sees no GPU; use --device cpu")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    names = args.models.split(",")
    table, everything = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        models = args.models_dir or folder
        models.mkdir(parents=True, exist_ok=True)
        if args.export_only:
            for name in names:
                print(export(name, models))
            return 0
        for ranks in args.ranks:
            setting = Setting(DeviceKind(args.device), ranks)
            machine = setting.make_machine(folder / f"machine-{args.device}{ranks}.yaml")
            for name in names:
                results = run_model(name, setting, machine, args, models)
                everything[f"{name}@{setting.label}"] = [r.__dict__ for r in results]
                table.append((name, setting, summary(results)))
                # As each model ends, so that a run cut short (gpu_check.sh's time
                # limit) keeps what it finished.
                print(table_row(*table[-1]), flush=True)
                if args.json:
                    write_atomic(args.json, json.dumps(_document(everything, table)))
    print_table(table)
    return 0


def _document(everything: dict, table: list[tuple[str, Setting, dict]]) -> dict:
    return {"results": everything, "summary": [(n, s.label, x) for n, s, x in table]}


TABLE_HEAD = (
    "| model | machine | plans | step error | Kendall tau | pairs apart ordered right "
    "| memory error (worst) | spread of repeats | measured/predicted | step error after it "
    "| predicted fastest, measured | searched, measured |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def print_table(table: list[tuple[str, Setting, dict]]) -> None:
    print("\n" + TABLE_HEAD)
    for row in table:
        print(table_row(*row))


def table_row(name: str, setting: Setting, s: dict) -> str:
    """One model on one machine: its line of the table."""
    if setting.on_cpu:
        over = " (oversubscribed)" if setting.ranks > (os.cpu_count() or 1) else ""
        where = f"{setting.label}{over}"
    else:
        where = f"{setting.ranks} ranks on one GPU"
    return (
        f"| {name} | {where} | {s['plans']} | {s['step_error'] * 100:.0f} % | "
        f"{s['tau']:.2f} | {s['ordered_apart'][0]} of {s['ordered_apart'][1]} | "
        f"{s['memory_error'] * 100:.1f} % ({s['memory_worst'] * 100:.0f} %) | "
        f"{s['noise'] * 100:.0f} % | {s['bias']:.2f} | {s['relative_error'] * 100:.0f} % | "
        f"{over_fastest(s['pick_over_fastest'])} | "
        f"{over_fastest(s['searched_over_fastest'])}"
        f"{over_fastest_by_round(s['searched_by_round'])} |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
