"""A plan from another tool's annotations: the standard's fields alone (or ours with our
metadata stripped), read where SOAP can express them.

Each op's config comes from its node's shardings (``derive.py``); an op of a node
without shardings, or with no node (the attached loss), takes its producers' layout
where it can be split so (the standard's rule for an input without a sharding), and
one neither says anything of (a shared weight's Identity) runs whole where its first
reader's first piece runs. Pipeline stages come from ``pipeline_stage``, numbered in
their order, an op without one in its producers' latest stage (else its readers'
earliest), in one microbatch with 1F1B: the standard has neither field. The batch is
the graph's, the loss its own (or cross-entropy), no machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import onnx

from onnx2soap.errors import PlanError
from onnx2soap.ir import Graph, Op
from onnx2soap.soap.annotations.derive import Given, derive
from onnx2soap.soap.annotations.metadata import op_document
from onnx2soap.soap.annotations.nodes import NodeOps, Placement, node_label, place
from onnx2soap.soap.annotations.parse import Configuration, NodeAnnotation, node_annotations
from onnx2soap.soap.annotations.sharding import input_dims, output_dims, output_sharding
from onnx2soap.soap.copies import weight_only_ops
from onnx2soap.soap.dims import SoapDim, analyze
from onnx2soap.soap.partition import ParallelConfig
from onnx2soap.soap.pipeline import Schedule
from onnx2soap.soap.plan import FORMAT, VERSION, Plan, plan_from_document, plan_ops
from onnx2soap.soap.strategy import Strategy


def foreign_plan(
    path: Path, model: onnx.ModelProto, conf: Configuration, graph: Graph, sha256: str
) -> Plan:
    """The plan ``model``'s standard annotations under ``conf`` state for ``graph`` (the
    model imported at its batch); ``path`` and ``sha256``: the file's."""
    if graph.loss_op is None:
        raise PlanError(f"{path}: the model has no loss to train with")
    placement = place(model.graph, graph)
    try:
        found = node_annotations(model, conf, graph, placement)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from e
    space = analyze(graph)
    configs = _derived(path, model, graph, space, placement, found, conf.devices)
    stages = _stages(graph, placement, found)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "model": {"path": path.name, "sha256": sha256, "batch": graph.batch},
        "loss": graph.loss.value,
        "devices": conf.devices,
        "machine": None,
        "ops": [op_document(o) for o in plan_ops(Strategy(conf.devices, configs), graph, space)],
        "predicted": None,
        "search": None,
    }
    if stages:
        doc["pipeline"] = {
            "schedule": Schedule.ONE_F_ONE_B.value,
            "microbatches": 1,
            "stages": stages,
        }
    plan = plan_from_document(doc, str(path), path.parent)
    try:
        plan.strategy(graph, space)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from e
    return plan


def _derived(
    path: Path,
    model: onnx.ModelProto,
    graph: Graph,
    space: Mapping[str, tuple[SoapDim, ...]],
    placement: Placement,
    found: Mapping[int, NodeAnnotation],
    devices: int,
) -> dict[str, ParallelConfig]:
    """Each op's config from its node's shardings, else from its producers' outputs;
    an op neither says anything of (a shared weight's Identity) runs whole where its
    first reader's first piece runs."""
    node_of = placement.node_of()
    producer = {op.output: op for op in graph.ops}
    configs: dict[str, ParallelConfig] = {}
    silent, copied = [], weight_only_ops(graph)
    for op in graph.ops:
        n = node_of.get(op.name)
        ann = found.get(n.index) if n else None
        given = _stated(op, n, ann, graph) if n and ann else []
        strict = bool(given)
        given = given or _inherited(op, space[op.name], producer, configs, graph)
        if not given:
            silent.append(op)
            continue
        where = (
            f"node '{node_label(model.graph.node[n.index], n.index)}'" if n else f"op '{op.name}'"
        )
        try:
            copies = op.name in copied
            configs[op.name] = derive(op, space[op.name], given, devices, strict, copies)
        except PlanError as e:
            raise PlanError(f"{path}: {where}: {e}") from e
    for op in reversed(silent):
        reader = next((r for r in graph.ops if op.output in r.inputs and r.name in configs), None)
        device = configs[reader.name].devices[0] if reader else 0
        configs[op.name] = ParallelConfig((1,) * len(space[op.name]), (device,))
    return configs


def _stated(op: Op, n: NodeOps, ann: NodeAnnotation, graph: Graph) -> list[Given]:
    """The shardings the node gives for the op's output and inputs."""
    out = []
    name = n.names.get(op.output)
    if name in ann.shardings:
        s = ann.shardings[name].canonical()
        out.append(Given(s, output_dims(op, s), f"sharding_spec '{name}'", True))
    for k, t in enumerate(op.inputs):
        name = n.names.get(t)
        if name in ann.shardings and op.inputs.index(t) == k:
            s = ann.shardings[name].canonical()
            dims = input_dims(op, k, s, graph.tensors[t].shape)
            out.append(Given(s, dims, f"sharding_spec '{name}'", False))
    return out


def _inherited(
    op: Op,
    dims: tuple[SoapDim, ...],
    producer: Mapping[str, Op],
    configs: Mapping[str, ParallelConfig],
    graph: Graph,
) -> list[Given]:
    """The standard's rule for an input without a sharding: its producer's output's,
    where the op can be split so (a loss reading logits cut by classes reads them whole:
    the layout says nothing of where it runs)."""
    out = []
    for k, t in enumerate(op.inputs):
        p = producer.get(t)
        if p is None or p.name not in configs or op.inputs.index(t) != k:
            continue
        s = output_sharding(p, configs[p.name]).canonical()
        cut_dims = input_dims(op, k, s, graph.tensors[t].shape)
        fits = all(
            d is not None and dims[d].splittable and c.shards <= dims[d].max_degree
            for c, d in zip(s.cuts, cut_dims, strict=True)
        )
        if fits:
            out.append(Given(s, cut_dims, f"the sharding '{p.name}' writes '{t}' in", False))
    return out


def _stages(
    graph: Graph, placement: Placement, found: Mapping[int, NodeAnnotation]
) -> list[list[str]]:
    """The ops of each pipeline stage, numbered in the order of the stages given; []
    where no node has a stage. An op of no stage takes its producers' latest, else its
    readers' earliest."""
    node_of = placement.node_of()
    stage: dict[str, int] = {}
    for op in graph.ops:
        n = node_of.get(op.name)
        ann = found.get(n.index) if n else None
        if ann is not None and ann.stage is not None:
            stage[op.name] = ann.stage
    if not stage:
        return []
    producer = {op.output: op.name for op in graph.ops}
    for op in graph.ops:
        before = [stage[producer[t]] for t in op.inputs if producer.get(t) in stage]
        if op.name not in stage and before:
            stage[op.name] = max(before)
    for op in reversed(graph.ops):
        after = [stage[r.name] for r in graph.ops if op.output in r.inputs and r.name in stage]
        if op.name not in stage:
            stage[op.name] = min(after, default=min(stage.values()))
    order = sorted(set(stage.values()))
    return [[op.name for op in graph.ops if stage[op.name] == s] for s in order]
