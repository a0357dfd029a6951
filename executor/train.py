"""Load a plan and its model on every rank, agree that all is well, and train.

``train(comm, options)`` is the whole run with the communicator injected: the CLI passes
``MPI.COMM_WORLD``; tests pass ``MPI.COMM_SELF`` for the one-device reference.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
from mpi4py import MPI

from executor.checkpoint import (
    LossScale,
    RunIdentity,
    check_identity,
    read_manifest,
    restore,
    save_checkpoint,
)
from executor.crew import Crew, Note
from executor.data import SyntheticData, rows_needed
from executor.dataset import FileData, open_dataset
from executor.device import open_device
from executor.doorbell import Doorbell, GroupBell
from executor.evaluation import EvalRecord, evaluate
from executor.host_memory import keep_freed_memory, release_python_heap, settle_python_heap
from executor.init_weights import initial_weights
from executor.kinds import DeviceKind, TransportKind
from executor.model_out import check_saveable, save_model
from executor.optim import OptimizerConfig
from executor.precision import LossScaler
from executor.program import compile_program
from executor.records import StepRecord
from executor.runtime import Runtime
from executor.trace import Tracer, write_measured
from executor.transport import make_transport, nap_precisely, oversubscribed, wait_patiently
from executor.weights_out import save_weights
from onnx2soap.errors import UserError
from onnx2soap.files import check_directory, check_output
from onnx2soap.importer import ImportedModel, file_sha256, load_model
from onnx2soap.ir import DType, Graph
from onnx2soap.precision import Precision
from onnx2soap.soap import PartitionedGraph, Partitioner, Plan, analyze, import_loss, load_plan
from onnx2soap.soap.annotations import is_annotated_model, read_annotated
from onnx2soap.soap.partition import rect_shape
from onnx2soap.soap.zero import check_zero

T = TypeVar("T")


@dataclass(frozen=True)
class RunOptions:
    plan: Path
    model: Path | None = None
    steps: int = 10
    lr: float = 0.01
    seed: int = 0
    dtype: DType = DType.FLOAT32
    data: Path | None = None  # an .npz or a folder of .npy (memory-mapped)
    shuffle: bool = False  # reshuffle the data file every epoch, from the seed
    eval_data: Path | None = None
    eval_every: int = 0  # steps between evaluations (0: only at the end, with eval_data)
    metrics: Path | None = None  # one JSON line per step and evaluation (rank 0)
    trace: Path | None = None  # every rank's measured timeline (Perfetto JSON, rank 0)
    save_weights: Path | None = None
    save_model: Path | None = None  # the input model with the trained initializers
    allow_nonfinite: bool = False  # NaN/Inf in the weights a rank loads
    precision: Precision | None = None  # None: the plan's
    loss_scale: float = LossScaler.scale  # fp16's initial loss scale
    loss_scale_growth_interval: int = LossScaler.growth_interval
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    device: DeviceKind | None = None  # None: a GPU when cupy sees one, else the CPU
    transport: TransportKind = TransportKind.AUTO
    ranks_per_host: int = 0  # 0: the hosts MPI sees; N: every N consecutive ranks a host
    checkpoint: Path | None = None  # a folder of checkpoints
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end or a stop)
    resume: Path | None = None  # a checkpoint folder to continue from
    init_weights: Path | None = None  # safetensors weights to start from (a file or a folder)


@dataclass(frozen=True)
class RankInfo:
    """Where a rank runs: what mpiexec names when a rank dies (its pid and host), mapped
    to the rank, since a rank killed by a signal takes the others down before they can
    say which one it was."""

    rank: int
    host: str
    pid: int


@dataclass(frozen=True)
class RunResult:
    steps: tuple[StepRecord, ...]
    bytes_sent: tuple[int, ...]  # per rank, over all steps
    weights: dict[str, np.ndarray] | None  # gathered on rank 0 when asked (tests)
    interrupted: int = 0  # the signal every rank stopped on early (0: all steps ran)
    first_step: int = 0  # steps done before this run (a resumed run)
    peak_rss: tuple[int, ...] = ()  # bytes, per rank: the process's peak resident memory


@dataclass(frozen=True)
class _Setup:
    plan: Plan
    model: ImportedModel
    pg: PartitionedGraph
    data: SyntheticData | FileData
    eval_data: FileData | None = None
    precision: Precision = Precision.FP32


def _plan(path: Path) -> Plan:
    """A plan file, or a model with ONNX multi-device annotations (``.onnx``) read as
    the plan its annotations state (soap/annotations); its model is the file itself."""
    if is_annotated_model(path):
        return read_annotated(path, lambda batch, loss: load_model(path, batch, loss))
    return load_plan(path)


def _setup(comm: MPI.Comm, options: RunOptions) -> _Setup:
    plan = _plan(Path(options.plan))
    if comm.Get_size() != plan.devices:
        raise UserError(
            f"{options.plan}: the plan is for {plan.devices} devices but {comm.Get_size()} "
            f"ranks were started (run mpiexec -n {plan.devices})"
        )
    path = options.model or plan.model_path
    if not Path(path).is_file():
        raise UserError(f"{path}: model file not found (pass --model PATH)")
    digest = file_sha256(Path(path))
    if digest != plan.model_sha256:
        raise UserError(
            f"{path}: sha256 {digest[:12]}… differs from the plan's {plan.model_sha256[:12]}…; "
            "the plan was made for another model file"
        )
    model = load_model(path, plan.graph_batch, import_loss(plan))
    if options.init_weights is not None:
        weights, state = initial_weights(options.init_weights, model.weights, model.state)
        model = replace(model, weights=weights, state=state)
    strategy = plan.strategy(model.graph, analyze(model.graph))
    pg = Partitioner(model.graph).partition(strategy)
    check_zero(plan.zero, (g for gs in pg.groups.values() for g in gs), str(options.plan))
    dtype = np.dtype(options.dtype.value)
    # A step is the plan's batch: a pipeline's microbatches of the graph's batch each.
    microbatches = plan.batch // plan.graph_batch
    if options.data is not None:
        shuffle = options.seed if options.shuffle else None
        data = open_dataset(Path(options.data), model.graph, dtype, shuffle, microbatches)
    else:
        data = SyntheticData(model.graph, options.seed, dtype, microbatches)
    eval_data = None
    if options.eval_data is not None:
        eval_data = open_dataset(Path(options.eval_data), model.graph, dtype, None, microbatches)
    return _Setup(plan, model, pg, data, eval_data, precision_of(plan, options))


def agreed(comm: MPI.Comm, work: Callable[[], T]) -> T:
    """Every rank runs ``work``; if any fails, all raise the first error (no rank hangs)."""
    result, error = None, None
    try:
        result = work()
    except UserError as e:
        error = str(e)
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise UserError(errors[0])
    return result


def agreed_setup(comm: MPI.Comm, options: RunOptions) -> _Setup:
    """Every rank sets up; if any fails, all raise the first error (no rank hangs)."""
    return agreed(comm, lambda: _setup(comm, options))


def _runtime(s: _Setup, options: RunOptions, rank: int, transport, device) -> Runtime:
    """The rank's runtime, its shards read from the model's weights (only the boxes its
    tasks hold), checked for NaN and infinities unless ``--allow-nonfinite``."""
    try:
        return Runtime(
            s.pg,
            compile_program(s.pg, rank, s.plan.zero, s.plan.pipeline, s.plan.bucket_mb),
            transport,
            {**s.model.weights, **s.model.state},
            np.dtype(options.dtype.value),
            s.model.constants,
            options.seed,
            device,
            options.optimizer,
            refuse_nonfinite=not options.allow_nonfinite,
            precision=s.precision,
            zero=s.plan.zero,
            recompute=frozenset(s.plan.recompute),
        )
    except UserError as e:
        raise UserError(f"{s.model.path}: {e}") from e
    except OSError as e:  # the weights' file went away or became unreadable since setup
        raise UserError(f"{s.model.path}: cannot read its weights ({e})") from e


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far. Linux's ``VmHWM`` is the high-water
    mark of this address space alone; ``ru_maxrss`` also holds the one ``exec`` replaced
    (a rank started straight from a big process would report that process's size)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # no procfs: macOS, bytes
    return peak if sys.platform == "darwin" else peak * 1024


def gather_weights(comm: MPI.Comm, rt: Runtime, graph: Graph) -> dict[str, np.ndarray] | None:
    """Assemble every weight and state tensor on rank 0 from the lowest device of each
    replica group, for tests and small models (saving never gathers: ``weights_out``).
    Rank 0 receives in the order every owner sends (group order), so the messages need
    no tags."""
    rank = comm.Get_rank()
    held = (*graph.weights, *graph.states)
    full = {w.name: np.empty(w.shape, dtype=rt.dtype) for w in held} if rank == 0 else {}
    for op in graph.ops:
        for group in rt.pg.groups[op.name]:
            key = (group.weight, group.rect)
            for owner, rect in rt.written(group):
                where = tuple(slice(lo, hi) for lo, hi in rect)
                if rank == 0 and owner == 0:
                    full[group.weight][where] = rt.device.to_host(rt.shards[key])
                elif rank == 0:
                    buf = np.empty(rect_shape(rect), dtype=rt.dtype)
                    comm.Recv(buf, source=owner)
                    full[group.weight][where] = buf
                elif rank == owner:
                    comm.Send(np.ascontiguousarray(rt.device.to_host(rt.shards[key])), dest=0)
    return full if rank == 0 else None


def _check_outputs(comm: MPI.Comm, options: RunOptions) -> None:
    """Output paths are checked before hours of training, not after them."""
    problem = None
    if comm.Get_rank() == 0:
        try:
            outputs = (options.save_weights, options.save_model, options.metrics, options.trace)
            for out in outputs:
                if out is not None:
                    check_output(out)
            if options.checkpoint is not None:
                check_directory(options.checkpoint)
        except UserError as e:
            problem = str(e)
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        raise UserError(problems[0])


def _agree_on(comm: MPI.Comm, work: Callable[[], None]) -> None:
    """Run ``work`` on rank 0; a UserError there is raised on every rank."""
    problem = None
    if comm.Get_rank() == 0:
        try:
            work()
        except UserError as e:
            problem = str(e)
    problem = comm.bcast(problem, root=0)
    if problem:
        raise UserError(problem)


def _identity(s: _Setup, options: RunOptions) -> RunIdentity:
    return RunIdentity(
        s.plan.model_sha256,
        s.plan.batch,
        options.dtype.value,
        options.seed,
        options.optimizer.kind.value,
        s.precision.value,
    )


def precision_of(plan: Plan, options: RunOptions) -> Precision:
    """``--precision``, else the plan's; mixed precision keeps float32 master weights."""
    precision = options.precision or plan.precision
    if precision.mixed and options.dtype is not DType.FLOAT32:
        raise UserError(
            f"--precision {precision.value} trains float32 master weights; it needs --dtype "
            f"float32, not {options.dtype.value}"
        )
    return precision


