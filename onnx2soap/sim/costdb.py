"""The cost database: kernel times measured by ``onnx2soap profile``, in SQLite.

One file (by default next to the machine file: ``host.yaml`` -> ``host.costs.sqlite``)
holds timings under a device *fingerprint*: what makes a measurement valid elsewhere
(device kind, processor or GPU name, library versions, BLAS threads per rank, float
dtype). A reader asks for the fingerprint of the host it runs on; timings taken under
another one are never used silently (``Fingerprint.differences`` says what differs).

A timing's key is what makes two kernel calls identical (``cost_key``): op type,
attributes, the task's input buffer shapes and output shape; with its phase (forward,
backward, or the SGD update of ``numel`` elements). Tasks of different ops, configs or
models that share a key share one measurement.

Next to the isolated timings, *in-step* times (``InStep``): what the same tasks took
inside the executor's own step (``onnx2soap profile`` runs the one-device plan with the
executor's tracer after timing the kernels). ``ProfiledCost`` fits the step's per-phase
scale and per-instruction overhead from the pairs. The table is optional (a database
written before it existed has no calibration; the profile adds it).

This module reads (planning opens the file read-only); ``onnx2soap/measure/cost_writer.py``
makes and fills it. Both follow the format defined here (``FORMAT``, ``VERSION``, the
tables below, ``IN_STEP_METHOD``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import sqlite3
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import TypeVar

from onnx2soap.device_kind import DeviceKind  # one enum: the executor's --device too
from onnx2soap.errors import UserError
from onnx2soap.ir import Op
from onnx2soap.soap.partition import Task, rect_shape

FORMAT = "onnx2soap.costs"
VERSION = 1
# How the in-step times were taken. 1 (no meta row): a statistics op's three
# instructions were averaged, so its task counted a third of its time. 2: the tasks
# were scaled to the median traced step, the tracer's own time per instruction in it.
# In-step times made another way than this onnx2soap's are refused on reading and redone
# by a profile.
IN_STEP_METHOD = "3"
SUFFIX = ".costs.sqlite"

_Opened = TypeVar("_Opened", bound="CostDB")  # a reader, or measure's writer

IN_STEP_SCHEMA = """
CREATE TABLE IF NOT EXISTS in_step (
    fingerprint INTEGER NOT NULL REFERENCES fingerprints(id),
    phase TEXT NOT NULL,
    key TEXT NOT NULL,
    seconds REAL NOT NULL,
    PRIMARY KEY (fingerprint, phase, key)
);
"""

SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS fingerprints (id INTEGER PRIMARY KEY, doc TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS timings (
    fingerprint INTEGER NOT NULL REFERENCES fingerprints(id),
    phase TEXT NOT NULL,
    key TEXT NOT NULL,
    op_type TEXT NOT NULL,
    flops REAL NOT NULL,
    bytes REAL NOT NULL,
    seconds REAL NOT NULL,
    ranks INTEGER NOT NULL,
    PRIMARY KEY (fingerprint, phase, key)
);
"""
    + IN_STEP_SCHEMA
)


