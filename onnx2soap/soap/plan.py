"""The plan file: the only contract between planning and running.

    {"format": "onnx2soap.plan", "version": 1,
     "model": {"path": str, "sha256": str, "batch": int}, "loss": str, "devices": int,
     "machine": str | null, "precision": "fp32" | "bf16" | "fp16" (absent: fp32),
     "zero_stage": 1 | 2 | 3 (absent: no ZeRO; soap/zero.py),
     "zero_stages": {weight name: 0 | 1 | 2 | 3} (absent: every weight at zero_stage;
                    named weights at their own stage, as FSDP wraps some layers),
     "pipeline": {"schedule": "1f1b" | "gpipe", "microbatches": int,
                  "stages": [[op name]]} (absent: no pipeline; soap/pipeline.py),
     "recompute": [op name] (absent: none; ops whose activations the backward recomputes),
     "bucket_mb": float > 0 (absent: 25; gradient buckets' MiB, soap/buckets.py),
     "ops": [{"name": str, "degrees": {dim: int}, "devices": [int]}],
     "predicted": {...} | null, "search": {...} | null}

The model path (and a machine file's) is stored relative to the plan file's folder.
Loading checks every field and names the bad one; writing is atomic (a temporary file
renamed over the target). The file holds nothing that depends on the clock, so the same
search from the same seed writes the same bytes (timings go to ``--json`` and the log).

Limits (a hostile or corrupted file is one clean error, never a RecursionError, a hang
or an allocation the size of the universe): the file is at most ``MAX_PLAN_BYTES``,
JSON nests at most ``MAX_JSON_DEPTH`` deep, numbers have at most ``MAX_NUMBER_CHARS``
characters and are finite, the batch is at most ``MAX_BATCH`` and the device count at
most ``MAX_DEVICES``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from onnx2soap.errors import PlanError
from onnx2soap.files import write_atomic
from onnx2soap.ir import Graph, LossKind
from onnx2soap.precision import Precision
from onnx2soap.soap.buckets import DEFAULT_BUCKET_MB, check_bucket_mb
from onnx2soap.soap.dims import SoapDim
from onnx2soap.soap.partition import ParallelConfig
from onnx2soap.soap.pipeline import SCHEDULES, Pipeline, Schedule, check_pipeline_plan
from onnx2soap.soap.strategy import Strategy, validate
from onnx2soap.soap.zero import ZERO_STAGES, Zero, ZeroStage

FORMAT = "onnx2soap.plan"
VERSION = 1

MAX_BATCH = 2**31 - 1  # an int32 sample index everywhere downstream
# The simulator's machines hold a route per device pair: time and memory grow with the
# square of the device count (1024 devices build in about a second).
MAX_DEVICES = 1024
MAX_PLAN_BYTES = 64 << 20
MAX_JSON_DEPTH = 32  # a plan nests 4 deep; the C parser recurses without a limit
MAX_NUMBER_CHARS = 40  # int64 has 19 digits, a float's repr at most 24 characters
MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class OpPlan:
    name: str
    degrees: tuple[tuple[str, int], ...]  # written: dims split with degree > 1
    devices: tuple[int, ...]
    copies: int = 1  # each box computed this often (a weight-only op); written when > 1


@dataclass(frozen=True)
class Predicted:
    """What the simulator predicts for the plan (filled by ``plan`` with a machine)."""

    step_time_s: float
    peak_memory_bytes: tuple[int, ...]
    bytes_moved: int
    baselines: tuple[tuple[str, float], ...] = ()
    infeasible: tuple[str, ...] = ()  # baselines that do not fit in device memory


@dataclass(frozen=True)
class SearchInfo:
    method: str
    seed: int
    budget_s: float
    evaluated: int


@dataclass(frozen=True)
class Plan:
    model_path: Path
    model_sha256: str
    batch: int
    loss: LossKind
    devices: int
    ops: tuple[OpPlan, ...]
    machine: str | None = None
    predicted: Predicted | None = None
    search: SearchInfo | None = None
    precision: Precision = Precision.FP32
    zero_stage: ZeroStage = ZeroStage.NONE  # written only when set: older plans read alike
    pipeline: Pipeline | None = None  # likewise
    recompute: tuple[str, ...] = ()  # likewise
    bucket_mb: float = DEFAULT_BUCKET_MB  # gradient buckets (soap/buckets.py); likewise
    zero_weights: tuple[tuple[str, ZeroStage], ...] = ()  # stages by weight; likewise

    @property
    def zero(self) -> Zero:
        """Every weight's ZeRO stage: ``zero_stage`` but where ``zero_weights`` names it."""
        return Zero(self.zero_stage, self.zero_weights)

    @property
    def graph_batch(self) -> int:
        """The batch of the graph the ops are split on: a microbatch's under a pipeline,
        the step's otherwise (load the model at this batch)."""
        return self.pipeline.microbatch_size(self.batch) if self.pipeline else self.batch

    def strategy(self, graph: Graph, space: Mapping[str, tuple[SoapDim, ...]]) -> Strategy:
        """The plan as a validated ``Strategy`` for ``graph``, the model at
        ``graph_batch`` (errors name the op)."""
        if graph.batch != self.graph_batch:
            raise PlanError(
                f"the plan splits the model at batch {self.graph_batch}, got a graph at "
                f"batch {graph.batch}"
            )
        for i, name in enumerate(self.recompute):
            if name not in space:
                raise PlanError(f"recompute[{i}]: '{name}' is not an op of the model")
        trainable = {t.name for t in graph.weights}
        for name, _ in self.zero_weights:
            if name not in trainable:
                raise PlanError(f"zero_stages.{name[:60]}: not a trainable weight of the model")
        configs = {}
        for op in self.ops:
            if op.name not in space:
                raise PlanError(f"ops: '{op.name}' is not an op of the model")
            dims = space[op.name]
            names = [d.name for d in dims]
            for dim, _ in op.degrees:
                if dim not in names:
                    raise PlanError(f"op '{op.name}': degrees.{dim}: no such dim; dims: {names}")
            given = dict(op.degrees)
            degrees = tuple(given.get(n, 1) for n in names)
            configs[op.name] = ParallelConfig(degrees, op.devices, op.copies)
        strategy = Strategy(self.devices, configs)
        validate(graph, space, strategy)
        if self.pipeline:
            check_pipeline_plan(self.pipeline, graph, configs, self.devices)
        return strategy