def _scaler(precision: Precision, options: RunOptions) -> LossScaler | None:
    if not precision.scales_loss:
        return None
    return LossScaler(options.loss_scale, growth_interval=options.loss_scale_growth_interval)


def _resume(
    comm: MPI.Comm, rt: Runtime, s: _Setup, options: RunOptions, scaler: LossScaler | None
) -> int:
    """Restore from ``--resume`` (every rank reads what it needs); the steps done."""
    error, done = None, 0
    try:
        manifest, path = read_manifest(options.resume)
        check_identity(options.resume, manifest.identity, _identity(s, options))
        restore(rt, manifest, path)
        done = manifest.step
        if scaler is not None and manifest.loss_scale is not None:
            scaler.scale = manifest.loss_scale.scale
            scaler.growth_tracker = manifest.loss_scale.growth_tracker
    except UserError as e:
        error = str(e)
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise UserError(errors[0])
    return done


@dataclass
class _Checkpoints:
    """Saves every ``every`` steps, on an interrupt and at the end (when asked)."""

    comm: MPI.Comm
    rt: Runtime
    options: RunOptions
    identity: RunIdentity
    plan_sha: str
    scaler: LossScaler | None = None
    saved: int = -1

    def maybe(self, done: int, force: bool = False) -> None:
        every, directory = self.options.checkpoint_every, self.options.checkpoint
        if directory is None or done == self.saved:
            return
        if force or (every and done % every == 0):
            scale = self.scaler
            kept = None if scale is None else LossScale(scale.scale, scale.growth_tracker)
            save_checkpoint(self.comm, self.rt, directory, done, self.identity, self.plan_sha, kept)
            self.saved = done


