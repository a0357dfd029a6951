"""``ProfiledCost``: task times measured by ``onnx2soap profile``, a fitted roofline elsewhere.

A task whose kernel call was timed (same ``cost_key``: op type, attributes, buffer and
output shapes) costs exactly its measured median. Any other task costs what a roofline
fitted to the measurements predicts:

    seconds = overhead + FLOPs / (e_flops · peak) + bytes / (e_bytes · bandwidth)

with the achieved fractions ``e`` and the per-task overhead fitted by least squares (in
relative error, so microsecond tasks count as much as long ones), per op type where the
database has enough timings of it, else per phase over all ops. The terms add rather than
take the larger: measured CPU kernels are neither purely compute- nor memory-bound, and
an additive fit is linear. On a device other than the profiled one (a preset GPU) the
fractions are applied to that device's own peaks and its own overhead, and no measured
time is used.

On the profiled device, both are then taken into the executor's step by the in-step
calibration: per phase, ``in_step = scale · isolated + overhead``, fitted by least
squares over the tasks whose time inside the executor's own step ``onnx2soap profile``
measured (``InStep``). A kernel inside a step reads inputs that are not in cache and
writes fresh outputs (the scale), and each instruction costs the runtime its dispatch
and its arguments (the overhead). The copies that assemble a task's inputs are in its
in-step time too, and are taken out: the simulator costs them as tasks of their own.
The fit is the planned model's own (``ProfiledCost.for_graph``) where the database has
calibrated that model: one curve over several models' tasks misjudges each of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from onnx2soap.errors import UserError
from onnx2soap.ir import Graph, Op
from onnx2soap.sim.calibration_plan import calibration_keys, calibration_plan, one_device_keys
from onnx2soap.sim.costdb import (
    CostDB,
    Fingerprint,
    InStep,
    Phase,
    Timing,
    cost_key,
    update_key,
)
from onnx2soap.sim.costs import RooflineCost, task_bytes, task_flops
from onnx2soap.sim.machine import ComputeDevice, Machine
from onnx2soap.soap.partition import Task

MIN_POINTS = 4  # timings of one op type below which its fit falls back to the phase's
DTYPE_ITEMSIZE = {"float32": 4, "float64": 8}


@dataclass(frozen=True)
class Fit:
    """seconds = overhead + flops · per_flop + nbytes · per_byte, on the reference device."""

    overhead: float
    per_flop: float
    per_byte: float

    def seconds(self, flops: float, nbytes: float) -> float:
        return self.overhead + flops * self.per_flop + nbytes * self.per_byte

    def efficiency(self, device: ComputeDevice) -> tuple[float, float]:
        """Achieved fractions of ``device``'s peak FLOP/s and memory bandwidth (inf where
        the fit found the term free)."""
        flops = 1 / (self.per_flop * device.peak_flops) if self.per_flop > 0 else np.inf
        nbytes = 1 / (self.per_byte * device.memory_bandwidth) if self.per_byte > 0 else np.inf
        return float(flops), float(nbytes)

    def moved_to(self, reference: ComputeDevice, device: ComputeDevice) -> Fit:
        """The same efficiencies on another device's peaks, with its own overhead."""
        return Fit(
            device.kernel_overhead,
            self.per_flop * reference.peak_flops / device.peak_flops,
            self.per_byte * reference.memory_bandwidth / device.memory_bandwidth,
        )


def fit(timings: Sequence[Timing]) -> Fit | None:
    """Nonnegative least squares in relative error over (1, flops, bytes): the best of the
    column subsets whose unconstrained solution is nonnegative (three columns: seven
    subsets, cheaper and clearer than an NNLS solver). None without enough timings."""
    if len(timings) < 2:
        return None
    t = np.array([x.seconds for x in timings], dtype=np.float64)
    t = np.maximum(t, 1e-9)
    a = np.array([[1.0, x.flops, x.nbytes] for x in timings], dtype=np.float64) / t[:, None]
    b = np.ones_like(t)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns of unlike units
    best: tuple[float, np.ndarray] | None = None
    for size in (1, 2, 3):
        for cols in itertools.combinations(range(3), size):
            sub = a[:, cols] / scale[list(cols)]
            coef, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(coef < 0):
                continue
            residual = float(np.sum((sub @ coef - b) ** 2))
            full = np.zeros(3)
            full[list(cols)] = coef / scale[list(cols)]
            if best is None or residual < best[0] - 1e-12:
                best = (residual, full)
    if best is None:
        return None
    overhead, per_flop, per_byte = (float(v) for v in best[1])
    return Fit(overhead, per_flop, per_byte)