def import_loss(plan: Plan) -> LossKind | None:
    """The ``loss`` argument of ``load_model`` that rebuilds the graph the plan was made
    for: the model's own loss, or the attached one. A plan always has a loss."""
    if plan.loss is LossKind.NONE:
        raise PlanError(f"{plan.model_path}: the plan has no loss (loss 'none'); nothing to train")
    return None if plan.loss is LossKind.MODEL else plan.loss


def plan_ops(
    strategy: Strategy, graph: Graph, space: Mapping[str, tuple[SoapDim, ...]]
) -> tuple[OpPlan, ...]:
    out = []
    for op in graph.ops:
        config = strategy[op.name]
        degrees = tuple(
            (d.name, deg) for d, deg in zip(space[op.name], config.degrees, strict=True) if deg > 1
        )
        out.append(OpPlan(op.name, degrees, config.devices, config.copies))
    return tuple(out)


# --- JSON -----------------------------------------------------------------------------------


def _is_machine_file(spec: str) -> bool:
    """A machine file rather than a preset name (``flexflow-p100:4``)."""
    return Path(spec).suffix in (".yaml", ".yml") or "/" in spec


def _relative_machine(spec: str | None, plan_dir: Path) -> str | None:
    """Machine files are stored relative to the plan's folder, like the model."""
    if spec is None or not _is_machine_file(spec):
        return spec
    return os.path.relpath(Path(spec).resolve(), plan_dir.resolve())


def _resolved_machine(spec: str | None, plan_dir: Path) -> str | None:
    if spec is None or not _is_machine_file(spec) or Path(spec).is_absolute():
        return spec
    return str(plan_dir / spec)


