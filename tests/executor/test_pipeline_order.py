"""The pieces of a pipeline step that need no MPI: the global order of passes and the
step's data split into microbatches.

- ``pass_order`` holds every stage's passes once, each stage's in ``stage_order``'s
  order, a forward after the previous stage's forward of its microbatch and a backward
  after the next stage's backward of it, for GPipe and 1F1B over 1 to 5 stages and 1
  to 9 microbatches; one stage of one microbatch is a forward and a backward.
- A step of M microbatches holds, microbatch by microbatch, the rows and labels a step
  without microbatches holds (synthetic data and a data file alike), and its loss
  divisor is the whole step's (cross-entropy with ignored labels, and MSE).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from executor.batch import loss_scale
from executor.data import SyntheticData
from executor.dataset import open_dataset
from executor.program import Stages, pass_order
from onnx2soap.importer import load_model
from onnx2soap.ir import LossKind
from onnx2soap.soap.pipeline import Pass, Schedule, StagePass, stage_order


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize(
    ("stages", "microbatches"), [(1, 1), (2, 1), (2, 5), (3, 2), (4, 9), (5, 3)]
)
def test_pass_order_follows_every_stage_and_the_data(schedule, stages: int, microbatches: int):
    order = pass_order(Stages((0,), stages, microbatches, schedule))
    assert len(order) == len(set(order)) == 2 * stages * microbatches
    where = {event: k for k, event in enumerate(order)}
    for s in range(stages):
        mine = [p for stage, p in order if stage == s]
        assert tuple(mine) == stage_order(schedule, s, stages, microbatches)
        for m in range(microbatches):
            forward, backward = StagePass(m, Pass.FORWARD), StagePass(m, Pass.BACKWARD)
            if s > 0:
                assert where[(s - 1, forward)] < where[(s, forward)]
            if s < stages - 1:
                assert where[(s + 1, backward)] < where[(s, backward)]


def test_one_stage_of_one_microbatch_is_a_forward_and_a_backward() -> None:
    assert pass_order(Stages((0, 0, 0))) == [
        (0, StagePass(0, Pass.FORWARD)),
        (0, StagePass(0, Pass.BACKWARD)),
    ]


@pytest.fixture(scope="module")
def graphs(example_onnx: Path):
    """The example CNN at a step's batch (8) and at its microbatch's (2)."""
    return load_model(example_onnx, 8).graph, load_model(example_onnx, 2).graph


def test_microbatches_hold_the_steps_rows(graphs, tmp_path: Path) -> None:
    whole, micro = graphs
    rows = {micro.input: (1, 2), micro.labels: (0, 2)}  # a rank's part of a microbatch
    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    np.savez(data, input=rng.standard_normal((16, 3, 32, 32)), labels=rng.integers(0, 10, 16))
    sources = [
        (SyntheticData(whole, 3, np.float64), SyntheticData(micro, 3, np.float64, 4)),
        (open_dataset(data, whole, np.float64), open_dataset(data, micro, np.float64, None, 4)),
    ]
    for full, split in sources:
        want = full.batch(1)  # the second step: every row of the whole batch
        got = split.batch(1, rows)
        assert got.loss_scale == want.loss_scale == 8
        for m in range(4):
            part = got.microbatch(m)
            np.testing.assert_array_equal(
                part.inputs[micro.input], want.inputs[micro.input][2 * m + 1 : 2 * m + 2]
            )
            np.testing.assert_array_equal(part.labels, want.labels[2 * m : 2 * m + 2])


def test_the_loss_divisor_is_the_steps(graphs, example_onnx: Path) -> None:
    """Ignored labels counted over the step; an element count (MSE) the step's."""
    whole, micro = graphs
    labels = np.arange(8) % 10
    assert loss_scale(micro, labels, 4) == loss_scale(whole, labels) == 8
    labels[:3] = micro.loss_op.attrs.ignore_index
    assert loss_scale(micro, labels, 4) == loss_scale(whole, labels) == 5
    mse_whole = load_model(example_onnx, 8, LossKind.MSE).graph
    mse_micro = load_model(example_onnx, 2, LossKind.MSE).graph
    targets = np.zeros((8, 10))
    assert loss_scale(mse_micro, targets, 4) == loss_scale(mse_whole, targets) == 80