@dataclass(frozen=True)
class Calibration:
    """Seconds in the executor's step of a task that takes ``isolated`` alone."""

    scale: float = 1.0
    overhead: float = 0.0

    def seconds(self, isolated: float) -> float:
        return self.scale * isolated + self.overhead


IDENTITY = Calibration()


def calibrate(pairs: Sequence[tuple[float, float]]) -> Calibration:
    """Least squares of in-step over isolated seconds, ``(isolated, in_step)`` pairs, in
    absolute error: the residuals sum to zero, so the calibration plan's compute total
    (what a step is the sum of) is reproduced. Relative error was tried and rejected:
    on resnet18 the many microsecond tasks (ratios 10-40, all overhead) pulled the scale
    to 0.6 while every large kernel ran 1.1-1.3x its isolated time in the step. A
    negative overhead is dropped for a fit through the origin; the identity without two
    pairs of distinct isolated times."""
    if len(pairs) < 2:
        return IDENTITY
    x = np.array([p[0] for p in pairs], dtype=np.float64)
    y = np.array([p[1] for p in pairs], dtype=np.float64)
    if np.ptp(x) <= 0:
        return IDENTITY
    scale, overhead = np.polyfit(x, y, 1)
    if overhead < 0:
        scale, overhead = float(x @ y / (x @ x)), 0.0
    if scale <= 0:
        return IDENTITY
    return Calibration(float(scale), float(overhead))


def calibrations(
    timings: Sequence[Timing],
    points: Sequence[InStep],
    graph: Graph | None = None,
    machine: Machine | None = None,
    itemsize: int = 4,
) -> dict[Phase, Calibration]:
    """Per phase, the calibration of the isolated timings that have an in-step time;
    of ``graph``'s own tasks only where they have theirs, less the copies ``machine``
    costs apart (``ProfiledCost.for_graph``)."""
    isolated = {(x.phase, x.key): x.seconds for x in timings}
    return _calibrations(isolated, points, graph, machine, itemsize)


def _calibrations(
    isolated: dict[tuple[Phase, str], float],
    points: Sequence[InStep],
    graph: Graph | None,
    machine: Machine | None,
    itemsize: int,
) -> dict[Phase, Calibration]:
    copies: dict[tuple[Phase, str], float] = {}
    if graph is not None and _covered(keys := one_device_keys(graph), points):
        points = [p for p in points if (p.phase, p.key) in keys]
        if machine is not None:
            copies = one_device_copies(graph, machine, itemsize)
    pairs: dict[Phase, list[tuple[float, float]]] = {}
    for p in points:
        seconds = isolated.get((p.phase, p.key))
        if seconds is not None:
            in_step = max(p.seconds - copies.get((p.phase, p.key), 0.0), 0.0)
            pairs.setdefault(p.phase, []).append((seconds, in_step))
    return {phase: calibrate(v) for phase, v in pairs.items()}


def calibrated(graph: Graph, points: Sequence[InStep]) -> bool:
    """Whether ``points`` calibrate ``graph``: every forward task of its one-device plan,
    at the graph's batch, has its in-step time (``onnx2soap profile`` of the model at
    that batch records them)."""
    return _covered(one_device_keys(graph), points)


def _covered(keys: frozenset[tuple[Phase, str]], points: Sequence[InStep]) -> bool:
    """Every forward key of ``keys`` has its in-step time among ``points``."""
    have = {(p.phase, p.key) for p in points}
    return {k for k in keys if k[0] is Phase.FORWARD} <= have


