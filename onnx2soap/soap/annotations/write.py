"""A plan written into its model as ONNX multi-device annotations (IR version 11).

The model gets one ``DeviceConfigurationProto`` (``onnx2soap``, the plan's devices) and
every node that computes an op a ``NodeDeviceConfigurationProto``: a ``ShardingSpecProto``
for each input and output whose layout the standard can state (``layout.py``), and its
pipeline stage where the plan has a pipeline. What the standard cannot say stays in our
metadata beside it (``metadata.py``). Weights are not read: the model is loaded without
its external data, and the annotated file refers to the original's data file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import onnx

from onnx2soap.errors import UserError
from onnx2soap.files import write_atomic
from onnx2soap.ir import Graph
from onnx2soap.soap.annotations.layout import node_shardings
from onnx2soap.soap.annotations.metadata import (
    CONFIGURATION,
    OPS_KEY,
    PLAN_KEY,
    drop_ours,
    ops_value,
    plan_value,
)
from onnx2soap.soap.annotations.nodes import place
from onnx2soap.soap.annotations.proto import to_proto
from onnx2soap.soap.dims import SoapDim
from onnx2soap.soap.plan import Plan, plan_document

# NodeProto.device_configurations and ModelProto.configuration came with IR version 11.
MIN_IR_VERSION = 11
MAX_PROTO_BYTES = (2 << 30) - 1  # protobuf's limit on one message


def annotate(
    model: onnx.ModelProto,
    plan: Plan,
    graph: Graph,
    space: Mapping[str, tuple[SoapDim, ...]],
    folder: Path,
) -> onnx.ModelProto:
    """A copy of ``model`` (loaded without its external data) annotated with ``plan``,
    whose ``graph`` is the model at ``plan.graph_batch``; ``folder``: where the copy is
    written (a machine file's path is kept relative to it). Our earlier annotations
    are replaced; another tool's are left as they are."""
    configs = plan.strategy(graph, space).configs
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _clear(out)
    out.configuration.add(name=CONFIGURATION, num_devices=plan.devices)
    placement = place(out.graph, graph)
    by_name = {o.name: o for o in plan.ops}
    ops = {op.name: op for op in graph.ops}
    stage = plan.pipeline.stage_of() if plan.pipeline else {}
    for node_ops in placement.nodes:
        node = out.graph.node[node_ops.index]
        entry = node.device_configurations.add(configuration_id=CONFIGURATION)
        for sharding in node_shardings(node_ops, ops, configs, graph):
            entry.sharding_spec.append(to_proto(sharding))
        if plan.pipeline:
            entry.pipeline_stage = stage[node_ops.ops[0]]
        node.metadata_props.add(key=OPS_KEY, value=ops_value([by_name[n] for n in node_ops.ops]))
    free = [by_name[n] for n in placement.free]
    out.metadata_props.add(key=PLAN_KEY, value=plan_value(plan_document(plan, folder), free))
    out.ir_version = max(out.ir_version, MIN_IR_VERSION)
    return out


def _clear(model: onnx.ModelProto) -> None:
    """Our configuration, node annotations and metadata gone; other tools' kept."""
    kept = [c for c in model.configuration if c.name != CONFIGURATION]
    del model.configuration[:]
    model.configuration.extend(kept)
    for node in model.graph.node:
        others = [c for c in node.device_configurations if c.configuration_id != CONFIGURATION]
        del node.device_configurations[:]
        node.device_configurations.extend(others)
        drop_ours(node.metadata_props)
    drop_ours(model.metadata_props)


def refer_to_data(model: onnx.ModelProto, source: Path, target: Path) -> None:
    """Point every external tensor of ``model`` (read from ``source``) at its data file
    from ``target``'s folder. The importer reads external data only inside the model's
    folder, so the data file must lie inside ``target``'s: refused in one line if not."""
    if source.resolve() == target.resolve():
        raise UserError(
            f"{target}: that is the plan's model itself; write the annotated model to "
            "another file beside it"
        )
    home, there = source.resolve().parent, target.resolve().parent
    for tensor in _external(model):
        entry = next(e for e in tensor.external_data if e.key == "location")
        data = (home / entry.value).resolve()
        relative = os.path.relpath(data, there)
        if relative.startswith(os.pardir) or os.path.isabs(relative):
            raise UserError(
                f"{target}: the model keeps its weights in {data}, outside the output's "
                f"folder; write the annotated model in {data.parent} (or a folder above "
                "it) so that it can refer to them"
            )
        entry.value = Path(relative).as_posix()


def _external(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        for a in node.attribute:
            tensors += [a.t] if a.HasField("t") else list(a.tensors)
    return [
        t
        for t in tensors
        if t.data_location == onnx.TensorProto.EXTERNAL
        and any(e.key == "location" for e in t.external_data)
    ]


def write_annotated(model: onnx.ModelProto, path: Path) -> None:
    """Written atomically (a temporary file renamed over ``path``)."""
    size = model.ByteSize()
    if size > MAX_PROTO_BYTES:
        raise UserError(
            f"{path}: the annotated model would be {size} bytes, past protobuf's 2 GiB; "
            "keep the weights as external data"
        )
    write_atomic(path, model.SerializeToString())
