"""`make demo`: the whole product on the bundled example, with the commands a user types.

1. inspect the model;  2. measure this host's MPI ranks (4, or one per core on a smaller
host: ranks that share a core wait for each other, which the simulator does not model)
and time the model's kernels on them (`machine probe`, `profile`);  3. plan with MCMC
search over the simulator;
4. make a small dataset that can be learned (each class a pattern plus noise);
5. train the plan under mpiexec with Adam, shuffling, evaluation, a checkpoint, a
metrics file and the trained model saved back to ONNX; the loss visibly falls;
6. train the data-parallel baseline briefly and print predicted and measured step times;
7. draw the plan and the loss curves (with matplotlib, the `plots` extra).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "demo"
MODEL = ROOT / "examples" / "cnn.onnx"
RANKS = max(2, min(4, os.cpu_count() or 2))
BATCH, STEPS, BUDGET, CLASSES = 32, 60, 20, 10
SAMPLE = (3, 32, 32)


def bin_path(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def run(*command: str, capture: bool = False) -> str:
    shown = " ".join(
        shlex.quote(Path(c).name if c.startswith("/") and "bin" in c else c) for c in command
    )
    print(f"\n$ {shown}", flush=True)
    done = subprocess.run(command, cwd=ROOT, text=True, capture_output=capture)
    if done.returncode != 0:
        if capture:
            sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(done.returncode)
    return done.stdout if capture else ""


def make_dataset(folder: Path, samples: int, seed: int) -> Path:
    """Images whose class is one of ten fixed patterns, under noise as strong as the
    pattern: learnable in a few dozen steps, not at a glance."""
    patterns = np.random.default_rng(1234).standard_normal((CLASSES, *SAMPLE))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, samples)
    images = patterns[labels] + rng.standard_normal((samples, *SAMPLE))
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "input.npy", images.astype(np.float32))
    np.save(folder / "labels.npy", labels)
    return folder


def train(plan: Path, steps: int, *extra: str) -> list[dict]:
    out = run(
        bin_path("mpiexec"),
        *("-n", str(RANKS), sys.executable, "-m", "executor", "run", str(plan)),
        *("--steps", str(steps), "--seed", "0", "--json", *extra),
        capture=True,
    )
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for r in records:
        if "eval_loss" in r:
            print(f"  eval after step {r['step']:3d}: loss {r['eval_loss']:.4f}  "
                  f"accuracy {r['eval_accuracy']:.3f}")  # fmt: skip
        elif "loss" in r and (r["step"] % 10 == 0 or r["step"] == 1):
            print(f"  step {r['step']:3d}  loss {r['loss']:.4f}  {r['time_s'] * 1e3:7.2f} ms")
    return [r for r in records if "loss" in r]


def median_step(records: list[dict]) -> float:
    return statistics.median(r["time_s"] for r in records[1:])  # the first step warms up


def pictures(onnx2soap: str, plan: Path, metrics: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print("\n(pictures skipped: pip install 'onnx2soap[plots]' for matplotlib)")
        return
    run(onnx2soap, "show", str(plan), "-o", str(BUILD / "plan.png"))
    run(onnx2soap, "plot", str(metrics), "-o", str(BUILD / "loss.png"))


def main() -> int:
    BUILD.mkdir(parents=True, exist_ok=True)
    onnx2soap = bin_path("onnx2soap")
    machine = BUILD / f"cpu{RANKS}.yaml"
    searched, baseline = BUILD / "cnn-mcmc.json", BUILD / "cnn-data-parallel.json"
    run(onnx2soap, "inspect", str(MODEL), "--batch", str(BATCH))
    run(onnx2soap, "machine", "probe", "-n", str(RANKS), "-o", str(machine))
    # Timed afresh each run: timings kept from hours ago would be compared with a step
    # measured now, and this host's speed drifts by tens of percent over a day.
    run(
        onnx2soap,
        "profile",
        str(MODEL),
        "--batch",
        str(BATCH),
        "--machine",
        str(machine),
        "--fresh",
    )
    common = [str(MODEL), "--batch", str(BATCH), "--machine", str(machine)]
    run(onnx2soap, "plan", *common, "--budget", str(BUDGET), "-o", str(searched))
    run(onnx2soap, "plan", *common, "--strategy", "data-parallel", "-o", str(baseline))
    data = make_dataset(BUILD / "train", 2048, seed=0)
    held_out = make_dataset(BUILD / "eval", 256, seed=1)
    metrics = BUILD / "run.jsonl"
    trained = train(
        searched,
        STEPS,
        *("--data", str(data), "--shuffle", "--optimizer", "adam", "--lr", "0.001"),
        *("--eval-data", str(held_out), "--eval-every", "20", "--metrics", str(metrics)),
        *("--checkpoint", str(BUILD / "checkpoints"), "--checkpoint-every", "20"),
        *("--save-model", str(BUILD / "trained.onnx")),
    )
    print(f"\nloss {trained[0]['loss']:.3f} at step 1 -> {trained[-1]['loss']:.3f} at step {STEPS}")
    plans = {"MCMC plan": json.loads(searched.read_text())}
    plans["data parallel"] = json.loads(baseline.read_text())
    measured = {"MCMC plan": median_step(trained)}
    if plans["MCMC plan"]["ops"] == plans["data parallel"]["ops"]:
        print("\nThe search kept data parallelism: the same plan, trained once.")
        measured["data parallel"] = measured["MCMC plan"]
    else:
        measured["data parallel"] = median_step(train(baseline, 10, "--data", str(data)))
    print(f"\n{'plan':<16}{'predicted':>12}{'measured':>12}   (cpu:{RANKS}, batch {BATCH})")
    for name, plan in plans.items():
        predicted = plan["predicted"]["step_time_s"]
        print(f"{name:<16}{predicted * 1e3:>9.2f} ms{measured[name] * 1e3:>9.2f} ms")
    print(
        "\nmeasured: median step time under mpiexec; predicted: the simulator with the"
        " kernel times\n`profile` measured. The trained model is build/demo/trained.onnx"
        " (onnxruntime loads it)."
    )
    pictures(onnx2soap, searched, metrics)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
