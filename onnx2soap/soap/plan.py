"""The plan file: the only contract between planning and running.

    {"format": "onnx2soap.plan", "version": 1,
     "model": {"path": str, "sha256": str, "batch": int}, "loss": str, "devices": int,
     "machine": str | null,
     "ops": [{"name": str, "degrees": {dim: int}, "devices": [int]}],
     "predicted": {...} | null, "search": {...} | null}

The model path (and a machine file's) is stored relative to the plan file's folder.
Loading checks every field and names the bad one; writing is atomic (a temporary file
renamed over the target).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from onnx2soap.errors import PlanError
from onnx2soap.files import write_atomic
from onnx2soap.ir import Graph, LossKind
from onnx2soap.soap.dims import SoapDim
from onnx2soap.soap.partition import ParallelConfig
from onnx2soap.soap.strategy import Strategy, validate

FORMAT = "onnx2soap.plan"
VERSION = 1


@dataclass(frozen=True)
class OpPlan:
    name: str
    degrees: tuple[tuple[str, int], ...]  # written: dims split with degree > 1
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Predicted:
    """What the simulator predicts for the plan (filled by ``plan`` with a machine)."""

    step_time_s: float
    peak_memory_bytes: tuple[int, ...]
    bytes_moved: int
    baselines: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class SearchInfo:
    method: str
    seed: int
    budget_s: float
    evaluated: int
    search_time_s: float


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

    def strategy(self, graph: Graph, space: Mapping[str, tuple[SoapDim, ...]]) -> Strategy:
        """The plan as a validated ``Strategy`` for ``graph`` (errors name the op)."""
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
            configs[op.name] = ParallelConfig(degrees, op.devices)
        strategy = Strategy(self.devices, configs)
        validate(graph, space, strategy)
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
        out.append(OpPlan(op.name, degrees, config.devices))
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
        "ops": [
            {"name": o.name, "degrees": dict(o.degrees), "devices": list(o.devices)}
            for o in plan.ops
        ],
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
        }
    if plan.search:
        s = plan.search
        doc["search"] = {
            "method": s.method,
            "seed": s.seed,
            "budget_s": s.budget_s,
            "evaluated": s.evaluated,
            "search_time_s": s.search_time_s,
        }
    return doc


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

    def positive(self, doc: Mapping, key: str, where: str) -> int:
        value = self.get(doc, key, int, where)
        if value < 1:
            raise self.fail(where, f"must be >= 1, got {value}")
        return value


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
            r.positive(degrees, dim, f"{where}.degrees.{dim}")
        devices = r.get(o, "devices", list, f"{where}.devices")
        for j, d in enumerate(devices):
            if not isinstance(d, int) or isinstance(d, bool):
                raise r.fail(f"{where}.devices[{j}]", f"must be int, got {json.dumps(d)}")
        if len(devices) != math.prod(degrees.values()):
            raise r.fail(
                f"{where}.devices",
                f"has {len(devices)} entries; the degrees make {math.prod(degrees.values())} tasks",
            )
        # Degree-1 entries are kept so that a misspelt dim name is still caught.
        ops.append(OpPlan(name, tuple(degrees.items()), tuple(devices)))
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
    return Predicted(
        step_time_s=float(r.get(p, "step_time_s", (int, float), "predicted.step_time_s")),
        peak_memory_bytes=tuple(mem),
        bytes_moved=r.get(p, "bytes_moved", int, "predicted.bytes_moved"),
        baselines=tuple((str(k), float(v)) for k, v in baselines.items()),
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
        search_time_s=float(r.get(s, "search_time_s", (int, float), "search.search_time_s")),
    )


def load_plan(path: Path | str) -> Plan:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise PlanError(f"{path}: no such plan file") from e
    except OSError as e:
        raise PlanError(f"{path}: cannot read the plan ({e.strerror or e})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path}: not a JSON plan file ({e})") from e
    r = _Reader(str(path))
    if not isinstance(doc, dict):
        raise PlanError(f"{path}: a plan must be a JSON object")
    if r.get(doc, "format", str, "format") != FORMAT:
        raise r.fail("format", f"must be '{FORMAT}', got '{doc['format']}'")
    version = r.get(doc, "version", int, "version")
    if version != VERSION:
        raise r.fail("version", f"this onnx2soap reads version {VERSION}, got {version}")
    model = r.get(doc, "model", dict, "model")
    loss = r.get(doc, "loss", str, "loss")
    losses = [k.value for k in LossKind]
    if loss not in losses:
        raise r.fail("loss", f"must be one of {losses}, got '{loss}'")
    sha = r.get(model, "sha256", str, "model.sha256")
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise r.fail("model.sha256", "must be 64 lowercase hex digits")
    return Plan(
        model_path=path.parent / r.get(model, "path", str, "model.path"),
        model_sha256=sha,
        batch=r.positive(model, "batch", "model.batch"),
        loss=LossKind(loss),
        devices=r.positive(doc, "devices", "devices"),
        ops=_read_ops(r, doc),
        machine=_resolved_machine(
            r.get(doc, "machine", str, "machine", optional=True), path.parent
        ),
        predicted=_read_predicted(r, doc),
        search=_read_search(r, doc),
    )