def one_device_copies(
    graph: Graph, machine: Machine, itemsize: int
) -> dict[tuple[Phase, str], float]:
    """Per cost key of ``graph``'s one-device plan (the calibration's), the seconds of
    the copies that the simulator on ``machine`` puts before its tasks: assembling a
    task's inputs (a padded buffer, pieces) and summing its output gradient (several
    readers). In the executor each is part of the task's own instruction, so the task's
    in-step time holds it; the simulator adds it as a task of its own, and the cnn's
    one-device step was predicted 0.67 ms (4 %) too long for counting it twice. The mean
    over the tasks of a key, as the in-step times are."""
    from onnx2soap.sim.taskgraph import TaskKind, build_task_graph

    pg = calibration_plan(graph)
    tg = build_task_graph(pg, machine, RooflineCost(), itemsize, names=True)
    traced = calibration_keys(graph, pg)
    copied: dict[str, float] = {}
    for i, name in enumerate(tg.names):
        task = traced.get(name)
        if task is None:
            continue
        for j in tg.pred_idx[tg.pred_ptr[i] : tg.pred_ptr[i + 1]]:
            if tg.kind[j] == TaskKind.TRANSFER and tg.names[j].startswith("copy "):
                copied[task.task] = copied.get(task.task, 0.0) + float(tg.duration[j])
    tasks_of: dict[tuple[Phase, str], set[str]] = {}
    for t in traced.values():
        tasks_of.setdefault(t.key, set()).add(t.task)
    return {
        key: sum(copied.get(t, 0.0) for t in tasks) / len(tasks)
        for key, tasks in tasks_of.items()
        if any(t in copied for t in tasks)
    }


@dataclass(frozen=True)
class _Fits:
    by_type: dict[tuple[Phase, str], Fit]
    by_phase: dict[Phase, Fit]

    @staticmethod
    def of(timings: Sequence[Timing]) -> _Fits:
        groups: dict[tuple[Phase, str], list[Timing]] = {}
        for x in timings:
            groups.setdefault((x.phase, x.op_type), []).append(x)
        by_type = {
            k: f for k, v in groups.items() if len(v) >= MIN_POINTS and (f := fit(v)) is not None
        }
        by_phase = {}
        for phase in Phase:
            f = fit([x for x in timings if x.phase is phase])
            if f is not None:
                by_phase[phase] = f
        return _Fits(by_type, by_phase)

    def get(self, phase: Phase, op_type: str) -> Fit | None:
        return self.by_type.get((phase, op_type)) or self.by_phase.get(phase)


