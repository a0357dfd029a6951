"""An annotated model read as a plan.

A file we wrote (our metadata is there) reads exactly: the plan's fields and every op's
config come from the metadata, and each node's standard annotation must be the one the
configs give (``layout.py``), else the file was changed since and is refused. A file
with the standard's annotations alone (another tool's) is read by ``foreign.py``.

The plan's model is the annotated file itself (its path and hash): it holds the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import onnx
from google.protobuf.message import DecodeError

from onnx2soap.errors import ModelError, PlanError
from onnx2soap.files import check_input
from onnx2soap.ir import Graph, LossKind
from onnx2soap.soap.annotations.foreign import foreign_plan
from onnx2soap.soap.annotations.layout import node_shardings
from onnx2soap.soap.annotations.metadata import (
    PLAN_KEY,
    find,
    op_document,
    op_entry,
    read_plan_value,
)
from onnx2soap.soap.annotations.nodes import Placement, node_label, place
from onnx2soap.soap.annotations.parse import (
    Configuration,
    NodeAnnotation,
    configuration,
    node_annotations,
)
from onnx2soap.soap.dims import analyze
from onnx2soap.soap.plan import MAX_BATCH, OpPlan, Plan, plan_from_document
from onnx2soap.soap.strategy import Strategy


class Loaded(Protocol):
    """What the caller's loader gives (the importer's ``ImportedModel`` is one)."""

    graph: Graph
    sha256: str


# (batch or None for the model's own, loss or None for the model's own) -> the model
Loader = Callable[[int | None, LossKind | None], Loaded]


def is_annotated_model(path: Path | str) -> bool:
    """A plan given as an ONNX file (annotated) rather than a JSON plan file."""
    return Path(path).suffix.lower() == ".onnx"


def read_annotated(path: Path | str, load: Loader, batch: int | None = None) -> Plan:
    """The plan ``path``'s annotations state; ``load`` imports ``path`` itself;
    ``batch`` binds a symbolic batch where the file has no metadata of ours."""
    path = Path(path)
    model = load_proto(path)
    try:
        value = find(model.metadata_props, PLAN_KEY)
        conf = configuration(model, ours=value is not None)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from e
    if value is not None:
        return _ours(path, model, conf, value, load, batch)
    if batch is None and _symbolic_batch(model):
        raise PlanError(
            f"{path}: the standard's annotations give no batch and the model's is symbolic; "
            "give one (simulate --batch, or plan MODEL --batch B --start FILE for a plan file)"
        )
    loaded = load(batch, None)
    return foreign_plan(path, model, conf, loaded.graph, loaded.sha256)


def _symbolic_batch(model: onnx.ModelProto) -> bool:
    """Whether a data input's axis 0 has no fixed size (the importer binds it)."""
    stored = {t.name for t in model.graph.initializer}
    for v in model.graph.input:
        shape = v.type.tensor_type.shape
        if v.name not in stored and shape.dim and not shape.dim[0].HasField("dim_value"):
            return True
    return False


def load_proto(path: Path) -> onnx.ModelProto:
    """The model without its external data (no weight is read)."""
    check_input(path, "annotated model")
    try:
        return onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError, RuntimeError) as e:
        raise ModelError(f"{path}: not an ONNX model ({e})") from e


def _loss(doc: Mapping) -> LossKind | None:
    value = doc.get("loss")
    known = {k.value: k for k in LossKind}
    if not isinstance(value, str) or value not in known or value == LossKind.NONE.value:
        raise PlanError(f"metadata_props '{PLAN_KEY}'.loss: must be cross-entropy, mse or model")
    return None if value == LossKind.MODEL.value else known[value]


def _graph_batch(doc: Mapping) -> int:
    """The batch the ops are split at: a microbatch's under a pipeline."""
    batch, pipeline = doc["model"].get("batch"), doc.get("pipeline")
    micro = pipeline.get("microbatches") if isinstance(pipeline, Mapping) else 1
    if not all(_count(n) for n in (batch, micro)):
        raise PlanError(
            f"metadata_props '{PLAN_KEY}': model.batch and microbatches must be in [1, {MAX_BATCH}]"
        )
    if batch % micro:
        raise PlanError(f"metadata_props '{PLAN_KEY}': {micro} microbatches do not divide {batch}")
    return batch // micro


def _count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_BATCH


