"""Big models: what planning and training cost in time and memory, by model size.

    python -m benchmarks.big_models [--sizes 0.27,1.3,3.2,34] [--cap-gb 16] [--train]

Each model is an MLP of H×H float32 MatMul layers with its weights in ONNX external data
on a sparse file (``benchmarks/sparse_mlp.py``: no disk, no time to write). Every command
runs in a process of its own, timed from start to exit, its peak RSS read from the
kernel (``benchmarks/peak_rss.py``: the command's own, not its launcher's). ``floor``
is the same command on a one-layer 64-wide model: the interpreter and its imports, which
any model pays; ``beyond`` is the peak less that floor. ``--cap-gb`` limits each
process's address space, so a command that would take the machine's memory fails instead
(its exit is shown).

``--train`` adds the executor: a model of random weights trained for two steps under
``mpiexec`` by a model-parallel plan over 4 ranks and a data-parallel plan over 2; every
rank reports its own peak RSS (``--metrics``), shown next to the simulated peak.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import shutil
import tempfile
import time

from benchmarks.peak_rss import measure
from benchmarks.sparse_mlp import Fill, SparseMlp, write_sparse_mlp

# Model sizes in GB (decimal) -> (layers, hidden).
SHAPES = {
    "0.27": (4, 4096),
    "1.3": (5, 8192),
    "2.1": (8, 8192),
    "3.2": (12, 8192),
    "34": (32, 16384),
}
FLOOR = (1, 64)
BATCH = 8
GB = 1e9
MB = 1 << 20


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "onnx2soap", *args]


def planning_commands(model: Path, out: Path) -> dict[str, list[str]]:
    m, b = str(model), str(BATCH)
    return {
        "inspect": _cli("inspect", m, "--batch", b),
        "plan data-parallel": _cli(
            "plan",
            m,
            "--batch",
            b,
            "--devices",
            "4",
            "--strategy",
            "data-parallel",
            "-o",
            str(out / "dp.json"),
        ),
        "plan search 10 s": _cli(
            "plan",
            m,
            "--batch",
            b,
            "--machine",
            "dgx-h100:1",
            "--budget",
            "10",
            "-o",
            str(out / "search.json"),
        ),
        "simulate": _cli("simulate", str(out / "dp.json")),
    }


def _size(model: SparseMlp) -> str:
    return f"{model.weight_bytes / GB:.2f} GB ({model.layers}x{model.hidden})"


def planning_table(sizes: list[str], work: Path, cap: int | None) -> list[str]:
    floor_model = write_sparse_mlp(work / "floor", *FLOOR)
    floors = {
        name: measure(argv, cap).peak_rss
        for name, argv in planning_commands(floor_model.model, work / "floor").items()
    }
    rows = [
        "| model | command | wall s | peak RSS MB | beyond floor MB | exit |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(rows), flush=True)
    for size in sizes:
        model = write_sparse_mlp(work / size, *SHAPES[size])
        for name, argv in planning_commands(model.model, work / size).items():
            got = measure(argv, cap)
            beyond = (got.peak_rss - floors[name]) / MB
            status = "ok" if got.exit_code == 0 else f"{got.exit_code}: {got.error}"
            rows.append(
                f"| {_size(model)} | {name} | {got.wall_s:.1f} | {got.peak_rss / MB:.0f} "
                f"| {beyond:.0f} | {status} |"
            )
            print(rows[-1], flush=True)
        shutil.rmtree(work / size, ignore_errors=True)
    return rows


def llama_rows(work: Path, cap: int | None) -> None:
    """The planning commands on a LLaMA-3-8B-shaped decoder exported from torch's meta
    device (batch 8, 2,048 tokens; 32 GB of float32 weights on a sparse file)."""
    from benchmarks.llama_shape import export_llama_shape

    began = time.perf_counter()
    exported = export_llama_shape(work / "llama")
    print(f"# LLaMA-3-8B shape exported in {time.perf_counter() - began:.0f} s", flush=True)
    for name, argv in planning_commands(exported.model, work / "llama").items():
        got = measure(argv, cap)
        status = "ok" if got.exit_code == 0 else f"{got.exit_code}: {got.error}"
        size = f"{exported.weight_bytes / GB:.1f} GB (LLaMA-3-8B shape)"
        print(f"| {size} | {name} | {got.wall_s:.1f} | {got.peak_rss / MB:.0f} | | {status} |")


def _mpiexec() -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec") or "mpiexec"


# (plan rule, ranks, save the model): the idle executor first (rank 1 of a single-device
# plan on 2 ranks: interpreter, libraries, graph and plan, no shards).
TRAIN_RUNS = (
    ("single-device", 2, False),
    ("model-parallel", 4, True),
    ("data-parallel", 2, False),
)


def train_table(work: Path, size: str = "2.1") -> list[str]:
    """Per-rank peak RSS of training runs (less an idle executor's) next to the
    simulated peak; the model-parallel run saves the model, then checked by ONNX's
    checker on the path and run by onnxruntime."""
    folder = work / "train"
    model = write_sparse_mlp(folder, *SHAPES[size], fill=Fill.RANDOM)
    rows = [
        "| model | plan | ranks | wall s | peak RSS per rank MB | less idle MB "
        "| simulated MB | saved model |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(rows), flush=True)
    idle = 0
    for rule, ranks, save in TRAIN_RUNS:
        plan, metrics = folder / f"{rule}.json", folder / f"{rule}.jsonl"
        argv = _cli("plan", str(model.model), "--batch", str(BATCH), "--devices", str(ranks))
        made = measure([*argv, "--strategy", rule, "-o", str(plan)])
        if made.exit_code:
            rows.append(f"| {_size(model)} | {rule} | {ranks} | plan failed: {made.error} |")
            print(rows[-1], flush=True)
            continue
        out = folder / "trained.onnx"
        argv = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "executor", "run"]
        argv += [str(plan), "--steps", "2", "--metrics", str(metrics)]
        got = measure(argv + (["--save-model", str(out)] if save else []))
        peaks, simulated = _rank_memory(metrics, plan)
        if rule == "single-device":
            idle = peaks[1] if len(peaks) > 1 else 0
        saved = _check_saved(out) if save and got.exit_code == 0 else ""
        rows.append(
            f"| {_size(model)} | {rule} | {ranks} | {got.wall_s:.1f} "
            f"| {_mb(peaks) or f'failed: {got.error}'} | {_mb([p - idle for p in peaks])} "
            f"| {_mb(simulated)} | {saved} |"
        )
        print(rows[-1], flush=True)
    return rows


def _mb(values: list[int]) -> str:
    return " / ".join(f"{v / MB:.0f}" for v in values)


def _check_saved(out: Path) -> str:
    """The saved model: its data file's size, ONNX's checker on the path, one batch
    through onnxruntime (in a process of its own, measured)."""
    import onnx

    onnx.checker.check_model(str(out))
    code = (
        "import sys, numpy as np, onnxruntime as ort;"
        "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider']);"
        "i = s.get_inputs()[0];"
        f"y = s.run(None, {{i.name: np.ones(({BATCH}, i.shape[1]), np.float32)}})[0];"
        "assert np.isfinite(y).all()"
    )
    ran = measure([sys.executable, "-c", code, str(out)])
    data = out.with_name(out.name + ".data").stat().st_size
    status = "ok" if ran.exit_code == 0 else ran.error
    return (
        f"{data / GB:.2f} GB of data, check_model(path) ok, onnxruntime {status} "
        f"({ran.wall_s:.0f} s, {ran.peak_rss / MB:.0f} MB)"
    )


def _rank_memory(metrics: Path, plan: Path) -> tuple[list[int], list[int]]:
    """Each rank's measured peak RSS (the run's summary) and the plan's simulated peak
    per device."""
    peaks: list[int] = []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if "summary" in record:
                peaks = [int(v) for v in record["summary"]["peak_rss_bytes"]]
    doc = json.loads(plan.read_text())
    simulated = [int(v) for v in doc.get("predicted", {}).get("peak_memory_bytes", [])]
    return peaks, simulated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="0.27,1.3,3.2,34", help="model sizes in GB, of: " + ", ".join(SHAPES)
    )
    parser.add_argument("--cap-gb", type=float, default=16.0, help="address-space cap a process")
    parser.add_argument("--train", action="store_true", help="also train a 2.1 GB model")
    parser.add_argument(
        "--llama",
        action="store_true",
        help="also plan a LLaMA-3-8B-shaped export (needs torch and transformers)",
    )
    parser.add_argument("--work", type=Path, help="folder for the models (default: a temp dir)")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; known: {list(SHAPES)}")
    cap = int(args.cap_gb * GB) if args.cap_gb > 0 else None
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        print(f"# planning ({BATCH} rows a batch), cap {args.cap_gb:g} GB of address space")
        planning_table(sizes, work, cap)
        if args.llama:
            llama_rows(work, cap)
        if args.train:
            print("# training, 2 steps")
            train_table(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
