"""An annotated model's multi-device fields read and checked, before any is used: the
configuration to read, and each node's shardings, pipeline stage and our metadata.

Every error is one line naming the node and the field: a configuration id that names
no configuration, a device past the configuration's, a malformed or overlapping
sharding, a sharding of a tensor the node neither reads nor writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import onnx

from onnx2soap.errors import PlanError
from onnx2soap.ir import Graph
from onnx2soap.soap.annotations.metadata import CONFIGURATION, OPS_KEY, find, read_ops_value
from onnx2soap.soap.annotations.nodes import Placement, node_label
from onnx2soap.soap.annotations.proto import from_proto
from onnx2soap.soap.annotations.sharding import Sharding
from onnx2soap.soap.plan import MAX_DEVICES, OpPlan


@dataclass(frozen=True)
class Configuration:
    name: str
    devices: int


@dataclass(frozen=True)
class NodeAnnotation:
    """A node's annotation under the configuration read: its shardings by the node's
    tensor names, its pipeline stage, and our exact configs (None: no metadata)."""

    shardings: Mapping[str, Sharding]
    stage: int | None
    ops: tuple[OpPlan, ...] | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shardings", MappingProxyType(dict(self.shardings)))


def configuration(model: onnx.ModelProto, ours: bool) -> Configuration:
    """The configuration to read: ours where our metadata is there, else the only one."""
    names = [c.name for c in model.configuration]
    if not names:
        raise PlanError(
            "configuration: the model has no device configuration (not an annotated model)"
        )
    if len(set(names)) != len(names):
        raise PlanError(f"configuration: two configurations share a name ({names})")
    if ours and CONFIGURATION not in names:
        raise PlanError(
            f"configuration: onnx2soap's metadata but no '{CONFIGURATION}' among {names}"
        )
    if not ours and len(names) > 1:
        raise PlanError(
            f"configuration: {len(names)} configurations ({', '.join(names)}); a plan is one "
            "of them: remove the others"
        )
    i = names.index(CONFIGURATION) if ours else 0
    c = model.configuration[i]
    field = f"configuration[{i}]"
    if not 1 <= c.num_devices <= MAX_DEVICES:
        raise PlanError(f"{field}.num_devices: {c.num_devices}; must be in [1, {MAX_DEVICES}]")
    if c.device and len(c.device) != c.num_devices:
        raise PlanError(
            f"{field}.device: {len(c.device)} names for num_devices {c.num_devices} (the "
            "standard asks for one per device)"
        )
    return Configuration(c.name, c.num_devices)


def node_annotations(
    model: onnx.ModelProto, conf: Configuration, graph: Graph, placement: Placement
) -> dict[int, NodeAnnotation]:
    """Each node's annotation under ``conf``, by the node's index. A negative axis
    counts from the end of the tensor: its rank is the graph's where an op reads or
    writes it (by the node's name for it), else ONNX's where the file gives one."""
    ranks = _onnx_ranks(model)
    names = {n.index: {v: k for k, v in n.names.items()} for n in placement.nodes}

    def rank(node: int, name: str) -> int | None:
        tensor = graph.tensors.get(names.get(node, {}).get(name, name))
        return len(tensor.shape) if tensor is not None else ranks.get(name)

    known = {c.name for c in model.configuration}
    found = {}
    for i, node in enumerate(model.graph.node):
        try:
            ann = _node(node, i, conf, known, rank)
        except PlanError as e:
            raise PlanError(f"node '{node_label(node, i)}': {e}") from e
        if ann is not None:
            found[i] = ann
    return found


def _onnx_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """The ranks ONNX knows: graph inputs, outputs, value infos and initializers."""
    g = model.graph
    ranks = {t.name: len(t.dims) for t in g.initializer}
    for v in (*g.input, *g.output, *g.value_info):
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            ranks[v.name] = len(v.type.tensor_type.shape.dim)
    return ranks


def _node(
    node: onnx.NodeProto,
    index: int,
    conf: Configuration,
    known: set[str],
    rank: Callable[[int, str], int | None],
) -> NodeAnnotation | None:
    mine = None
    for j, entry in enumerate(node.device_configurations):
        field = f"device_configurations[{j}]"
        if entry.configuration_id not in known:
            raise PlanError(
                f"{field}.configuration_id: '{entry.configuration_id}' names no configuration "
                f"of the model ({', '.join(sorted(known))})"
            )
        if entry.configuration_id != conf.name:
            continue
        if mine is not None:
            raise PlanError(f"{field}: a second annotation for configuration '{conf.name}'")
        mine = (j, entry)
    value = find(node.metadata_props, OPS_KEY)
    ops = read_ops_value(value) if value is not None else None
    if mine is None:
        if ops is not None:
            raise PlanError(f"metadata_props '{OPS_KEY}' without a device configuration")
        return None
    j, entry = mine
    field = f"device_configurations[{j}]"
    tensors = {t for t in (*node.input, *node.output) if t}
    shardings: dict[str, Sharding] = {}
    for k, spec in enumerate(entry.sharding_spec):
        where = f"{field}.sharding_spec[{k}]"
        try:
            s = from_proto(spec, rank(index, spec.tensor_name), conf.devices)
        except PlanError as e:
            raise PlanError(f"{where}.{e}") from e
        if s.tensor not in tensors:
            raise PlanError(
                f"{where}.tensor_name: '{s.tensor}' is none of the node's inputs and outputs"
            )
        if s.tensor in shardings:
            raise PlanError(f"{where}.tensor_name: '{s.tensor}' has two shardings")
        shardings[s.tensor] = s
    stage = entry.pipeline_stage if entry.HasField("pipeline_stage") else None
    if stage is not None and stage < 0:
        raise PlanError(f"{field}.pipeline_stage: {stage}; stages are numbered from 0")
    return NodeAnnotation(shardings, stage, ops)
