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
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from onnx2soap.cli.common import add_model_options, loss_choice, seconds
from onnx2soap.cli.machine_cmd import find_mpiexec
from onnx2soap.errors import UserError
from onnx2soap.files import check_output
from onnx2soap.importer import load_model
from onnx2soap.ir import Graph
from onnx2soap.measure.cost_writer import CostWriter
from onnx2soap.options import float_in, int_in
from onnx2soap.sim.achieved import RATES, AchievedCost
from onnx2soap.sim.costdb import CostDB, DeviceKind, db_path_for, host_fingerprint
from onnx2soap.sim.costs import CostModel, RooflineCost
from onnx2soap.sim.machine import Machine
from onnx2soap.sim.presets import _is_file
from onnx2soap.sim.profiled import (
    DTYPE_ITEMSIZE,
    FingerprintMismatch,
    ProfiledCost,
    calibrated,
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


class CostsChoice(Enum):
    AUTO = "auto"  # profiled when a matching cost DB sits next to the machine file
    PROFILED = "profiled"
    ACHIEVED = "achieved"  # GPUs' published kernel rates (sim/achieved.py)
    ROOFLINE = "roofline"


@dataclass(frozen=True)
class ChosenCosts:
    model: CostModel
    description: str  # for the command's output

    @property
    def calibrates(self) -> bool:
        """Whether a model's in-step calibration changes the costs (profiled only)."""
        return isinstance(self.model, ProfiledCost)

    @property
    def name(self) -> str:
        if isinstance(self.model, ProfiledCost):
            return "profiled"
        return "achieved" if isinstance(self.model, AchievedCost) else "roofline"

    def for_graph(self, graph: Graph, machine: Machine) -> ChosenCosts:
        """Profiled costs taken into the step by ``graph``'s own calibration where the
        DB has one (``ProfiledCost.for_graph``), the description saying which; the
        roofline as it is. A model profiled at another batch than it is planned at has
        none: every profiled model's curve then misjudges it (GPT-2's tasks run 1.85x
        their isolated time in its own steps, 1.23x by the curve over four models)."""
        if not isinstance(self.model, ProfiledCost):
            return self
        model = self.model.for_graph(graph, machine)
        if not self.model.in_step:
            how = "no in-step calibration"
        elif calibrated(graph, self.model.in_step):
            how = "calibrated in this model's own steps"
        else:
            how = (
                f"calibrated over every profiled step, none of this model at batch "
                f"{graph.batch} (profile it at that batch for its own)"
            )
        return replace(self, model=model, description=f"{self.description}; {how}")


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


def _achieved(machine: Machine, want: CostsChoice) -> ChosenCosts:
    """The published kernel rates; asked for by name on a machine with devices the
    table lacks, refused (they would be priced by the roofline unsaid)."""
    unknown = [d for d in machine.devices if not AchievedCost.knows(d)]
    if unknown and want is CostsChoice.ACHIEVED:
        first = unknown[0]
        raise UserError(
            f"--costs achieved: no published kernel rates for device {first.name} (its model: "
            f"{first.model or 'none given'}); known models: {', '.join(sorted(RATES))} "
            "(a machine file's devices may name one; or --costs roofline)"
        )
    return ChosenCosts(AchievedCost(), "achieved (published kernel rates, sim/achieved.py)")


def choose_costs(spec: str, machine: Machine, choice: str, dtype: str = "float32") -> ChosenCosts:
    """The cost model for ``machine`` (given as ``spec``). A cost DB measured on another
    device is refused (never used silently), with how to go on."""
    want = CostsChoice(choice)
    roofline = ChosenCosts(RooflineCost(), "roofline")
    if want is CostsChoice.ROOFLINE:
        return roofline
    if want is CostsChoice.ACHIEVED:
        return _achieved(machine, want)
    db = db_path_for(spec) if _is_file(Path(spec)) else None
    if db is None or not db.exists():
        if want is CostsChoice.PROFILED:
            where = f"no cost DB at {db}" if db else f"{spec} is a preset, not a machine file"
            raise UserError(f"--costs profiled: {where}; run onnx2soap profile first")
        known = all(AchievedCost.knows(d) for d in machine.devices)
        return _achieved(machine, want) if known else roofline
    with CostDB.open(db) as opened:
        stored = list(opened.fingerprints().values())
    kinds = [DeviceKind.CUDA] if any(f.kind is DeviceKind.CUDA for f in stored) else []
    here = None
    for kind in [*kinds, DeviceKind.CPU]:
        try:
            fp = host_fingerprint(kind, dtype)
        except UserError:  # no GPU here to match the DB's GPU timings
            continue
        here = here or fp
        if fp in stored:
            cost = ProfiledCost.load(db, fp, machine.devices[0])
            return ChosenCosts(cost, f"profiled ({cost.measured} timings from {db})")
    raise FingerprintMismatch(db, here, stored)