def _to_json(plan: Plan, plan_dir: Path) -> dict:
    try:
        model_path = os.path.relpath(plan.model_path.resolve(), plan_dir.resolve())
    except ValueError:  # another drive on Windows
        model_path = str(plan.model_path.resolve())
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "model": {"path": model_path, "sha256": plan.model_sha256, "batch": plan.batch},
        "loss": plan.loss.value,
        "devices": plan.devices,
        "machine": _relative_machine(plan.machine, plan_dir),
        "precision": plan.precision.value,
        **({"zero_stage": int(plan.zero_stage)} if plan.zero_stage else {}),
        **({"zero_stages": {w: int(z) for w, z in plan.zero_weights}} if plan.zero_weights else {}),
        **({"pipeline": _pipeline_json(plan.pipeline)} if plan.pipeline else {}),
        **({"recompute": list(plan.recompute)} if plan.recompute else {}),
        **({"bucket_mb": plan.bucket_mb} if plan.bucket_mb != DEFAULT_BUCKET_MB else {}),
        "ops": [op_json(o) for o in plan.ops],
        "predicted": None,
        "search": None,
    }
    if plan.predicted:
        p = plan.predicted
        doc["predicted"] = {
            "step_time_s": p.step_time_s,
            "peak_memory_bytes": list(p.peak_memory_bytes),
            "bytes_moved": p.bytes_moved,
            "baselines": dict(p.baselines),
            "infeasible_baselines": list(p.infeasible),
        }
    if plan.search:
        s = plan.search
        doc["search"] = {
            "method": s.method,
            "seed": s.seed,
            "budget_s": s.budget_s,
            "evaluated": s.evaluated,
        }
    return doc


def _pipeline_json(pipeline: Pipeline) -> dict:
    return {
        "schedule": pipeline.schedule.value,
        "microbatches": pipeline.microbatches,
        "stages": [list(ops) for ops in pipeline.stages],
    }


def plan_document(plan: Plan, folder: Path) -> dict:
    """The plan as the JSON document ``save_plan`` writes, its paths relative to
    ``folder`` (an annotated model keeps it in its metadata: soap/annotations)."""
    return _to_json(plan, folder)


def save_plan(plan: Plan, path: Path | str) -> None:
    path = Path(path)
    write_atomic(path, json.dumps(_to_json(plan, path.parent), indent=2) + "\n")


class _Reader:
    """Typed access to a JSON document that names the field that is missing or wrong."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> PlanError:
        return PlanError(f"{self.source}: field '{where}': {what}")

    def get(self, doc: Mapping, key: str, kind: type | tuple, where: str, optional: bool = False):
        if not isinstance(doc, Mapping):
            raise self.fail(where.rsplit(".", 1)[0], "must be an object")
        if key not in doc or (optional and doc[key] is None):
            if optional:
                return None
            raise self.fail(where, "missing")
        value = doc[key]
        if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise self.fail(where, f"must be {names}, got {json.dumps(value)[:60]}")
        return value

    def positive(self, doc: Mapping, key: str, where: str, most: int | None = None) -> int:
        value = self.get(doc, key, int, where)
        if value < 1 or (most is not None and value > most):
            accepted = ">= 1" if most is None else f"an integer in [1, {most}]"
            raise self.fail(where, f"must be {accepted}, got {value}")
        return value

    def path(self, doc: Mapping, key: str, where: str, optional: bool = False) -> str | None:
        """A file path: non-empty, no NUL byte (the OS cannot open one), not absurdly long."""
        value = self.get(doc, key, str, where, optional)
        if value is None:
            return None
        if not value or "\0" in value or len(value) > MAX_PATH_CHARS:
            raise self.fail(
                where,
                f"must be a non-empty path of at most {MAX_PATH_CHARS} characters "
                "without NUL bytes",
            )
        return value


def op_json(o: OpPlan) -> dict:
    """One op's entry: ``copies`` only where > 1, so plans without it read alike."""
    doc = {"name": o.name, "degrees": dict(o.degrees), "devices": list(o.devices)}
    if o.copies > 1:
        doc["copies"] = o.copies
    return doc


