"""The Python heap during training: settled after the first step, released after the last.

A collector pass over the whole runtime inside a step (30 ms on resnet18) stalls every
rank that waits for this one; settled, the collector sees only what later steps make.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from mpi4py import MPI

from executor.host_memory import release_python_heap, settle_python_heap
from executor.train import RunOptions, train
from tests.executor.mpi import make_plan


class _Node:
    """A cycle's member that can be watched (weakref) for being collected."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def _dropped_cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_settled_heap_freezes_what_lives_and_still_collects_new_cycles():
    kept = [_Node() for _ in range(100)]
    try:
        settle_python_heap()
        assert gc.get_freeze_count() >= len(kept)
        gc.collect()
        assert gc.get_freeze_count() >= len(kept), "a collection thawed the frozen objects"
        cycle = _dropped_cycle()
        gc.collect()
        assert cycle() is None, "a cycle made after settling was not collected"
    finally:
        release_python_heap()
    assert gc.get_freeze_count() == 0


def test_training_settles_the_heap_after_its_first_step_and_releases_it(
    export_model, tmp_path: Path
):
    plan = tmp_path / "one.json"
    make_plan(export_model("cnn"), plan, 1, 4, "data-parallel")
    frozen = []
    train(
        MPI.COMM_SELF,
        RunOptions(plan=plan, steps=3, lr=0.01),
        on_step=lambda record: frozen.append(gc.get_freeze_count()),
    )
    # on_step runs before the step's end: step 1 is not settled yet, 2 and 3 are.
    assert frozen[0] == 0
    assert frozen[1] > 1000 and frozen[2] >= frozen[1]
    assert gc.get_freeze_count() == 0
