"""What ``onnx2soap inspect`` shows of a model, as typed values: each op's output shape,
forward FLOPs, parameters and SOAP dims (with their kinds), and weights that are copies
of each other (a tie the exporter broke). The command line prints it; the Python API
(onnx2soap/api.py) returns it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from onnx2soap.importer import load_model
from onnx2soap.importer.copies import WeightCopy, weight_copies
from onnx2soap.ir import Graph, LossKind, Op
from onnx2soap.soap import analyze


@dataclass(frozen=True)
class DimInfo:
    name: str
    size: int
    kind: str  # sample, attribute, parameter, reduction
    axis: int | None
    splittable: bool
    synchronized: bool  # statistics combined across a split (BatchNorm in training)


@dataclass(frozen=True)
class OpInfo:
    name: str
    type: str
    output_shape: tuple[int, ...]
    flops: int  # forward
    params: int
    dims: tuple[DimInfo, ...]


@dataclass(frozen=True)
class Inspected:
    """A model as onnx2soap reads it, at one batch."""

    model: str
    batch: int
    loss: str
    ops: tuple[OpInfo, ...]
    weight_copies: tuple[WeightCopy, ...]
    graph: Graph = field(repr=False, compare=False)  # the IR, for the command's table

    @property
    def flops(self) -> int:
        """Forward FLOPs of one step's batch."""
        return sum(o.flops for o in self.ops)

    @property
    def params(self) -> int:
        return sum(o.params for o in self.ops)

    def document(self) -> dict:
        """``onnx2soap inspect --json``'s document."""
        return {
            "model": self.model,
            "batch": self.batch,
            "loss": self.loss,
            "ops": [
                {
                    "name": o.name,
                    "type": o.type,
                    "output_shape": list(o.output_shape),
                    "flops": o.flops,
                    "params": o.params,
                    "dims": [vars(d).copy() for d in o.dims],
                }
                for o in self.ops
            ],
            "weight_copies": [
                {"first": c.first, "second": c.second, "kind": c.kind.value}
                for c in self.weight_copies
            ],
        }


def inspect_model(
    model: Path | str, batch: int | None = None, loss: LossKind | None = None
) -> Inspected:
    """``model`` read at ``batch`` (binding a symbolic batch dim) with ``loss`` attached
    where it has none (default: cross-entropy)."""
    imported = load_model(model, batch, loss)
    return inspect_graph(imported.graph, str(model), weight_copies(imported.weights))


def inspect_graph(graph: Graph, model: str, copies: tuple[WeightCopy, ...] = ()) -> Inspected:
    """``graph`` (read from the file ``model``) with its ``copies`` (importer/copies.py)."""
    space = analyze(graph)
    weights = {w.name for w in graph.weights}
    ops = tuple(
        OpInfo(
            op.name,
            op.type,
            tuple(graph.tensors[op.output].shape),
            op.nest.flops,
            sum(graph.tensors[t].numel for t in op.inputs if t in weights),
            tuple(
                DimInfo(d.name, d.size, d.kind.value, d.axis, d.splittable, d.name in synced(op))
                for d in space[op.name]
            ),
        )
        for op in graph.ops
    )
    return Inspected(model, graph.batch, graph.loss.value, ops, copies, graph)


def synced(op: Op) -> set[str]:
    """Names of the dims whose statistics are combined across a split (BatchNorm in
    training mode); none for an op without statistics (BatchNorm in inference mode)."""
    return {op.nest.dims[i].name for i in op.nest.sync_dims}
