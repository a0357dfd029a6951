"""The papers' suite at full size: every model × preset × device count, each baseline's
predicted step next to the search's (issue 31, part 4).

    python -m benchmarks.suite [--models alexnet,...] [--presets flexflow-p100,...]
        [--devices 8,16,64] [--budget 30] [--max-evals N] [--seed 0] [--jobs 1]
        [--work DIR] [--out TABLE.md]

Models (``benchmarks/suite_models.py``) are exported once, shape-only, into ``--work``
(kept there: a later run reuses them). Each cell (model, preset, devices) then runs in a
process of its own, timed from start to exit with its own peak RSS
(``benchmarks/peak_rss.py``): the import at the cell's batch (``SuiteModel.batch``),
then ``mcmc`` as ``onnx2soap plan`` runs it (roofline costs of the preset's datasheet,
the model's precision, SGD), with a fixed seed and ``--budget`` seconds (``--max-evals``
proposals for a reproducible run). A model first gets a row of its own: its import alone.

Columns, step times predicted (the simulator's, not measured): every baseline (``no
fit``: over a device's memory, never a reference); ``best rule`` the fastest baseline
that fits; ``search``; ``rule/search`` = best rule over search (≥ 1); ``walk`` = the best
start (the baselines and data parallelism over a node or a few, ``data-parallel:k``) over
the search: what the walk added; ``search s`` = mcmc's time (setup: every start built and
simulated, the ILP's solve included), ``1% at`` = seconds from mcmc's call until its best
was within 1 % of its final best; ``import s``; ``peak`` = the cell's peak RSS.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from benchmarks.peak_rss import measure
from benchmarks.suite_models import EXTRA, MODELS, SuiteModel, export_model, suite_model

PRESETS = ("flexflow-p100", "alpa-v100", "dgx-h100")
DEVICES = (8, 16, 64)
BASELINE_NAMES = ("data-parallel", "expert", "single-device", "model-parallel", "megatron", "ilp")
GB = 1e9
IMPORT_DEVICES = 8
TARGET_GAIN = 1.25  # the issue's: over the best rule, bold in the table


@dataclass(frozen=True)
class Cell:
    model: str
    preset: str
    devices: int  # 0: the model's import alone (at the batch of IMPORT_DEVICES)

    @property
    def key(self) -> str:
        return f"{self.model}@{self.preset}:{self.devices}"


# --- one cell, in a process of its own ---------------------------------------------------


def machine_spec(preset: str, devices: int) -> str:
    """``PRESET:NODES`` for ``devices`` GPUs (the preset's node size divides them)."""
    from onnx2soap.sim.presets import CLUSTERS

    per_node = CLUSTERS[preset].gpus
    if devices % per_node:
        raise ValueError(f"{devices} devices are not whole nodes of {preset} ({per_node})")
    return f"{preset}:{devices // per_node}"


def _evaluation(ev) -> dict:
    return {
        "step_s": ev.step_time_s,
        "fits": ev.fits,
        "peak_bytes": max(ev.peak_memory_bytes, default=0),
    }


def run_cell(
    model: Path, spec: SuiteModel, preset: str, devices: int, budget: float, seed: int, evals
) -> dict:
    """Import at the cell's batch and search; what the table needs, as JSON."""
    from onnx2soap.errors import UserError
    from onnx2soap.importer import load_model
    from onnx2soap.search.mcmc import SearchOptions, mcmc
    from onnx2soap.sim import RooflineCost, make_simulator, resolve_machine
    from onnx2soap.sim.memory import OPTIMIZER_SLOTS
    from onnx2soap.soap import analyze

    began = time.perf_counter()
    batch = spec.batch(devices or IMPORT_DEVICES)
    graph = load_model(model, batch).graph
    space = analyze(graph)
    doc: dict = {"batch": batch, "ops": len(graph.ops), "import_s": time.perf_counter() - began}
    if devices == 0:
        return doc
    machine = resolve_machine(machine_spec(preset, devices))
    simulator = make_simulator(machine, RooflineCost(), OPTIMIZER_SLOTS["sgd"], spec.precision)
    options = SearchOptions(budget, seed, max_evals=evals)
    try:
        result = mcmc(graph, space, simulator, options)
    except UserError as e:  # nothing fits: the row says so, with what DP would need
        dp = _dp_peak(graph, space, simulator)
        doc["error"] = f"{str(e).split(';')[0]} (data parallel: {dp})"
        return doc
    final = result.evaluation.step_time_s
    # the walk's history is without ZeRO: a plan that fits only with it is the search's
    # once priced, at its end
    within = next((h for h in result.history if h.step_time_s <= final * 1.01), None)
    doc.update(
        starts={name: _evaluation(ev) for name, ev in result.starts.items()},
        search=_evaluation(result.evaluation),
        best_from=result.best_from,
        search_s=result.time_s,
        setup_s=result.setup_s,
        within_1pct_s=result.time_s if within is None else result.setup_s + within.after_s,
        zero_stage=int(result.zero_stage),
        proposals=result.proposals,
        evaluated=result.evaluated,
    )
    if result.ilp is not None:
        doc["ilp"] = {"status": result.ilp.status, "build_s": result.ilp.build_s}
        doc["ilp"]["solve_s"] = result.ilp.solve_s
    return doc


def _dp_peak(graph, space, simulator) -> str:
    """Data parallelism's largest device memory, in GiB."""
    from onnx2soap.search.baselines import data_parallel
    from onnx2soap.soap import Partitioner

    strategy = data_parallel(graph, space, simulator.machine.size)
    ev = simulator.evaluate(Partitioner(graph).partition(strategy))
    return f"{max(ev.peak_memory_bytes) / 2**30:.1f} GiB a device"


def _cell_main(argv: list[str]) -> int:
    """``python -m benchmarks.suite --cell MODEL.onnx NAME PRESET DEVICES BUDGET SEED
    EVALS OUT.json``: one cell, its result written to OUT.json."""
    path, name, preset, devices, budget, seed, evals, out = argv
    doc = run_cell(
        Path(path),
        suite_model(name),
        preset,
        int(devices),
        float(budget),
        int(seed),
        int(evals) or None,
    )
    Path(out).write_text(json.dumps(doc))
    return 0


# --- the driver --------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    work: Path
    budget: float
    seed: int
    max_evals: int  # 0: none
    cap_bytes: int | None


def exported(name: str, work: Path) -> tuple[Path, dict]:
    """The model's export in ``work`` (made the first time), and its facts."""
    folder = work / "models"
    path, facts_path = folder / f"{name}.onnx", folder / f"{name}.json"
    if not (path.exists() and facts_path.exists()):
        got = export_model(suite_model(name), folder)
        facts = {"parameters": got.parameters, "bytes": got.weight_bytes, "export_s": got.export_s}
        facts_path.write_text(json.dumps(facts))
    return path, json.loads(facts_path.read_text())


def measure_cell(cell: Cell, path: Path, settings: Settings) -> dict:
    out = settings.work / "cells" / f"{cell.key}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "benchmarks.suite", "--cell", str(path), cell.model]
    argv += [cell.preset, str(cell.devices), str(settings.budget), str(settings.seed)]
    argv += [str(settings.max_evals), str(out)]
    got = measure(argv, settings.cap_bytes)
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc.update(wall_s=got.wall_s, peak_rss=got.peak_rss)
    if got.exit_code:
        doc["error"] = f"exit {got.exit_code}: {got.error}"
    out.write_text(json.dumps(doc))  # with the process's time and memory: --render reads it
    return doc


def _stored(cell: Cell, _path: Path | None, settings: Settings) -> dict:
    """A cell's result as an earlier run left it in ``--work`` (--render)."""
    out = settings.work / "cells" / f"{cell.key}.json"
    return json.loads(out.read_text()) if out.exists() else {"error": "not run"}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms" if seconds < 10 else f"{seconds:,.1f} s"


def _step(ev: dict | None) -> str:
    if ev is None:
        return "-"
    return _ms(ev["step_s"]) if ev["fits"] else f"no fit ({ev['peak_bytes'] / 2**30:.0f} GiB)"


HEADER = (
    "| model | preset | devices | batch | "
    + " | ".join(BASELINE_NAMES)
    + " | best rule | search | rule/search | walk | search s (setup) | 1% at s | import s "
    "| peak GB |"
)


def cell_row(cell: Cell, doc: dict) -> str:
    head = f"| {cell.model} | {cell.preset} | {cell.devices} | {doc.get('batch', '-')} | "
    seconds, peak = doc.get("import_s"), doc.get("peak_rss")
    tail = f"{'-' if seconds is None else f'{seconds:.1f}'} | "
    tail += f"{'-' if peak is None else f'{peak / GB:.1f}'} |"
    if "starts" not in doc:
        blanks = " | ".join("" for _ in range(len(BASELINE_NAMES) + 5))
        why = doc.get("error", "failed").replace("|", "/")[:120]
        return head + f"{why} | {blanks} | {tail}"
    starts, search = doc["starts"], doc["search"]["step_s"]
    fitting = {n: starts[n]["step_s"] for n in BASELINE_NAMES if starts[n]["fits"]}
    rule = min(fitting, key=fitting.get) if fitting else None
    fit_starts = {n: e["step_s"] for n, e in starts.items() if e["fits"]}
    first = min(fit_starts, key=fit_starts.get) if fit_starts else "-"
    best_start = fit_starts.get(first, math.nan)
    gain = fitting[rule] / search if rule else math.nan
    ratio = "no rule fits" if not rule else f"{gain:.2f}×"
    ratio = f"**{ratio}**" if gain >= TARGET_GAIN else ratio
    cells = [_step(starts.get(n)) for n in BASELINE_NAMES]
    cells += [
        rule or "-",
        _ms(search) + (f" (ZeRO-{doc['zero_stage']})" if doc.get("zero_stage") else ""),
        ratio,
        f"{best_start / search:.3f}× (over {first})" if fit_starts else "no start fits",
        f"{doc['search_s']:.1f} ({doc['setup_s']:.1f})",
        f"{doc['within_1pct_s']:.1f}",
    ]
    return head + " | ".join(cells) + " | " + tail


def import_row(name: str, facts: dict, doc: dict) -> str:
    status = doc.get("error", "ok")
    return (
        f"| {name} | {suite_model(name).paper} | {facts['parameters'] / 1e9:.3f} G "
        f"| {facts['bytes'] / GB:.1f} GB | {facts['export_s']:.0f} | {doc.get('ops', '-')} "
        f"| {doc.get('batch', '-')} | {doc.get('import_s', math.nan):.1f} "
        f"| {doc['peak_rss'] / GB:.2f} | {suite_model(name).note} | {status} |"
    )


def check(doc: dict) -> list[str]:
    """The target every cell must meet: the search no slower than any baseline that
    fits. What it breaks, in words (none: empty)."""
    if "starts" not in doc:
        return []
    search = doc["search"]["step_s"]
    return [
        f"{name} {ev['step_s']:.6g} s < search {search:.6g} s"
        for name, ev in doc["starts"].items()
        if name in BASELINE_NAMES and ev["fits"] and ev["step_s"] < search * (1 - 1e-9)
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cell"]:
        return _cell_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--devices", default=",".join(map(str, DEVICES)))
    parser.add_argument("--budget", type=float, default=30.0, help="search seconds a cell")
    parser.add_argument("--max-evals", type=int, default=0, help="proposals a cell (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="cells run side by side")
    parser.add_argument("--cap-gb", type=float, default=0, help="address space a cell (0: none)")
    parser.add_argument("--no-imports", action="store_true", help="skip the import rows")
    parser.add_argument("--export-only", action="store_true", help="export the models, no more")
    parser.add_argument("--work", type=Path, default=Path("build/suite"), help="cache folder")
    parser.add_argument("--out", type=Path, help="also write the tables here")
    parser.add_argument(
        "--render", action="store_true", help="the cell table from --work's results: no run"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS and n not in EXTRA]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join([*MODELS, *EXTRA])}")
    cap = int(args.cap_gb * GB) if args.cap_gb > 0 else None
    settings = Settings(args.work, args.budget, args.seed, args.max_evals, cap)
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)
        if args.out:
            args.out.write_text("\n".join(lines) + "\n")

    if args.render:
        args.no_imports = True
    paths = {}
    for name in names if not args.render else ():
        paths[name], facts = exported(name, args.work)
        if args.export_only:
            print(f"{paths[name]}: {facts}", flush=True)
    if args.export_only:
        return 0
    if not args.no_imports:
        emit(
            "| model | paper | parameters | weights (sparse) | export s | ops | batch "
            "| import s | import peak GB | as built | status |"
        )
        emit("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
        for name in names:
            _, facts = exported(name, args.work)
            doc = measure_cell(Cell(name, "-", 0), paths[name], settings)
            emit(import_row(name, facts, doc))
        emit("")
    cells = [
        Cell(name, preset, int(d))
        for name in names
        for preset in args.presets.split(",")
        for d in args.devices.split(",")
        if d  # --devices "": the import rows alone
    ]
    if not cells:
        return 0
    emit(HEADER)
    emit("|" + "---|" * (HEADER.count("|") - 1))
    broken: list[str] = []
    with ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        run = _stored if args.render else measure_cell
        docs = pool.map(lambda c: (c, run(c, paths.get(c.model), settings)), cells)
        for cell, doc in docs:
            emit(cell_row(cell, doc))
            broken += [f"{cell.key}: {why}" for why in check(doc)]
    for why in broken:
        print(f"TARGET MISSED: {why}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