def _read_ops(r: _Reader, doc: Mapping) -> tuple[OpPlan, ...]:
    ops = []
    seen = set()
    for i, o in enumerate(r.get(doc, "ops", list, "ops")):
        where = f"ops[{i}]"
        name = r.get(o, "name", str, f"{where}.name")
        if name in seen:
            raise r.fail(f"{where}.name", f"op '{name}' appears twice")
        seen.add(name)
        degrees = r.get(o, "degrees", dict, f"{where}.degrees")
        for dim in degrees:
            r.positive(degrees, dim, f"{where}.degrees.{dim}", most=MAX_DEVICES)
        devices = r.get(o, "devices", list, f"{where}.devices")
        for j, d in enumerate(devices):
            if not isinstance(d, int) or isinstance(d, bool):
                raise r.fail(f"{where}.devices[{j}]", f"must be int, got {json.dumps(d)}")
            if not 0 <= d < MAX_DEVICES:
                raise r.fail(f"{where}.devices[{j}]", f"must be in [0, {MAX_DEVICES}), got {d}")
        copies = 1
        if "copies" in o:
            copies = r.positive(o, "copies", f"{where}.copies", most=MAX_DEVICES)
        tasks = math.prod(degrees.values()) * copies
        if len(devices) != tasks:
            made = "the degrees" if copies == 1 else f"the degrees and {copies} copies"
            raise r.fail(
                f"{where}.devices", f"has {len(devices)} entries; {made} make {tasks} tasks"
            )
        # Degree-1 entries are kept so that a misspelt dim name is still caught.
        ops.append(OpPlan(name, tuple(degrees.items()), tuple(devices), copies))
    return tuple(ops)


def _read_predicted(r: _Reader, doc: Mapping) -> Predicted | None:
    p = r.get(doc, "predicted", dict, "predicted", optional=True)
    if p is None:
        return None
    mem = r.get(p, "peak_memory_bytes", list, "predicted.peak_memory_bytes")
    for i, _ in enumerate(mem):
        r.get(dict(enumerate(mem)), i, int, f"predicted.peak_memory_bytes[{i}]")
    baselines = r.get(p, "baselines", dict, "predicted.baselines", optional=True) or {}
    for name in baselines:
        r.get(baselines, name, (int, float), f"predicted.baselines.{name}")
    infeasible = (
        r.get(p, "infeasible_baselines", list, "predicted.infeasible_baselines", optional=True)
        or []
    )
    for i, name in enumerate(infeasible):
        if name not in baselines:
            raise PlanError(
                f"predicted.infeasible_baselines[{i}]: {name!r} is not one of the baselines"
            )
    return Predicted(
        step_time_s=float(r.get(p, "step_time_s", (int, float), "predicted.step_time_s")),
        peak_memory_bytes=tuple(mem),
        bytes_moved=r.get(p, "bytes_moved", int, "predicted.bytes_moved"),
        baselines=tuple((str(k), float(v)) for k, v in baselines.items()),
        infeasible=tuple(str(n) for n in infeasible),
    )


def _read_search(r: _Reader, doc: Mapping) -> SearchInfo | None:
    s = r.get(doc, "search", dict, "search", optional=True)
    if s is None:
        return None
    return SearchInfo(
        method=r.get(s, "method", str, "search.method"),
        seed=r.get(s, "seed", int, "search.seed"),
        budget_s=float(r.get(s, "budget_s", (int, float), "search.budget_s")),
        evaluated=r.get(s, "evaluated", int, "search.evaluated"),
    )


