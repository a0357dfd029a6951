"""``--eval-data``: the evaluation loss (and accuracy for classification) on the plan.

Every full batch of the evaluation file runs the forward phase without training (no
Dropout, no running-statistics updates); a pipeline's batch, microbatch by microbatch.
The loss is the mean of the batches' losses.
Accuracy needs the whole class axis of each prediction, which the plan may split: the
logits' tiles are gathered on rank 0, which counts the predictions (argmax over the class
axis) equal to their labels, ignored labels left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from executor.data import _classes
from executor.dataset import LABELS, FileData
from executor.runtime import Runtime
from onnx2soap.errors import UserError


@dataclass(frozen=True)
class EvalRecord:
    step: int
    loss: float
    accuracy: float | None  # classification only


def _logits_op(rt: Runtime) -> str:
    return rt.graph.producer(rt.graph.loss_op.inputs[0]).name


def _assemble(graph, name: str, tiles: list) -> np.ndarray:
    """The whole logits tensor from every rank's (rect, tile) pieces."""
    whole = np.empty(graph.tensors[name].shape, dtype=np.float64)
    for rect, tile in tiles:
        whole[tuple(slice(lo, hi) for lo, hi in rect)] = tile
    return whole


def _correct(labels: np.ndarray, rt: Runtime, logits: np.ndarray) -> tuple[int, int]:
    attrs = rt.graph.loss_op.attrs
    predicted = np.moveaxis(logits, attrs.class_axis, -1).argmax(axis=-1)
    counted = np.ones(labels.shape, dtype=bool)
    if attrs.ignore_index is not None:
        counted = labels != attrs.ignore_index
    return int(((predicted == labels) & counted).sum()), int(counted.sum())


def _count(rt: Runtime, data: FileData, b: int, name: str, pieces: list) -> tuple[int, int]:
    """The right predictions and the counted labels of batch ``b``, microbatch by
    microbatch (consecutive samples: the labels' rows in turn)."""
    labels = np.asarray(data.arrays[LABELS][data.indices(b)])
    size = len(labels) // data.microbatches
    right = counted = 0
    for m in range(data.microbatches):
        logits = _assemble(rt.graph, name, [(rect, tile) for k, rect, tile in pieces if k == m])
        hit, seen = _correct(labels[m * size : (m + 1) * size], rt, logits)
        right, counted = right + hit, counted + seen
    return right, counted


def evaluate(comm: MPI.Comm, rt: Runtime, data: FileData, rows, step: int) -> EvalRecord:
    """Collective: every rank runs its part; all get the same record."""
    classify = _classes(rt.graph) is not None
    name = rt.graph.loss_op.inputs[0]
    op = _logits_op(rt) if classify else None
    losses, right, counted = [], 0, 0
    for b in range(data.batches_per_epoch):
        error, partial, pieces = None, 0.0, []
        try:
            batch = data.batch(b, rows)
            partial, tiles = rt.evaluate(batch, {op} if op else set())
            index = next((i for i, o in enumerate(rt.graph.ops) if o.name == op), -1)
            pieces = [
                (m, rt.output_rect((index, t)), tile)
                for m, part in enumerate(tiles)
                for (_, t), tile in part.items()
            ]
        except UserError as e:
            error = str(e)
        errors = [e for e in comm.allgather(error) if e]
        if errors:
            raise UserError(errors[0])
        losses.append(comm.allreduce(partial, op=MPI.SUM))
        if classify:
            gathered = comm.gather(pieces, root=0)
            if comm.Get_rank() == 0:
                hit, seen = _count(rt, data, b, name, [p for part in gathered for p in part])
                right, counted = right + hit, counted + seen
    accuracy = comm.bcast(right / counted if classify and counted else None, root=0)
    return EvalRecord(step, float(np.mean(losses)), accuracy)
