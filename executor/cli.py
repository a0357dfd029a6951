"""``python -m executor run PLAN``: train a plan, each MPI rank playing one device.

User errors (bad plan or option, wrong rank count, wrong model, bad data, an output path
that cannot be written) print one line on rank 0 and every rank exits with code 2.

Ctrl-C or SIGTERM (mpiexec forwards both to every rank) stops every rank at the next
step boundary: the ranks agree on it with one small collective per step, so none is left
waiting for a peer. The weights after the last complete step are still saved if
``--save-weights`` was given; rank 0 says so in one line and every rank exits with 130
(SIGINT) or 143 (SIGTERM), without a traceback.

Any other exception on any rank prints its traceback and aborts all ranks, so nothing
hangs. A rank killed outright is reported by mpiexec (its PID, host and signal) and the
others are taken down at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from executor.kinds import DeviceKind, TransportKind
from executor.optim import OptimizerConfig, OptimizerKind, Schedule
from executor.precision import LossScaler
from onnx2soap.errors import UserError
from onnx2soap.ir import DType
from onnx2soap.options import OneLineParser, float_in, int_in
from onnx2soap.precision import Precision

EXIT_USER_ERROR = 2
ABORT_GRACE_S = 0.3
MAX_STEPS = 10**9
MAX_SEED = 2**63 - 1  # numpy seeds are non-negative
MAX_LR = 1e6
MAX_RANKS_PER_HOST = 1 << 16
_SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m executor", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="train a plan under mpiexec")
    run.add_argument(
        "plan", type=Path, help="plan file from `onnx2soap plan`, or an annotated model (.onnx)"
    )
    run.add_argument("--model", type=Path, help="model file (default: the plan's)")
    run.add_argument("--steps", type=int_in(0, MAX_STEPS), default=10, help="steps (default 10)")
    run.add_argument(
        "--lr", type=float_in(0, MAX_LR), default=0.01, help="learning rate (default 0.01)"
    )
    run.add_argument(
        "--seed", type=int_in(0, MAX_SEED), default=0, help="seed of the data and Dropout"
    )
    run.add_argument(
        "--dtype", choices=[DType.FLOAT32.value, DType.FLOAT64.value], default="float32"
    )
    _add_precision_options(run)
    _add_data_options(run)
    _add_optimizer_options(run)
    _add_checkpoint_options(run)
    add_device_options(run)
    _add_output_options(run)
    _add_nonfinite_option(run)
    return parser


def _add_nonfinite_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="train with NaN/Inf in the weights it loads (refused by default)",
    )


def _add_precision_options(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group("mixed precision")
    group.add_argument(
        "--precision",
        choices=[p.value for p in Precision],
        help="bf16/fp16: forward and backward values in the half format, float32 master "
        "weights and optimizer state, as torch.autocast (on CPUs and for bf16 on GPUs: "
        "float32 arithmetic on values rounded to the format); fp16 scales the loss "
        "dynamically, as torch.amp.GradScaler (default: the plan's, else fp32)",
    )
    group.add_argument(
        "--loss-scale",
        type=float_in(0, 2.0**64, low_open=True),
        default=LossScaler.scale,
        metavar="S",
        help="fp16's initial loss scale (default 65536)",
    )
    group.add_argument(
        "--loss-scale-growth-interval",
        type=int_in(1, MAX_STEPS),
        default=LossScaler.growth_interval,
        metavar="K",
        help="fp16: double the loss scale after K steps without an infinity (default 2000)",
    )


def _add_data_options(run: argparse.ArgumentParser) -> None:
    data = run.add_argument_group("data")
    data.add_argument(
        "--data",
        type=Path,
        help="an .npz, or a folder of .npy files (memory-mapped), with one array per data "
        "input (by its ONNX name; 'input' for a single input) and 'labels' "
        "(default: synthetic data from --seed)",
    )
    data.add_argument(
        "--shuffle",
        action="store_true",
        help="visit --data in a new order each epoch (from --seed)",
    )
    data.add_argument("--eval-data", type=Path, help="evaluation data, laid out as --data")
    data.add_argument(
        "--eval-every",
        type=int_in(0, MAX_STEPS),
        default=0,
        metavar="K",
        help="evaluate every K steps (default 0: once, at the end)",
    )


def _add_checkpoint_options(run: argparse.ArgumentParser) -> None:
    ckpt = run.add_argument_group("checkpoints")
    ckpt.add_argument(
        "--checkpoint",
        type=Path,
        metavar="DIR",
        help="write checkpoints here (each rank's shards as safetensors files and an "
        "index; atomically: a crash leaves the previous one whole), at the end, on "
        "Ctrl-C/SIGTERM, and every --checkpoint-every steps",
    )
    ckpt.add_argument(
        "--checkpoint-every",
        type=int_in(0, MAX_STEPS),
        default=0,
        metavar="K",
        help="(default 0: only at the end)",
    )
    ckpt.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="continue from the newest checkpoint in DIR, under this plan or another "
        "(re-sharded); --steps counts from the start of training",
    )
    ckpt.add_argument(
        "--init-weights",
        type=Path,
        metavar="FILE|DIR",
        help="start from safetensors weights (a file, or a Hugging Face folder with "
        "model.safetensors.index.json), by initializer name; each rank reads only its "
        "shards; the model's own values stay for tensors the files leave out",
    )


def add_device_options(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where the arrays live (default: cuda when cupy sees a GPU, else cpu); each "
        "rank takes GPU (node-local rank mod visible GPUs)",
    )
    run.add_argument(
        "--transport",
        choices=[k.value for k in TransportKind],
        default="auto",
        help="how tiles move: mpi (host arrays), mpi-host (GPU arrays staged through "
        "pinned host memory; several ranks may share a GPU), mpi-cuda (a CUDA-aware MPI), "
        "nccl (one rank per GPU); auto: nccl when every rank has its own GPU, else "
        "mpi-host on GPUs and mpi on CPUs",
    )
    run.add_argument(
        "--ranks-per-host",
        type=int_in(1, MAX_RANKS_PER_HOST),
        default=0,
        metavar="N",
        help="take every N consecutive ranks as one host (default: the hosts MPI reports, "
        "ranks sharing memory); MPI transports all-reduce over several hosts in two "
        "levels, inside each host and then across, which this tries on one host",
    )


def _add_output_options(run: argparse.ArgumentParser) -> None:
    out = run.add_argument_group("outputs")
    out.add_argument(
        "--save-weights",
        type=Path,
        help="write the trained weights, under the model's initializer names: .safetensors "
        "(what torch and Hugging Face load) or .npz; every rank writes its shards (the path "
        "is checked before training)",
    )
    out.add_argument(
        "--save-model",
        type=Path,
        metavar="OUT.onnx",
        help="write the input model with the trained initializers and state (on rank 0; "
        "weights in OUT.onnx.data when the input had external data or they pass 1 GB)",
    )
    out.add_argument(
        "--metrics",
        type=Path,
        metavar="RUN.jsonl",
        help="one JSON line per step and evaluation (rank 0; `onnx2soap plot` draws it)",
    )
    out.add_argument(
        "--trace",
        type=Path,
        metavar="MEASURED.json",
        help="time every task of steps 2-11 on every rank (in the simulator's names) and write "
        "one Perfetto file, with each rank's peak memory; `onnx2soap compare` reads it",
    )
    out.add_argument("--json", action="store_true", help="one JSON object per line")


def _add_optimizer_options(run: argparse.ArgumentParser) -> None:
    opt = run.add_argument_group("optimizer (each step equals torch.optim's)")
    opt.add_argument(
        "--optimizer", choices=[k.value for k in OptimizerKind], default="sgd", help="(default sgd)"
    )
    opt.add_argument(
        "--momentum", type=float_in(0, 1), default=0.9, help="momentum, nesterov (default 0.9)"
    )
    opt.add_argument(
        "--weight-decay",
        type=float_in(0, 1e3),
        default=0.0,
        help="L2 added to the gradient; decoupled for adamw (default 0)",
    )
    opt.add_argument(
        "--betas",
        type=float_in(0, 1),
        nargs=2,
        default=(0.9, 0.999),
        metavar=("B1", "B2"),
        help="adam, adamw (default 0.9 0.999)",
    )
    opt.add_argument(
        "--eps", type=float_in(0, 1, low_open=True), default=1e-8, help="adam (default 1e-8)"
    )
    opt.add_argument(
        "--lr-schedule",
        choices=[k.value for k in Schedule],
        default="constant",
        help="after the warm-up: constant, cosine or linear decay to 0 at the last step",
    )
    opt.add_argument(
        "--warmup-steps",
        type=int_in(0, MAX_STEPS),
        default=0,
        help="linear warm-up: step k of K uses lr (k+1)/K (default 0)",
    )


def _optimizer(args) -> OptimizerConfig:
    return OptimizerConfig(
        kind=OptimizerKind(args.optimizer),
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        betas=tuple(args.betas),
        eps=args.eps,
        schedule=Schedule(args.lr_schedule),
        warmup_steps=args.warmup_steps,
    )


class StopSignals:
    """Remembers the first SIGINT or SIGTERM instead of raising in the middle of a step;
    ``train`` polls it at every step boundary. Calling it gives the signal number (0: none)."""

    def __init__(self) -> None:
        self.received = 0

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers (an embedding caller's business)
        for signum in _SIGNAL_NAMES:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.received = self.received or signum

    def __call__(self) -> int:
        return self.received


def _rank_map(as_json: bool):
    """One line before the first step: each rank's host and pid. A rank killed by a
    signal takes the run down at once (mpiexec kills the others), and mpiexec names only
    its pid and host: this line says which rank that was."""

    def show(ranks) -> None:
        if as_json:
            print(json.dumps({"ranks": [vars(r) for r in ranks]}))
        else:
            print("ranks: " + ", ".join(f"{r.rank}={r.host}:{r.pid}" for r in ranks))
        sys.stdout.flush()

    return show


def summary_fields(result) -> dict:
    times = [r.time_s for r in result.steps]
    # The first step includes one-off costs (allocations, communicator warm-up).
    steady = times[1:] or times
    return {
        "steps": len(result.steps),
        "final_loss": result.steps[-1].loss if result.steps else None,
        "mean_step_time_s": sum(steady) / len(steady) if steady else None,
        "bytes_sent": list(result.bytes_sent),
        "peak_rss_bytes": list(result.peak_rss),
    }


def _summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"summary": summary}))
    elif not summary["steps"]:
        print("0 steps: nothing trained")
    else:
        mean = summary["mean_step_time_s"]
        peaks = [round(b / 2**20) for b in summary["peak_rss_bytes"]]
        print(
            f"{summary['steps']} steps, final loss {summary['final_loss']:.6f}, mean step "
            f"{mean * 1e3:.2f} ms (after the first), bytes sent per rank {summary['bytes_sent']}, "
            f"peak memory (RSS) per rank MB {peaks}"
        )
    sys.stdout.flush()


def _error_line(message: str) -> None:
    text = " ".join(message.split())
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    print(f"executor: error: {text}", file=sys.stderr, flush=True)


def _world_rank() -> int:
    """This process's rank, for a refusal before the run starts (one line, from rank 0)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def _abort(comm, code: int) -> int:
    """Take every rank down. If MPI_Abort returns (a peer is aborting at the same time),
    leave at once: nothing after this may run (it once printed a second traceback).

    The pause first lets mpiexec forward what this rank just wrote to stderr: an abort
    that follows the write at once sometimes took the message down with the processes."""
    time.sleep(ABORT_GRACE_S)
    try:
        comm.Abort(code)
    finally:
        os._exit(code)
    return code  # not reached