class Phase(Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"  # SGD on a weight shard: key names its element count


@dataclass(frozen=True)
class Fingerprint:
    """Where timings were taken. Two hosts with equal fingerprints time kernels alike."""

    kind: DeviceKind
    processor: str  # the CPU model, or the GPU's name under CUDA
    libraries: tuple[tuple[str, str], ...]  # (name, version), sorted
    threads: int  # BLAS threads per rank
    dtype: str  # the run's float dtype

    def to_json(self) -> str:
        doc = asdict(self)
        doc["kind"] = self.kind.value
        doc["libraries"] = dict(self.libraries)
        return json.dumps(doc, sort_keys=True)

    @staticmethod
    def from_json(text: str, source: str) -> Fingerprint:
        try:
            doc = json.loads(text)
            return Fingerprint(
                DeviceKind(doc["kind"]),
                str(doc["processor"]),
                tuple(sorted((str(k), str(v)) for k, v in doc["libraries"].items())),
                int(doc["threads"]),
                str(doc["dtype"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{source}: fingerprints: a malformed fingerprint ({e})") from e

    def differences(self, other: Fingerprint) -> list[str]:
        """What differs, as ``field: here vs there`` phrases (``self`` is here)."""
        out = []
        for name in ("kind", "processor", "threads", "dtype"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name} {_shown(a)} vs {_shown(b)}")
        mine, theirs = dict(self.libraries), dict(other.libraries)
        for lib in sorted(set(mine) | set(theirs)):
            if mine.get(lib) != theirs.get(lib):
                out.append(f"{lib} {mine.get(lib, 'absent')} vs {theirs.get(lib, 'absent')}")
        return out

    def describe(self) -> str:
        libs = ", ".join(f"{k} {v}" for k, v in self.libraries)
        threads = f"{self.threads} thread{'s' * (self.threads != 1)}"
        return f"{self.kind.value} {self.processor!r}, {libs}, {threads}, {self.dtype}"


def _shown(v) -> str:
    return v.value if isinstance(v, Enum) else repr(v) if isinstance(v, str) else str(v)


def _cpu_name() -> str:
    with (
        contextlib.suppress(OSError),
        open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f,
    ):
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def _blas() -> tuple[str, str]:
    import numpy as np

    try:
        info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return str(info.get("name", "blas")), str(info.get("version", "unknown"))
    except Exception:  # an older numpy without the dict mode: its version says enough
        return "blas", "unknown"


def blas_threads() -> int:
    """BLAS threads per rank as the executor and the profile run them (one by default)."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        value = os.environ.get(var, "")
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    return 1


def host_fingerprint(kind: DeviceKind, dtype: str, threads: int | None = None) -> Fingerprint:
    """This host's fingerprint for ``kind``. CUDA needs CuPy and a GPU (device 0's name);
    a ``UserError`` says which is missing."""
    import numpy as np

    blas = _blas()
    libs = {"numpy": np.__version__, blas[0]: blas[1]}
    processor = _cpu_name()
    if kind is DeviceKind.CUDA:
        try:
            import cupy

            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        except Exception as e:  # no cupy, no driver, no device
            raise UserError(f"no CUDA device to fingerprint ({type(e).__name__}: {e})") from e
        name = props["name"]
        processor = name.decode() if isinstance(name, bytes) else str(name)
        libs["cupy"] = cupy.__version__
        libs["cuda-runtime"] = str(cupy.cuda.runtime.runtimeGetVersion())
    threads = blas_threads() if threads is None else threads
    return Fingerprint(kind, processor, tuple(sorted(libs.items())), threads, dtype)


# --- keys ------------------------------------------------------------------------------------


def cost_key(op: Op, task: Task) -> str:
    """What makes two tasks' kernel calls identical: op type, attributes (their repr: a
    frozen dataclass of plain values), input buffer shapes (padding included), output
    tile shape; and where the op's work depends on where the task lies (a causal
    attention: ``LoopNest.causal``), the points that do work, so that a task of the
    sequence's first queries is not priced as one of its last (the profiler runs each
    at its own origin)."""
    shapes = ",".join("x".join(map(str, rect_shape(r.buffer))) for r in task.inputs)
    out = "x".join(map(str, rect_shape(task.output)))
    key = f"{op.type} {op.attrs!r} in=[{shapes}] out=[{out}]"
    if op.nest.causal is not None:
        key += f" work={op.nest.work_points(task.box)}"
    return key


def update_key(numel: int) -> str:
    return f"SGD numel={numel}"


# --- the file --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    phase: Phase
    key: str
    op_type: str
    flops: float  # what the roofline counts for the task, for fitting unmeasured keys
    nbytes: float
    seconds: float  # median of the repeats
    ranks: int = 1  # ranks timing at once


@dataclass(frozen=True)
class InStep:
    """A task's seconds inside the executor's step (median over traced steps, mean over
    the ranks calibrating at once), keyed as its ``Timing``."""

    phase: Phase
    key: str
    seconds: float


def db_path_for(machine_file: Path | str) -> Path:
    """``host.yaml`` -> ``host.costs.sqlite`` in the same folder."""
    path = Path(machine_file)
    return path.with_name(path.stem + SUFFIX)


class CostDB:
    """An open cost database, read-only. ``CostDB.open`` checks it is one (format and
    version); a profile writes through ``measure.cost_writer.CostWriter``."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self.conn, self.path = conn, path
        self.in_step_method = IN_STEP_METHOD

    @classmethod
    def open(cls, path: Path | str) -> CostDB:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: no such cost database")
        try:  # read-only: planning never changes the file
            conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
            db = cls(conn, path)
            db.check()
        except sqlite3.Error as e:
            raise UserError(f"{path}: not a cost database ({e})") from e
        return db

    def check(self) -> None:
        """A ``UserError`` unless the file holds this format's tables and version; notes
        the method its in-step times were taken by."""
        names = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master")}
        if not {"meta", "fingerprints", "timings"} <= names:
            raise UserError(f"{self.path}: not a cost database (tables missing)")
        meta = dict(self.conn.execute("SELECT name, value FROM meta"))
        if meta.get("format") != FORMAT:
            raise UserError(f"{self.path}: meta.format: expected {FORMAT!r}")
        if meta.get("version") != str(VERSION):
            raise UserError(
                f"{self.path}: meta.version: {meta.get('version')!r}; this onnx2soap reads "
                f"version {VERSION}"
            )
        self.in_step_method = meta.get("in_step_method", "1")

    def close(self) -> None:
        self.conn.close()

    def __enter__(self: _Opened) -> _Opened:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fingerprints(self) -> dict[int, Fingerprint]:
        rows = self.conn.execute("SELECT id, doc FROM fingerprints ORDER BY id")
        return {i: Fingerprint.from_json(doc, str(self.path)) for i, doc in rows}

    def find(self, fp: Fingerprint) -> int | None:
        """The id of ``fp``'s timings, compared field by field (not as text)."""
        return next((i for i, f in self.fingerprints().items() if f == fp), None)

    def keys(self, fp_id: int) -> set[tuple[Phase, str]]:
        rows = self.conn.execute("SELECT phase, key FROM timings WHERE fingerprint = ?", (fp_id,))
        return {(Phase(p), k) for p, k in rows}

    def timings(self, fp_id: int) -> tuple[Timing, ...]:
        rows = self.conn.execute(
            "SELECT phase, key, op_type, flops, bytes, seconds, ranks FROM timings "
            "WHERE fingerprint = ? ORDER BY phase, key",
            (fp_id,),
        )
        out = []
        for phase, key, op_type, flops, nbytes, seconds, ranks in rows:
            try:
                timing = Timing(Phase(phase), str(key), str(op_type), flops, nbytes, seconds, ranks)
            except ValueError as e:
                raise UserError(f"{self.path}: timings.phase: {phase!r} is no phase") from e
            for name in ("flops", "nbytes", "seconds"):
                value = getattr(timing, name)
                if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                    raise UserError(f"{self.path}: timings.{name} of {key!r}: {value!r}")
            out.append(timing)
        return tuple(out)

    def in_step(self, fp_id: int) -> tuple[InStep, ...]:
        """The in-step times under ``fp_id``; none in a database without the table. Times
        taken by an older method are refused (a ``UserError``): a profile redoes them."""
        names = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master")}
        if "in_step" not in names:
            return ()
        rows = self.conn.execute(
            "SELECT phase, key, seconds FROM in_step WHERE fingerprint = ? ORDER BY phase, key",
            (fp_id,),
        ).fetchall()
        if rows and self.in_step_method != IN_STEP_METHOD:
            raise UserError(
                f"{self.path}: meta.in_step_method: {self.in_step_method!r}, its in-step "
                f"calibration was taken by an older onnx2soap (this one reads "
                f"{IN_STEP_METHOD!r}); run onnx2soap profile again: it keeps the timings "
                "and redoes the calibration"
            )
        out = []
        for phase, key, seconds in rows:
            try:
                point = InStep(Phase(phase), str(key), seconds)
            except ValueError as e:
                raise UserError(f"{self.path}: in_step.phase: {phase!r} is no phase") from e
            if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
                raise UserError(f"{self.path}: in_step.seconds of {key!r}: {seconds!r}")
            out.append(point)
        return tuple(out)
