"""N ranks on this host's CPU, or sharing one GPU: the measured step next to the predicted.

    python -m benchmarks.multirank --device cpu --ranks 4
    python -m benchmarks.multirank --device cuda --ranks 4    # mpi-host, one GPU

For the example CNN (float32), plans data-parallel, random and searched (MCMC on the
machine below) each train ``--steps`` steps under a real mpiexec; the table gives the
executor's mean step (after the first) next to ``onnx2soap simulate``'s prediction.

The machine: on CPU this host's N ranks as ``onnx2soap machine probe -n N`` measures
them, with the model's task times from ``onnx2soap profile`` (the plans are searched and
simulated with those measured costs); on a GPU a machine file for N ranks that share one
H200 (each a 1/N share of its float32 rate and memory bandwidth) that move tiles through
pinned host memory (PCIe, plus MPI's latency), an analytic model with roofline costs.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import subprocess

import yaml

from benchmarks.models import BUILD, ROOT
from onnx2soap.cli.machine_cmd import find_mpiexec
from onnx2soap.sim.costdb import db_path_for

PYTHON = Path(sys.executable)
H200_FP32_FLOPS, H200_BANDWIDTH, H200_MEMORY = 67e12, 4.8e12, 141 * 2**30
HOST_STAGED_BANDWIDTH, HOST_STAGED_LATENCY = 20e9, 30e-6
KERNEL_OVERHEAD = 20e-6  # a Python dispatch and a kernel launch


def shared_gpu_machine(ranks: int) -> dict:
    devices = [
        {
            "name": f"h200/{ranks}",
            "peak_flops": H200_FP32_FLOPS / ranks,
            "memory_bandwidth": H200_BANDWIDTH / ranks,
            "memory": H200_MEMORY // ranks,
            "kernel_overhead": KERNEL_OVERHEAD,
        }
        for _ in range(ranks)
    ]
    links = [
        {
            "name": f"rank{r}-{way}",
            "bandwidth": HOST_STAGED_BANDWIDTH,
            "latency": HOST_STAGED_LATENCY,
        }
        for r in range(ranks)
        for way in ("out", "in")
    ]
    routes = [
        {"src": a, "dst": b, "links": [f"rank{a}-out", f"rank{b}-in"]}
        for a in range(ranks)
        for b in range(ranks)
        if a != b
    ]
    return {"name": f"h200-shared:{ranks}", "devices": devices, "links": links, "routes": routes}


def _onnx2soap(*args: str) -> str:
    done = subprocess.run(
        [str(PYTHON), "-m", "onnx2soap", *args], capture_output=True, text=True, check=True
    )
    return done.stdout


def _plans(model: Path, batch: int, ranks: int, machine: str, out: Path) -> dict[str, Path]:
    plans = {}
    for name, extra in (
        ("data-parallel", ["--strategy", "data-parallel"]),
        ("random", ["--strategy", "random", "--seed", "1"]),
        ("searched", ["--max-evals", "1500", "--seed", "0"]),
    ):
        path = out / f"{name}-{ranks}.json"
        _onnx2soap("plan", str(model), "--batch", str(batch), "--machine", machine,
                   *extra, "-o", str(path))  # fmt: skip
        plans[name] = path
    return plans


def _measured_s(plan: Path, ranks: int, steps: int, device: str) -> float:
    transport = ["--transport", "mpi-host"] if device == "cuda" else []
    command = [find_mpiexec(), "-n", str(ranks), str(PYTHON), "-m", "executor", "run", str(plan),
               "--steps", str(steps), "--json", "--device", device, *transport]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    for line in done.stdout.splitlines():
        if line.startswith("{") and "summary" in line:
            return json.loads(line)["summary"]["mean_step_time_s"]
    raise RuntimeError(f"no summary from the executor:\n{done.stdout}\n{done.stderr}")


def _predicted_s(plan: Path, machine: str) -> float:
    doc = json.loads(_onnx2soap("simulate", str(plan), "--machine", machine, "--json"))
    return doc["step_time_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batch", type=int, help="default 32 on cpu, 256 on cuda")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    out = BUILD / "multirank"
    out.mkdir(parents=True, exist_ok=True)
    batch = args.batch or (256 if args.device == "cuda" else 32)
    model = ROOT / "examples" / "cnn.onnx"
    if args.device == "cuda":
        machine_file = out / f"h200-shared-{args.ranks}.yaml"
        machine_file.write_text(yaml.safe_dump(shared_gpu_machine(args.ranks)))
    else:
        machine_file = out / f"host-{args.ranks}.yaml"
        # Timed afresh: a database from an earlier run would answer from then.
        db_path_for(machine_file).unlink(missing_ok=True)
        _onnx2soap("machine", "probe", "-n", str(args.ranks), "-o", str(machine_file))
        _onnx2soap("profile", str(model), "--batch", str(batch), "--machine", str(machine_file),
                   "--quiet")  # fmt: skip
    machine = str(machine_file)
    print(f"example CNN, batch {batch}, {args.ranks} ranks on {args.device}, machine {machine}")
    print(f"{'plan':14} {'measured ms':>12} {'predicted ms':>13} {'pred/meas':>10}")
    for name, plan in _plans(model, batch, args.ranks, machine, out).items():
        measured = _measured_s(plan, args.ranks, args.steps, args.device)
        predicted = _predicted_s(plan, machine)
        print(
            f"{name:14} {measured * 1e3:12.2f} {predicted * 1e3:13.2f} {predicted / measured:10.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
