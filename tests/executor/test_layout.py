"""The runtime's layout: a whole tile or output gradient received from another rank is
read in place, its receive buffer handed to the kernel (``executor/layout.py``:
``Received``), and the memory model makes neither an input nor a gradient buffer for it.

In-process, one Runtime per rank of a 2-device plan: building the buffers and assembling
a task's inputs needs no peer (the transport only names its groups)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from executor.data import SyntheticData, rows_needed
from executor.layout import Assembled, Received
from executor.program import Phase, compile_program
from executor.runtime import Runtime
from executor.step import Step
from onnx2soap.importer import load_model
from onnx2soap.soap import Partitioner, analyze, import_loss, load_plan
from onnx2soap.soap.partition import rect_shape
from tests.executor.mpi import make_plan


class _NoTransport:
    """Enough of a transport to build a Runtime: nothing is sent."""

    def make_groups(self, groups) -> None:
        list(groups)


@pytest.fixture(scope="module")
def runtimes(example_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Runtime]:
    plan_path = tmp_path_factory.mktemp("layout") / "plan.json"
    # a seed whose plan moves whole tiles and whole output gradients across the ranks
    make_plan(example_onnx, plan_path, 2, 8, "random", seed=3)
    plan = load_plan(plan_path)
    model = load_model(plan.model_path, plan.batch, import_loss(plan))
    pg = Partitioner(model.graph).partition(plan.strategy(model.graph, analyze(model.graph)))
    weights = {**model.weights, **model.state}
    return [
        Runtime(pg, compile_program(pg, rank), _NoTransport(), weights, np.float32, model.constants)
        for rank in range(2)
    ]


def _step(rt: Runtime) -> Step:
    batch = SyntheticData(rt.graph, 0, rt.dtype).batch(1, rows_needed(rt.pg, rt.rank))
    return Step(rt, batch, training=True)


def _transfers(rt: Runtime) -> dict:
    return {t.id: t for t in rt.program.receives}


def _name(rt: Runtime, t) -> str:
    return rt.graph.ops[t.producer[0]].output


def _posted(rt: Runtime, t):
    """The buffer a step makes as it posts the receive of ``t`` (``Step.recv``)."""
    shape, dtype = rt.buffers.receives[t.id]
    return rt.xp.empty(shape, dtype=dtype)


def test_a_received_whole_input_is_the_receive_buffer(runtimes: list[Runtime]) -> None:
    found = 0
    for rt in runtimes:
        transfers, step = _transfers(rt), _step(rt)
        for key, sources in rt.buffers.inputs.items():
            for k, source in enumerate(sources):
                if isinstance(source, Assembled) and len(source.copies) == 1:
                    # Assembled from one received piece only where it leaves padding.
                    (copy,) = source.copies
                    region = rt.task(key).inputs[k]
                    if copy.transfer is not None:
                        assert transfers[copy.transfer].rect != region.buffer
                if not isinstance(source, Received):
                    continue
                found += 1
                t = transfers[source.transfer]
                assert t.phase is Phase.FORWARD and t.consumer == key and t.operand == k
                assert t.rect == rt.task(key).inputs[k].buffer
                # What the kernel gets is the receive buffer itself, not a copy; the
                # step made it when it posted the receive, and lets go of it once read.
                assert rt.buffers.receives[t.id] == (
                    rect_shape(t.rect),
                    rt.storage_of(_name(rt, t)),
                )
                posted = step.received[t.id] = _posted(rt, t)
                assert step._assemble_inputs(key)[k] is posted
                assert t.id not in step.received
    assert found, "the plan should move some whole tile across ranks"


def test_a_received_whole_output_gradient_is_the_receive_buffer(
    runtimes: list[Runtime],
) -> None:
    found = 0
    for rt in runtimes:
        transfers, step = _transfers(rt), _step(rt)
        for key, source in rt.buffers.grad_outputs.items():
            if not isinstance(source, Received):
                continue
            found += 1
            t = transfers[source.transfer]
            assert t.phase is Phase.BACKWARD and t.producer == key
            assert t.rect == rt.task(key).output
            posted = step.received[t.id] = _posted(rt, t)
            assert rect_shape(t.rect) == posted.shape
            assert step._grad_output(key) is posted
            assert t.id not in step.received  # read: the step holds it no more
    assert found, "the plan should send some whole output gradient across ranks"