def _interrupted_line(result, steps: int, args) -> str:
    name = _SIGNAL_NAMES.get(result.interrupted, f"signal {result.interrupted}")
    done = result.first_step + len(result.steps)
    saved = [f"weights saved to {args.save_weights}"] if args.save_weights else []
    if args.checkpoint:
        saved.append(f"checkpoint in {args.checkpoint} (--resume {args.checkpoint} continues)")
    said = "; " + ", ".join(saved) if saved else ""
    return f"executor: interrupted by {name}: stopped after step {done} of {steps}{said}"


def main(argv: Sequence[str] | None = None) -> int:
    stop = StopSignals()
    stop.install()  # first: a Ctrl-C from here on is a request, never a traceback
    try:
        args = build_parser().parse_args(argv)
        optimizer = _optimizer(args)
        if args.init_weights is not None and args.resume is not None:
            raise UserError(
                "--init-weights and --resume: a resumed run continues from its checkpoint's "
                "weights; give one of them"
            )
    except UserError as e:
        if _world_rank() == 0:
            _error_line(str(e))
        return EXIT_USER_ERROR
    from mpi4py import MPI  # imported here so --help works without MPI

    from executor.progress import Progress
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
        shuffle=args.shuffle,
        eval_data=args.eval_data,
        eval_every=args.eval_every,
        metrics=args.metrics,
        trace=args.trace,
        save_weights=args.save_weights,
        save_model=args.save_model,
        allow_nonfinite=args.allow_nonfinite,
        precision=Precision(args.precision) if args.precision else None,
        loss_scale=args.loss_scale,
        loss_scale_growth_interval=args.loss_scale_growth_interval,
        optimizer=optimizer,
        checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        init_weights=args.init_weights,
        device=DeviceKind(args.device) if args.device else None,
        transport=TransportKind(args.transport),
        ranks_per_host=args.ranks_per_host,
    )
    progress = Progress(args.steps, args.json, args.metrics, resumed=args.resume is not None)
    try:
        result = train(
            comm,
            options,
            on_step=progress.step,
            stop=stop,
            on_start=_rank_map(args.json),
            on_eval=progress.evaluation,
        )
    except UserError as e:
        if rank == 0:
            _error_line(str(e))
        return EXIT_USER_ERROR
    except MemoryError:
        _error_line(f"rank {rank}: out of memory; a smaller batch or more ranks may fit")
        return _abort(comm, EXIT_USER_ERROR)
    except Exception:
        sys.stderr.write(f"executor: rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        return _abort(comm, 1)
    summary = summary_fields(result)
    if rank == 0:
        progress.summary(summary)
    progress.close()
    if rank == 0:
        _summary(summary, args.json)
    if result.interrupted:
        if rank == 0:
            print(_interrupted_line(result, args.steps, args), file=sys.stderr)
        return 128 + result.interrupted
    return 0
