"""What an annotated model keeps beside the standard's fields, in ``metadata_props``
under keys of ours, so that our own round trip is exact:

- model ``onnx2soap.plan``: the plan file's document (soap/plan.py) without the model's
  path and hash (the annotated file is the model) and with only the ops no node
  computes in ``ops`` (the attached loss, a shared weight's Identity, a fusion's
  stand-ins): batch, loss, devices, machine, precision, ZeRO stages, pipeline (its
  microbatches and schedule, which the standard has no field for), recomputation,
  prediction and search.
- node ``onnx2soap.ops``: the exact config of each op the node computes, as in the plan
  file's ``ops`` (``{"name", "degrees", "devices"}``): which member of a partial sum's
  group holds it, the dim names, and the order of the tasks on the devices, which the
  standard's shardings leave out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import onnx

from onnx2soap.errors import PlanError
from onnx2soap.soap.plan import MAX_DEVICES, OpPlan, op_json, parse_json

CONFIGURATION = "onnx2soap"  # the name of our DeviceConfigurationProto
PREFIX = "onnx2soap."
PLAN_KEY = PREFIX + "plan"
OPS_KEY = PREFIX + "ops"


def op_document(op: OpPlan) -> dict:
    return op_json(op)


def ops_value(ops: Sequence[OpPlan]) -> str:
    return json.dumps([op_document(op) for op in ops], separators=(",", ":"))


def plan_value(document: dict, free: Sequence[OpPlan]) -> str:
    """``document``: the plan's (``plan_document``); the model's path and hash are left
    out, and ``ops`` holds the ``free`` ops only."""
    doc = {**document, "model": {"batch": document["model"]["batch"]}}
    doc["ops"] = [op_document(op) for op in free]
    return json.dumps(doc, separators=(",", ":"))


def find(props, key: str) -> str | None:
    """The value of ``key`` among ``metadata_props``; ``PlanError`` if it is there twice."""
    values = [p.value for p in props if p.key == key]
    if len(values) > 1:
        raise PlanError(f"metadata_props: key '{key}' appears {len(values)} times")
    return values[0] if values else None


def drop_ours(props) -> None:
    """Remove every entry of ours from a ``metadata_props`` list (before writing anew)."""
    kept = [(p.key, p.value) for p in props if not p.key.startswith(PREFIX)]
    del props[:]
    for key, value in kept:
        props.append(onnx.StringStringEntryProto(key=key, value=value))


def read_plan_value(value: str) -> dict:
    try:
        doc = parse_json(value)
    except PlanError as e:
        raise PlanError(f"metadata_props '{PLAN_KEY}': not JSON ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        raise PlanError(f"metadata_props '{PLAN_KEY}': must be a plan document with a model")
    if not isinstance(doc.get("ops", []), list):
        raise PlanError(f"metadata_props '{PLAN_KEY}'.ops: must be a list of ops")
    return doc


def read_ops_value(value: str) -> tuple[OpPlan, ...]:
    """A node's ops, checked as far as they stand alone (the plan checks the rest)."""
    where = f"metadata_props '{OPS_KEY}'"
    try:
        doc = parse_json(value)
    except PlanError as e:
        raise PlanError(f"{where}: not JSON ({e})") from e
    if not isinstance(doc, list) or not doc:
        raise PlanError(f"{where}: must be a non-empty list of ops")
    return tuple(op_entry(entry, f"{where}[{i}]") for i, entry in enumerate(doc))


def op_entry(entry: object, where: str) -> OpPlan:
    """One op's config as the plan file writes it, checked (``where`` names it)."""
    if not isinstance(entry, dict):
        raise PlanError(f"{where}: must be an object")
    name, degrees, devices = entry.get("name"), entry.get("degrees"), entry.get("devices")
    if not isinstance(name, str) or not name:
        raise PlanError(f"{where}.name: must be an op name")
    if not isinstance(degrees, dict) or not all(_count(v) for v in degrees.values()):
        raise PlanError(f"{where}.degrees: must map dim names to degrees in [1, {MAX_DEVICES}]")
    if not isinstance(devices, list) or not all(_device(d) for d in devices):
        raise PlanError(f"{where}.devices: must be a list of device numbers")
    copies = entry.get("copies", 1)
    if not _count(copies):
        raise PlanError(f"{where}.copies: must be an integer in [1, {MAX_DEVICES}]")
    tasks = math.prod(degrees.values()) * copies
    if len(devices) != tasks:
        made = "the degrees" if copies == 1 else f"the degrees and {copies} copies"
        raise PlanError(f"{where}.devices: {len(devices)} entries; {made} make {tasks} tasks")
    return OpPlan(name, tuple(degrees.items()), tuple(devices), copies)


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_DEVICES


def _device(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_DEVICES
