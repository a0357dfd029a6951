"""What an op keeps from its forward to its backward: one answer for the executor
(``executor/lifetimes.py``) and the memory model (``sim/memory.py``).

An op keeps the input buffers and the output tile its definition says its backward
reads (``OpDef.saves``); one that is recomputed keeps every input (its forward runs
again from them) and no output; one whose output takes no gradient (ids, masks) has no
backward and keeps nothing.
"""

from __future__ import annotations

from onnx2soap.ir import Graph, Op
from onnx2soap.ops import definition


def kept_for_backward(graph: Graph, op: Op, recomputed: bool) -> tuple[frozenset[int], bool]:
    """(the input operands kept, whether the output tile is kept)."""
    if recomputed:
        return frozenset(range(len(op.inputs))), False
    if not graph.differentiable(op.output):
        return frozenset(), False
    saves = definition(op.type).saves
    return frozenset(k for k in range(len(op.inputs)) if saves.keeps_input(k)), saves.output