def _allreduce(
    comm: MPI.Comm, values: np.ndarray, out: np.ndarray, nap: bool, bell: GroupBell | None
) -> None:
    """A sum over the ranks that naps while it waits where ranks share cores; on
    ``bell`` (a ``GroupBell`` of ``comm``), which the rank rings at every member as it
    joins: the last to join wakes the others."""
    request = comm.Iallreduce(values, out, op=MPI.SUM)
    if bell is not None:
        bell.ring_all()
    wait_patiently(request.Test, nap=nap, bell=None if bell is None else bell.bell)
    if bell is not None:  # the sum's later rounds may wait for this rank's last messages
        bell.ring_all()


def _load(data, step: int, rows) -> tuple[object, str | None]:
    """The step's batch, or the one line that says what is wrong with the data (every
    rank learns of it at the step's flags, so none is left waiting)."""
    try:
        return data.batch(step, rows), None
    except UserError as e:
        return None, str(e)


@dataclass
class _Evaluation:
    """Evaluates every ``every`` steps and at the end, when there is evaluation data."""

    comm: MPI.Comm
    rt: Runtime
    data: FileData | None
    rows: dict
    every: int
    report: Callable[[EvalRecord], None] | None
    done: int = -1

    def maybe(self, step: int, force: bool = False) -> None:
        if (
            self.data is None
            or step == self.done
            or not (force or (self.every and step % self.every == 0))
        ):
            return
        record = evaluate(self.comm, self.rt, self.data, self.rows, step)
        self.done = step
        if self.report is not None and self.comm.Get_rank() == 0:
            self.report(record)


