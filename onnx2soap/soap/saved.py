"""What an op keeps from its forward to its backward: one answer for the executor
(``executor/lifetimes.py``) and the memory model (``sim/memory.py``).

An op keeps the input buffers and the output tile its definition says its backward
reads (``OpDef.saves``), less those read only for the gradients of operands that take
none (``Saved.only_for``: x of x * c for a constant c); one that is recomputed keeps every
input (its forward runs again from them) and no output; one whose output takes no
gradient (ids, masks) has no backward and keeps nothing.
"""

from __future__ import annotations

from onnx2soap.ir import Graph, Op, TensorRole
from onnx2soap.ops import definition


def takes_gradient(graph: Graph, tensor: str) -> bool:
    """Whether the step uses ``tensor``'s gradient: a weight's, or a float activation's
    (flowing on to the ops that made it); never data's, labels', constants' or state's."""
    role = graph.tensors[tensor].role
    return role is TensorRole.WEIGHT or (
        role is TensorRole.ACTIVATION and graph.differentiable(tensor)
    )


def wanted_gradients(graph: Graph, op: Op) -> tuple[bool, ...]:
    """Per operand of ``op``, ``takes_gradient`` (``TaskArgs.wanted``)."""
    return tuple(takes_gradient(graph, t) for t in op.inputs)


def backward_reads(graph: Graph, op: Op, tensor: str) -> bool:
    """Whether the op's backward reads ``tensor`` (a weight: ZeRO-3 gathers it for the
    backward only then; a linear on data does not read its weight there)."""
    kept = kept_for_backward(graph, op, False)[0]
    return any(op.inputs[k] == tensor for k in kept)


def kept_for_backward(graph: Graph, op: Op, recomputed: bool) -> tuple[frozenset[int], bool]:
    """(the input operands kept, whether the output tile is kept)."""
    if recomputed:
        return frozenset(range(len(op.inputs))), False
    if not graph.differentiable(op.output):
        return frozenset(), False
    saves = definition(op.type).saves
    wanted = frozenset(k for k, w in enumerate(wanted_gradients(graph, op)) if w)
    kept = frozenset(k for k in range(len(op.inputs)) if saves.keeps_input(k, wanted))
    return kept, saves.output
