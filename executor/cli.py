"""``python -m executor run PLAN``: train a plan, each MPI rank playing one device.

User errors (bad plan, wrong rank count, wrong model, bad data) print one line on rank 0
and every rank exits with code 2. Any other exception on any rank prints its traceback
and aborts all ranks, so nothing hangs.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from onnx2soap.errors import UserError
from onnx2soap.ir import DType

EXIT_USER_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m executor", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="train a plan under mpiexec")
    run.add_argument("plan", type=Path, help="plan file from `onnx2soap plan`")
    run.add_argument("--model", type=Path, help="model file (default: the plan's)")
    run.add_argument("--steps", type=int, default=10, help="SGD steps (default 10)")
    run.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    run.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    run.add_argument(
        "--dtype", choices=[DType.FLOAT32.value, DType.FLOAT64.value], default="float32"
    )
    run.add_argument("--data", type=Path, help=".npz with arrays 'input' and 'labels'")
    run.add_argument("--save-weights", type=Path, help="write trained weights (.npz) on rank 0")
    run.add_argument("--json", action="store_true", help="one JSON object per line")
    return parser


def _printer(as_json: bool):
    def show(record) -> None:
        if as_json:
            print(json.dumps({"step": record.step, "loss": record.loss, "time_s": record.time_s}))
        else:
            print(
                f"step {record.step:4d}  loss {record.loss:.6f}  time {record.time_s * 1e3:8.2f} ms"
            )
        sys.stdout.flush()

    return show


def _summary(result, as_json: bool) -> None:
    times = [r.time_s for r in result.steps]
    # The first step includes one-off costs (allocations, communicator warm-up).
    steady = times[1:] or times
    summary = {
        "steps": len(result.steps),
        "final_loss": result.steps[-1].loss if result.steps else None,
        "mean_step_time_s": sum(steady) / len(steady) if steady else None,
        "bytes_sent": list(result.bytes_sent),
    }
    if as_json:
        print(json.dumps({"summary": summary}))
    elif not result.steps:
        print("0 steps: nothing trained")
    else:
        mean = summary["mean_step_time_s"]
        print(
            f"{summary['steps']} steps, final loss {summary['final_loss']:.6f}, mean step "
            f"{mean * 1e3:.2f} ms (after the first), bytes sent per rank {summary['bytes_sent']}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mpi4py import MPI  # imported here so --help works without MPI

    from executor.train import RunOptions, train

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    options = RunOptions(
        plan=args.plan,
        model=args.model,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        dtype=DType(args.dtype),
        data=args.data,
        save_weights=args.save_weights,
    )
    try:
        if args.steps < 0:
            raise UserError(f"--steps must be >= 0, got {args.steps}")
        result = train(comm, options, on_step=_printer(args.json))
    except UserError as e:
        if rank == 0:
            print(f"executor: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception:
        sys.stderr.write(f"executor: rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        comm.Abort(1)
    if rank == 0:
        _summary(result, args.json)
    return 0