@dataclass(frozen=True)
class ProfiledCost:
    """A ``CostModel``: measured seconds where the key was timed on ``reference`` (the
    profiled machine's device), a fitted roofline elsewhere, ``RooflineCost`` where the
    database has nothing to fit."""

    timings: dict[tuple[Phase, str], float]
    fits: _Fits
    reference: ComputeDevice
    itemsize: int  # the float width the timings were taken at
    source: str = ""  # where the timings came from, for messages
    # Per phase: isolated seconds -> seconds in the executor's step, on the profiled
    # device only (a phase without one: as measured).
    calibration: dict[Phase, Calibration] = field(default_factory=dict)
    in_step: tuple[InStep, ...] = ()  # what the calibration was fitted to
    _keys: dict[int, tuple[Op, dict[tuple, str]]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @staticmethod
    def from_timings(
        timings: Sequence[Timing],
        reference: ComputeDevice,
        itemsize: int,
        source: str = "",
        in_step: Sequence[InStep] = (),
    ) -> ProfiledCost:
        table = {(x.phase, x.key): x.seconds for x in timings}
        fitted = calibrations(timings, in_step)
        return ProfiledCost(
            table, _Fits.of(timings), reference, itemsize, source, fitted, tuple(in_step)
        )

    def for_graph(self, graph: Graph, machine: Machine | None = None) -> ProfiledCost:
        """These costs, taken into the step by ``graph``'s own calibration where the
        database has one (every forward task of its one-device plan has its in-step
        time, as a profile of it records), fitted to its tasks alone. Calibrated with
        other models' tasks beside its own, GPT-2's one-device step was predicted at
        6.7 ms against 4.8 ms from its own, measured 4.7-5.2 ms: a single curve over
        resnet18's convolutions and GPT-2's small matmuls fits neither. The copies the
        simulator on ``machine`` costs as tasks of their own are taken out of the tasks'
        in-step times (``one_device_copies``). Unchanged where ``graph`` was not
        calibrated."""
        fitted = _calibrations(self.timings, self.in_step, graph, machine, self.itemsize)
        return replace(self, calibration=fitted)

    @staticmethod
    def load(path: Path | str, fingerprint: Fingerprint, reference: ComputeDevice) -> ProfiledCost:
        """The timings ``path`` holds under ``fingerprint``. A ``UserError`` names what
        differs if it holds none: another device's timings are never used silently."""
        with CostDB.open(path) as db:
            fp_id = db.find(fingerprint)
            if fp_id is None:
                raise FingerprintMismatch(path, fingerprint, list(db.fingerprints().values()))
            timings, in_step = db.timings(fp_id), db.in_step(fp_id)
        itemsize = DTYPE_ITEMSIZE.get(fingerprint.dtype, 4)
        return ProfiledCost.from_timings(timings, reference, itemsize, str(path), in_step)

    @property
    def measured(self) -> int:
        return len(self.timings)

    # -- the CostModel protocol ------------------------------------------------------------

    def forward(self, op: Op, task: Task, device: ComputeDevice, itemsize: int) -> float:
        return self._task(Phase.FORWARD, op, task, device, itemsize)

    def backward(self, op: Op, task: Task, device: ComputeDevice, itemsize: int) -> float:
        return self._task(Phase.BACKWARD, op, task, device, itemsize)

    def update(self, numel: int, device: ComputeDevice, itemsize: int) -> float:
        here = self._here(device, itemsize)
        if here:
            seconds = self.timings.get((Phase.UPDATE, update_key(numel)))
            if seconds is not None:
                return self._in_step(Phase.UPDATE, seconds)
        # SGD reads the weight and its gradient and writes the weight (as RooflineCost).
        fitted = self._fitted(Phase.UPDATE, "SGD", 2 * numel, 3 * numel * itemsize, device)
        if fitted is None:
            return RooflineCost().update(numel, device, itemsize)
        return self._in_step(Phase.UPDATE, fitted) if here else fitted

    # -- inside ----------------------------------------------------------------------------

    def _here(self, device: ComputeDevice, itemsize: int) -> bool:
        return _same_kind(device, self.reference) and itemsize == self.itemsize

    def _key(self, op: Op, task: Task) -> str:
        # The search asks for the same tasks again and again; a key costs a repr.
        held = self._keys.get(id(op))
        if held is None or held[0] is not op:
            held = self._keys[id(op)] = (op, {})
        keys = held[1]
        ident = (task.output, tuple(r.buffer for r in task.inputs))
        key = keys.get(ident)
        if key is None:
            key = keys[ident] = cost_key(op, task)
        return key

    def _in_step(self, phase: Phase, isolated: float) -> float:
        return self.calibration.get(phase, IDENTITY).seconds(isolated)

    def _task(self, phase: Phase, op: Op, task: Task, device, itemsize: int) -> float:
        here = self._here(device, itemsize)
        if here:
            seconds = self.timings.get((phase, self._key(op, task)))
            if seconds is not None:
                return self._in_step(phase, seconds)
        flops, nbytes = task_flops(op, task), task_bytes(task, itemsize)
        if phase is Phase.BACKWARD:  # counted as RooflineCost counts it, like the timings
            flops, nbytes = flops * 2, nbytes * 2
        fitted = self._fitted(phase, op.type, flops, nbytes, device)
        if fitted is not None:  # a fit of isolated timings: into the step like them
            return self._in_step(phase, fitted) if here else fitted
        roofline = RooflineCost()
        method = roofline.forward if phase is Phase.FORWARD else roofline.backward
        return method(op, task, device, itemsize)

    def _fitted(self, phase: Phase, op_type: str, flops, nbytes, device) -> float | None:
        f = self.fits.get(phase, op_type)
        if f is None:
            return None
        if not _same_kind(device, self.reference):
            f = f.moved_to(self.reference, device)
        return f.seconds(flops, nbytes)


def _same_kind(a: ComputeDevice, b: ComputeDevice) -> bool:
    """The same device but for its name (a machine names its ranks rank0, rank1, ...)."""
    return (a.peak_flops, a.memory_bandwidth, a.kernel_overhead) == (
        b.peak_flops,
        b.memory_bandwidth,
        b.kernel_overhead,
    )


class FingerprintMismatch(UserError):
    """A cost DB without timings for this host's fingerprint: bad input the user acts on
    (profile this host, or plan with the roofline), so one line and exit code 2."""

    def __init__(self, path, here: Fingerprint, there: list[Fingerprint]) -> None:
        self.here, self.there = here, there
        if not there:
            why = "it holds no timings"
        else:
            closest = min(there, key=lambda f: len(here.differences(f)))
            why = "measured on another device: " + "; ".join(here.differences(closest))
        super().__init__(
            f"{path}: {why} (this host vs the database); run onnx2soap profile here, "
            "or pass --costs roofline"
        )