@dataclass
class _Stepper:
    """A working rank's steps: the step's flags (a signal, bad data) agreed over the
    working ranks, the step, and its loss summed over them."""

    crew: Crew
    rt: Runtime
    setup: _Setup
    options: RunOptions
    rows: dict
    nap: bool
    bell: GroupBell | None  # the working ranks', where ranks share cores
    stop: Callable[[], int] | None
    scaler: LossScaler | None = None  # fp16's loss scale (read here, updated by train)
    # [SIGINT seen, SIGTERM seen, bad data] summed over ranks: one tiny collective a step.
    flags: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))
    seen: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))
    # [loss, ranks whose gradients hold an infinity or NaN] summed over the ranks.
    total: np.ndarray = field(default_factory=lambda: np.zeros(2))

    def run(self, step: int, first: int) -> Note:
        steppers, rt, options = self.crew.steppers, self.rt, self.options
        batch, bad = _load(self.setup.data, step, self.rows)
        received = (self.stop() if self.stop is not None else 0) or self.crew.pleaded()
        self.flags[:] = (received == signal.SIGINT, received == signal.SIGTERM, bad is not None)
        _allreduce(steppers, self.flags, self.seen, self.nap, self.bell)
        if self.seen[2]:
            return Note(error=next(e for e in steppers.allgather(bad) if e))
        if self.seen[:2].any():
            return Note(interrupted=int(signal.SIGTERM if self.seen[1] else signal.SIGINT))
        if rt.tracer is not None:
            rt.tracer.begin_step(step + 1 - first)
        start = time.perf_counter()
        lr = options.lr * options.optimizer.lr_factor(step, options.steps)
        scale = None if self.scaler is None else self.scaler.scale
        if scale is None:
            partial, found = rt.step(batch, lr), 0.0
        else:  # the update waits for every rank's word on its gradients
            partial = rt.forward_backward(batch, grad_seed=scale)
            found = float(rt.nonfinite_gradients())
        if scale is None and rt.tracer is not None:
            rt.tracer.end_step()
        _allreduce(steppers, np.array([partial, found]), self.total, self.nap, self.bell)
        skipped = bool(self.total[1])
        if scale is not None:
            rt.update(lr, grad_scale=1.0 / scale, skip=skipped)
            if rt.tracer is not None:
                rt.tracer.end_step()
        took = time.perf_counter() - start
        rate = self.setup.plan.batch / took if took > 0 else None
        loss = float(self.total[0])
        return Note(record=StepRecord(step + 1, loss, took, lr, rate, scale, skipped))