def _ours(
    path: Path,
    model: onnx.ModelProto,
    conf: Configuration,
    value: str,
    load: Loader,
    batch: int | None,
) -> Plan:
    try:
        doc = read_plan_value(value)
        loss, graph_batch = _loss(doc), _graph_batch(doc)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from e
    if batch is not None and batch != doc["model"]["batch"]:
        raise PlanError(f"{path}: the plan in it is for batch {doc['model']['batch']}, not {batch}")
    loaded = load(graph_batch, loss)
    graph = loaded.graph
    placement = place(model.graph, graph)
    found = _nodes(path, model, conf, graph, placement)
    ops = _exact_ops(path, model, doc, graph, placement, found)
    full = {**doc, "model": {**doc["model"], "path": path.name, "sha256": loaded.sha256}}
    full["ops"] = [op_document(op) for op in ops]
    plan = plan_from_document(full, f"{path}: metadata_props '{PLAN_KEY}'", path.parent)
    if plan.devices != conf.devices:
        raise PlanError(
            f"{path}: configuration '{conf.name}' has {conf.devices} devices, the plan "
            f"{plan.devices}"
        )
    strategy = _checked_strategy(path, plan, graph)
    _same_layout(path, model, plan, strategy, graph, placement, found)
    return plan


def _nodes(
    path: Path, model: onnx.ModelProto, conf: Configuration, graph: Graph, placement: Placement
) -> dict[int, NodeAnnotation]:
    try:
        return node_annotations(model, conf, graph, placement)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from e


def _exact_ops(
    path: Path,
    model: onnx.ModelProto,
    doc: Mapping,
    graph: Graph,
    placement: Placement,
    found: Mapping[int, NodeAnnotation],
) -> list[OpPlan]:
    """Every op's config from our metadata, in graph order."""
    given: dict[str, OpPlan] = {}
    for i, entry in enumerate(doc.get("ops") or []):
        op = op_entry(entry, f"{path}: metadata_props '{PLAN_KEY}'.ops[{i}]")
        given[op.name] = op
    for n in placement.nodes:
        label = node_label(model.graph.node[n.index], n.index)
        ann = found.get(n.index)
        if ann is None or ann.ops is None:
            raise PlanError(
                f"{path}: node '{label}': no onnx2soap annotation (it computes {list(n.ops)})"
            )
        named = [op.name for op in ann.ops]
        if sorted(named) != sorted(n.ops):
            raise PlanError(
                f"{path}: node '{label}': metadata_props 'onnx2soap.ops' names {named}; the "
                f"node computes {list(n.ops)}"
            )
        given.update((op.name, op) for op in ann.ops)
    missing = [op.name for op in graph.ops if op.name not in given]
    if missing:
        raise PlanError(f"{path}: metadata_props '{PLAN_KEY}': no config for ops {missing[:5]}")
    return [given[op.name] for op in graph.ops]


def _checked_strategy(path: Path, plan: Plan, graph: Graph) -> Strategy:
    try:
        return plan.strategy(graph, analyze(graph))
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from e


def _same_layout(
    path: Path,
    model: onnx.ModelProto,
    plan: Plan,
    strategy: Strategy,
    graph: Graph,
    placement: Placement,
    found: Mapping[int, NodeAnnotation],
) -> None:
    """Each node's standard annotation is the one its metadata's configs give."""
    ops = {op.name: op for op in graph.ops}
    stage = plan.pipeline.stage_of() if plan.pipeline else {}
    for n in placement.nodes:
        ann = found[n.index]
        label = node_label(model.graph.node[n.index], n.index)
        want = {s.tensor: s.canonical() for s in node_shardings(n, ops, strategy.configs, graph)}
        have = {t: s.canonical() for t, s in ann.shardings.items()}
        for tensor in sorted(set(want) | set(have)):
            if want.get(tensor) != have.get(tensor):
                raise PlanError(
                    f"{path}: node '{label}': sharding_spec '{tensor}' disagrees with its "
                    "onnx2soap.ops metadata (changed by another tool? remove the node's "
                    "onnx2soap.* metadata to read the standard annotation alone)"
                )
        expected = stage.get(n.ops[0])
        if ann.stage != expected:
            raise PlanError(
                f"{path}: node '{label}': pipeline_stage {ann.stage}, but the plan puts it in "
                f"stage {expected}"
            )
