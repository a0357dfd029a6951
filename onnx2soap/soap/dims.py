"""Parallelizable dims of every op, with FlexFlow's kinds inferred from the loop nests.

- **sample**: the dim traces back to the batch axis of the data input (or the labels);
  a loss's every dim its labels index (a sequence's positions too: partial losses sum);
- **parameter**: a kept dim that indexes an axis of a trainable weight;
- **attribute**: any other kept dim;
- **reduction**: absent from the output.

A dim is *splittable* when a task can compute its share from its own input regions with
no combination across tasks: kept, and never hidden in a ``Whole`` access. The loss is
the one exception: its sample dim is split and the scalar partial losses are summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from onnx2soap.ir import (
    Affine,
    BatchAt,
    Graph,
    Op,
    TensorRole,
    Whole,
    batch_dims,
    output_batch,
)


class DimKind(Enum):
    SAMPLE = "sample"
    ATTRIBUTE = "attribute"
    PARAMETER = "parameter"
    REDUCTION = "reduction"


@dataclass(frozen=True)
class SoapDim:
    name: str
    size: int
    kind: DimKind
    axis: int | None  # the output axis this dim indexes; None for reductions
    splittable: bool
    granule: int = 1  # split only at multiples of it (a grouped conv's whole groups)

    @property
    def max_degree(self) -> int:
        return self.size // self.granule


def _direct_dim(m) -> int | None:
    """The dim an axis map reads one-to-one, if it is a plain (possibly offset) copy."""
    if isinstance(m, Affine) and len(m.terms) == 1 and m.terms[0][1] == 1:
        return m.terms[0][0]
    return None


def _sample_dims(op: Op, batch: int, where: dict[str, frozenset[BatchAt]]) -> dict[int, int]:
    """Dim -> the batch's stride in it, for the dims that read the batch of an operand."""
    operands = [where.get(o.tensor, frozenset()) for o in op.nest.inputs]
    return batch_dims(op.nest, operands, batch)


def _parameter_dims(op: Op, graph: Graph) -> set[int]:
    found = set()
    for operand in op.nest.inputs:
        if graph.tensors[operand.tensor].role is TensorRole.WEIGHT:
            found.update(d for m in operand.axes if (d := _direct_dim(m)) is not None)
    return found


def _label_dims(op: Op) -> set[int]:
    """The dims a loss's labels (its last operand) read one to one: the batch and the
    positions of a sequence, not a cross-entropy's classes. Each task's loss over its
    labels is a partial sum of the whole batch's, as a split of the batch's is."""
    labels = op.nest.inputs[-1]
    return {d for m in labels.axes if (d := _direct_dim(m)) is not None}


def _hidden_dims(op: Op) -> set[int]:
    return {d for o in op.nest.inputs for m in o.axes if isinstance(m, Whole) for d in m.dims}


def op_dims(
    op: Op,
    graph: Graph,
    where: dict[str, frozenset[BatchAt]],
    carried: dict[int, int] | None = None,
) -> tuple[SoapDim, ...]:
    """``where``: where the batch lies in each tensor the op reads; ``carried``: the
    dims that read it (computed from ``where`` if not given)."""
    nest = op.nest
    carried = _sample_dims(op, graph.batch, where) if carried is None else carried
    samples = set(carried)
    if op.is_loss:  # its labels' other axes split as samples do: partial losses, summed
        samples |= _label_dims(op)
    params = _parameter_dims(op, graph)
    hidden = _hidden_dims(op)
    axis_of = {d: a for a, d in enumerate(nest.out_dims) if d is not None}
    dims = []
    for i, d in enumerate(nest.dims):
        kept = i in axis_of
        if i in samples and (kept or op.is_loss):
            kind = DimKind.SAMPLE
        elif not kept:
            kind = DimKind.REDUCTION
        elif i in params:
            kind = DimKind.PARAMETER
        else:
            kind = DimKind.ATTRIBUTE
        summed = i in nest.partial_dims  # split, the partial outputs summed
        splittable = (kept or kind is DimKind.SAMPLE or summed) and i not in hidden and d.size > 1
        splittable = splittable and d.max_degree > 1
        dims.append(SoapDim(d.name, d.size, kind, axis_of.get(i), splittable, d.granule))
    return tuple(dims)


def _seeds(graph: Graph) -> dict[str, frozenset[BatchAt]]:
    where = {name: frozenset({BatchAt(0)}) for name in graph.inputs}
    if graph.labels:
        where[graph.labels] = frozenset({BatchAt(0)})
    return where


def analyze(graph: Graph) -> dict[str, tuple[SoapDim, ...]]:
    """The SOAP dims of every op, keyed by op name, in graph order. The batch is traced
    from axis 0 of the data inputs and the labels through every op's access maps: a
    transpose moves it, a merge with the heads or the time steps gives it a stride, a
    reduction ends it. A kept dim that holds it is a sample dim: splitting it splits the
    samples, or (merged behind the time steps, [T*N]) the rows that hold them."""
    where = _seeds(graph)
    result = {}
    for op in graph.ops:
        carried = _sample_dims(op, graph.batch, where)
        result[op.name] = op_dims(op, graph, where, carried)
        where[op.output] = output_batch(op.nest, carried)
    return result