def train(
    comm: MPI.Comm,
    options: RunOptions,
    on_step: Callable[[StepRecord], None] | None = None,
    gather: bool = False,
    stop: Callable[[], int] | None = None,
    on_start: Callable[[tuple[RankInfo, ...]], None] | None = None,
    on_eval: Callable[[EvalRecord], None] | None = None,
) -> RunResult:
    """``stop()`` gives the signal this rank received (0: none); the ranks agree on it at
    every step boundary and all stop there, the weights of the last step intact (and
    checkpointed when ``--checkpoint`` is given)."""
    rank = comm.Get_rank()
    _check_outputs(comm, options)
    keep_freed_memory()  # a step's temporaries reuse the last step's pages
    # The device and transport before the model: a wrong --device fails in a second.
    device = open_device(options.device, comm)
    nap = oversubscribed(comm)
    bell = Doorbell.open(comm) if nap else None  # ranks that share cores sleep on it
    if nap:
        nap_precisely()
    transport = make_transport(options.transport, comm, device, nap, bell, options.ranks_per_host)
    s = agreed_setup(comm, options)
    if options.save_model is not None:
        _agree_on(comm, lambda: check_saveable(s.model.path, s.model.graph, options.save_model))
    ranks = comm.allgather((MPI.Get_processor_name(), os.getpid()))
    if on_start is not None and rank == 0:
        on_start(tuple(RankInfo(r, host, pid) for r, (host, pid) in enumerate(ranks)))
    plan_sha = file_sha256(Path(options.plan))
    # Traced runs count what the rank allocates from here on (its shards, buffers, steps).
    tracer = Tracer(rank, s.pg, device) if options.trace is not None else None
    rt = agreed(comm, lambda: _runtime(s, options, rank, transport, device))
    program = rt.program
    rt.tracer = tracer
    # The rank keeps its shards only: the whole model's values are dropped.
    s = replace(s, model=replace(s.model, weights={}, state={}))
    scaler = _scaler(s.precision, options)  # on every rank: idle ones follow the records
    first = _resume(comm, rt, s, options, scaler) if options.resume is not None else 0
    identity = _identity(s, options)
    checkpoints = _Checkpoints(comm, rt, options, identity, plan_sha, scaler, saved=first)
    rows = rows_needed(s.pg, rank)
    evaluation = _Evaluation(comm, rt, s.eval_data, rows, options.eval_every, on_eval)
    crew = Crew.form(comm, bool(program.instructions))
    steppers_bell = None
    if bell is not None and crew.working:
        steppers_bell = GroupBell(
            bell, tuple(r for r in range(comm.Get_size()) if r not in crew.idle)
        )
    stepper = _Stepper(crew, rt, s, options, rows, nap, steppers_bell, stop, scaler)
    records, interrupted = [], 0
    try:
        for step in range(first, options.steps):
            if crew.working:
                note = stepper.run(step, first)
                crew.tell(note)
            else:
                note = crew.hear(stop)
                if rt.tracer is not None:  # an empty step: its memory is still measured
                    rt.tracer.begin_step(step + 1 - first)
                    rt.tracer.end_step()
            if note.error is not None:
                raise UserError(note.error)
            if note.interrupted:
                interrupted = note.interrupted
                break
            records.append(note.record)
            if scaler is not None:
                scaler.update(note.record.skipped)
            if on_step is not None and rank == 0:
                on_step(note.record)
            checkpoints.maybe(step + 1)
            evaluation.maybe(step + 1)
            if step == first:  # what the run keeps exists now (see settle_python_heap)
                settle_python_heap()
    finally:
        release_python_heap()
    crew.close()
    if not interrupted:
        evaluation.maybe(first + len(records), force=True)
    checkpoints.maybe(first + len(records), force=True)
    if rt.tracer is not None:
        gathered = comm.gather((rt.tracer.events, rt.tracer.peak_bytes), root=0)
        if rank == 0:
            write_measured(options.trace, gathered, options.plan, plan_sha)
    counts = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([transport.bytes_sent], dtype=np.int64), counts)
    if options.save_weights:
        save_weights(comm, rt, options.save_weights)
    if options.save_model:
        save_model(comm, rt, s.model.path, options.save_model)
    weights = gather_weights(comm, rt, s.model.graph) if gather else None
    sent = tuple(int(c) for c in counts)
    transport.close()
    if bell is not None:
        bell.close()
    peaks = tuple(comm.allgather(peak_rss_bytes()))
    return RunResult(tuple(records), sent, weights, interrupted, first, peaks)
