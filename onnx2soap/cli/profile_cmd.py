"""``onnx2soap profile MODEL``: time the model's tasks with the executor's kernels, and the
cost-model choice ``plan`` and ``simulate`` share (``--costs``).

The timings go to a SQLite database next to the machine file (``host.yaml`` ->
``host.costs.sqlite``) under this host's fingerprint. The ranks run under mpiexec, as the
executor's do; a second run measures only what is missing, so an interrupted profile
resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from onnx2soap.cli.common import add_model_options, loss_choice, seconds
from onnx2soap.cli.machine_cmd import find_mpiexec
from onnx2soap.errors import UserError
from onnx2soap.files import check_output
from onnx2soap.importer import load_model
from onnx2soap.ir import Graph
from onnx2soap.measure.cost_writer import CostWriter
from onnx2soap.options import float_in, int_in
from onnx2soap.sim.chosen_costs import (  # noqa: F401 (the other commands import them here)
    ChosenCosts,
    CostsChoice,
    choose_costs,
)
from onnx2soap.sim.costdb import CostDB, DeviceKind, db_path_for, host_fingerprint
from onnx2soap.sim.machine import Machine
from onnx2soap.sim.presets import _is_file
from onnx2soap.sim.profiled import (
    DTYPE_ITEMSIZE,
    calibrations,
)
from onnx2soap.soap.plan import MAX_DEVICES

MAX_REPEAT = 1000
MAX_MIN_TIME_S = 10.0
EXIT_INTERRUPTED = 130


def register(sub) -> None:
    p = sub.add_parser("profile", help="time a model's tasks on this host into a cost database")
    add_model_options(p)
    p.add_argument("--machine", required=True, help="machine file (or a preset, with --db)")
    p.add_argument("--db", help="cost database (default: next to the machine file)")
    p.add_argument(
        "--device",
        choices=[k.value for k in DeviceKind],
        default=DeviceKind.CPU.value,
        help="where the kernels run: CPU ranks (numpy) or GPUs (cupy)",
    )
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument(
        "--ranks",
        type=int_in(1, MAX_DEVICES),
        help="ranks timing at once (default: the machine's devices, or its cores where they "
        "share them; give the ranks of one host when the machine spans several)",
    )
    p.add_argument(
        "--repeat",
        type=int_in(1, MAX_REPEAT),
        default=5,
        help="timed calls per task at least (the median is kept)",
    )
    p.add_argument(
        "--min-time",
        type=float_in(0, MAX_MIN_TIME_S),
        default=0.01,
        help="seconds per task at least",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="time every task and the in-step calibration again, replacing what the DB "
        "holds for them on this host (whose speed may have changed since; default: keep "
        "them and time only what is missing)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(run=run)


def _db_path(args) -> Path:
    if args.db:
        return Path(args.db)
    if not _is_file(Path(args.machine)):
        raise UserError(
            f"--machine {args.machine}: a preset has no file to keep the costs next to; "
            "give --db PATH (or a machine file from onnx2soap machine probe)"
        )
    return db_path_for(args.machine)


def _ranks(args, machine: Machine) -> int:
    """As many ranks as will compute at once on this host: every device, or where the
    machine's ranks share cores, one per core (the simulator gives a shared core's
    devices their turns, so a kernel is timed at a core's own rate, with the other cores
    busy as in a step)."""
    if args.ranks:
        return args.ranks
    return machine.cores if machine.shares_cores else machine.size


def _command(args, db: Path, devices: int, ranks: int) -> list[str]:
    command = [find_mpiexec(), "-n", str(ranks), sys.executable, "-m", "onnx2soap.measure.profiler"]
    command += [str(args.model), "--devices", str(devices), "--db", str(db)]
    command += ["--device", args.device, "--dtype", args.dtype]
    command += ["--repeat", str(args.repeat), "--min-time", str(args.min_time)]
    if args.batch:
        command += ["--batch", str(args.batch)]
    if args.loss:
        command += ["--loss", args.loss]
    if args.fresh:
        command += ["--fresh"]
    return command


def _failure(lines: list[str], code: int) -> str:
    """The ranks' one-line error if one printed it, else their last line."""
    errors = [x for x in lines if x.startswith("error: ")]
    if errors:
        return errors[-1][len("error: ") :]
    last = next((x for x in reversed(lines) if x.strip()), "(no output)")
    return f"profile under mpiexec failed ({code}): {last.strip()}"


def run(args: argparse.Namespace) -> int:
    from onnx2soap.sim.presets import resolve_machine

    machine = resolve_machine(args.machine)
    db = _db_path(args)
    check_output(db)  # before the ranks start measuring
    if db.exists():
        CostWriter.open(db).close()  # a file that is no cost DB: refused now
    # Checked here, where an error is one line; the ranks load it again.
    model = load_model(args.model, args.batch, loss_choice(args.loss))
    ranks = _ranks(args, machine)
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")  # as the executor runs: one BLAS thread per rank
    proc = subprocess.Popen(
        _command(args, db, machine.size, ranks),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        for line in proc.stderr:
            if line.startswith("progress: "):
                if not args.quiet:
                    print(
                        f"onnx2soap profile: {line[len('progress: ') :]}", end="", file=sys.stderr
                    )
            else:
                lines = [*lines[-40:], line.rstrip("\n")]
        out = proc.stdout.read()
        code = proc.wait()
    except KeyboardInterrupt:
        _stop(proc)
        print(
            f"onnx2soap: interrupted; the timings taken so far are in {db} "
            "(run the same command again to resume)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if code != 0:
        raise UserError(_failure(lines, code))
    summary = json.loads(out.strip().splitlines()[-1])
    print(
        f"wrote {db}: {summary['measured']} timings taken, {summary['skipped']} already there, "
        f"in {seconds(summary['seconds'])} on {summary['ranks']} ranks"
    )
    print(f"  fingerprint: {summary['fingerprint']}")
    line = _calibration_line(db, DeviceKind(args.device), args.dtype, model.graph, machine)
    print(f"  in-step calibration: {line}")
    return 0


def _calibration_line(
    db: Path, kind: DeviceKind, dtype: str, graph: Graph, machine: Machine
) -> str:
    """Per phase, how the step's times of ``graph``'s tasks relate to the isolated ones
    (``ProfiledCost.for_graph``)."""
    fp = host_fingerprint(kind, dtype)
    with CostDB.open(db) as opened:
        fp_id = opened.find(fp)
        if fp_id is None:  # the ranks stored nothing under it
            return "none"
        timings, points = opened.timings(fp_id), opened.in_step(fp_id)
    itemsize = DTYPE_ITEMSIZE[dtype]
    fitted = calibrations(timings, points, graph, machine, itemsize)
    if not fitted:
        return "none"
    return ", ".join(
        f"{phase.value} {c.scale:.2f} x isolated + {c.overhead * 1e6:.1f} us"
        for phase, c in sorted(fitted.items(), key=lambda kv: kv[0].value)
    )


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C reached mpiexec too (same process group); make sure it is gone."""
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        proc.kill()
        proc.wait()


# --- the cost model plan and simulate use ----------------------------------------------------


def add_costs_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--costs",
        choices=[c.value for c in CostsChoice],
        default=CostsChoice.AUTO.value,
        help="task costs: measured by onnx2soap profile (a cost DB next to the machine "
        "file, for this host); achieved: GPUs' kernels at their published rates; or the "
        "roofline (datasheet peaks); auto: profiled where there is such a DB, else "
        "achieved where every device is a GPU with published rates, else the roofline",
    )