def _number_parser(kind: type):
    """``json.loads`` hook: refuse a number too long to be meant (5,000 digits would be a
    ValueError in int() and inf in float()) or one that is not finite."""

    def parse(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise PlanError(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
        value = kind(text)
        if kind is float and not math.isfinite(value):
            raise PlanError(f"the number {text} is out of range")
        return value

    return parse


def _refuse_constant(text: str):
    raise PlanError(f"{text} is not a number JSON allows")


# The closing quote is optional: an unterminated string is then eaten once, where a
# required quote made the regex rescan to the end from every inner quote (quadratic).
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"?')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def _json_depth(text: str) -> int:
    """How deep arrays and objects nest, counted without recursion (strings skipped)."""
    depth = deepest = 0
    for c in _NOT_BRACKETS.sub("", _STRINGS.sub("", text)):
        depth += 1 if c in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def parse_json(text: str) -> object:
    """``json.loads`` within the plan limits; errors are ``PlanError`` without the file."""
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise PlanError(f"JSON nested {depth} deep (at most {MAX_JSON_DEPTH})")
    try:
        return json.loads(
            text,
            parse_int=_number_parser(int),
            parse_float=_number_parser(float),
            parse_constant=_refuse_constant,
        )
    except (json.JSONDecodeError, RecursionError) as e:
        raise PlanError(str(e)) from e


def _read_text(path: Path) -> str:
    if "\0" in str(path):
        raise PlanError(f"{path!r}: a plan path cannot contain a NUL byte")
    try:
        if not path.is_file():  # /dev/zero or a FIFO would be read for ever
            if not path.exists():
                raise PlanError(f"{path}: no such plan file")
            raise PlanError(f"{path}: cannot read the plan (not a regular file)")
        with path.open("rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
    except OSError as e:
        raise PlanError(f"{path}: cannot read the plan ({e.strerror or e})") from e
    if len(data) > MAX_PLAN_BYTES:
        raise PlanError(f"{path}: a plan file is at most {MAX_PLAN_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"{path}: not a JSON plan file (not UTF-8: {e.reason})") from e


def load_plan(path: Path | str) -> Plan:
    path = Path(path)
    text = _read_text(path)
    try:
        doc = parse_json(text)
    except PlanError as e:
        raise PlanError(f"{path}: not a JSON plan file ({e})") from e
    return plan_from_document(doc, str(path), path.parent)


def plan_from_document(doc: object, source: str, folder: Path) -> Plan:
    """A plan document checked field by field (errors name ``source`` and the field);
    its paths are relative to ``folder``."""
    r = _Reader(source)
    if not isinstance(doc, dict):
        raise PlanError(f"{source}: a plan must be a JSON object")
    if r.get(doc, "format", str, "format") != FORMAT:
        raise r.fail("format", f"must be '{FORMAT}', got {json.dumps(doc['format'])[:60]}")
    version = r.get(doc, "version", int, "version")
    if version != VERSION:
        raise r.fail("version", f"this onnx2soap reads version {VERSION}, got {version}")
    model = r.get(doc, "model", dict, "model")
    loss = r.get(doc, "loss", str, "loss")
    losses = [k.value for k in LossKind]
    if loss not in losses:
        raise r.fail("loss", f"must be one of {losses}, got {json.dumps(loss)[:60]}")
    sha = r.get(model, "sha256", str, "model.sha256")
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise r.fail("model.sha256", "must be 64 lowercase hex digits")
    devices = r.positive(doc, "devices", "devices", most=MAX_DEVICES)
    ops = _read_ops(r, doc)
    for i, op in enumerate(ops):
        for j, d in enumerate(op.devices):
            if d >= devices:
                raise r.fail(
                    f"ops[{i}].devices[{j}]", f"device {d} is not one of the plan's {devices}"
                )
    batch = r.positive(model, "batch", "model.batch", most=MAX_BATCH)
    return Plan(
        model_path=folder / r.path(model, "path", "model.path"),
        model_sha256=sha,
        batch=batch,
        loss=LossKind(loss),
        devices=devices,
        ops=ops,
        machine=_resolved_machine(r.path(doc, "machine", "machine", optional=True), folder),
        predicted=_read_predicted(r, doc),
        search=_read_search(r, doc),
        precision=_read_precision(r, doc),
        zero_stage=_read_zero_stage(r, doc),
        zero_weights=_read_zero_weights(r, doc),
        pipeline=_read_pipeline(r, doc, batch, devices, {o.name for o in ops}),
        recompute=_read_recompute(r, doc, {o.name for o in ops}),
        bucket_mb=_read_bucket_mb(r, doc),
    )


def _read_precision(r: _Reader, doc: Mapping) -> Precision:
    value = r.get(doc, "precision", str, "precision", optional=True)
    known = [p.value for p in Precision]
    if value is None:
        return Precision.FP32
    if value not in known:
        raise r.fail("precision", f"must be one of {known}, got {json.dumps(value)[:60]}")
    return Precision(value)


def _read_zero_stage(r: _Reader, doc: Mapping) -> ZeroStage:
    value = r.get(doc, "zero_stage", int, "zero_stage", optional=True)
    if value is None:
        return ZeroStage.NONE
    accepted = [int(s) for s in ZERO_STAGES]
    if value not in accepted:
        raise r.fail("zero_stage", f"must be one of {accepted} (a ZeRO stage), got {value}")
    return ZeroStage(value)


def _read_zero_weights(r: _Reader, doc: Mapping) -> tuple[tuple[str, ZeroStage], ...]:
    given = r.get(doc, "zero_stages", dict, "zero_stages", optional=True)
    if given is None:
        return ()
    accepted = [int(s) for s in ZeroStage]
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value not in accepted:
            raise r.fail(
                f"zero_stages.{name[:60]}",
                f"must be one of {accepted} (a ZeRO stage), got {json.dumps(value)[:60]}",
            )
    return tuple(sorted((name, ZeroStage(value)) for name, value in given.items()))


def _read_bucket_mb(r: _Reader, doc: Mapping) -> float:
    value = r.get(doc, "bucket_mb", (int, float), "bucket_mb", optional=True)
    if value is None:
        return DEFAULT_BUCKET_MB
    try:
        return check_bucket_mb(value)
    except ValueError as e:
        raise r.fail("bucket_mb", str(e)) from e


def _read_pipeline(
    r: _Reader, doc: Mapping, batch: int, devices: int, ops: set[str]
) -> Pipeline | None:
    p = r.get(doc, "pipeline", dict, "pipeline", optional=True)
    if p is None:
        return None
    schedule = r.get(p, "schedule", str, "pipeline.schedule")
    if schedule not in SCHEDULES:
        raise r.fail("pipeline.schedule", f"must be one of {list(SCHEDULES)}, got {schedule!r}")
    microbatches = r.positive(p, "microbatches", "pipeline.microbatches", most=batch)
    if batch % microbatches:
        raise r.fail(
            "pipeline.microbatches",
            f"{microbatches} does not divide the batch of {batch} (use a divisor of {batch})",
        )
    stages = r.get(p, "stages", list, "pipeline.stages")
    if not 1 <= len(stages) <= devices:
        raise r.fail(
            "pipeline.stages", f"has {len(stages)} stages; between 1 and {devices} (the devices)"
        )
    read = []
    for s, names in enumerate(stages):
        where = f"pipeline.stages[{s}]"
        if not isinstance(names, list) or not names:
            raise r.fail(where, "must be a non-empty list of op names")
        for i, name in enumerate(names):
            if not isinstance(name, str):
                raise r.fail(f"{where}[{i}]", f"must be an op name, got {json.dumps(name)[:60]}")
            if name not in ops:
                raise r.fail(f"{where}[{i}]", f"'{name}' is not one of the plan's ops")
        read.append(tuple(names))
    return Pipeline(tuple(read), microbatches, Schedule(schedule))


def _read_recompute(r: _Reader, doc: Mapping, ops: set[str]) -> tuple[str, ...]:
    names = r.get(doc, "recompute", list, "recompute", optional=True)
    if names is None:
        return ()
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not isinstance(name, str) or name not in ops:
            raise r.fail(
                f"recompute[{i}]", f"must name one of the plan's ops, got {json.dumps(name)[:60]}"
            )
        if name in seen:
            raise r.fail(f"recompute[{i}]", f"op '{name}' appears twice")
        seen.add(name)
    return tuple(names)
