"""The memory model prices a sent piece as the executor now holds it: until its send
completes, not to the step's end (executor/transport.py, nccl.py, step.py).

On a tensor-parallel MLP on 2 ranks (tests/executor/test_sends_let_go.py: columns, then
rows, the activations between split by samples or by features; batch 32, hidden 64,
float32), a column layer reads its whole input, its other half received from the peer:

- split by samples, the pieces (a tile's rows, an input gradient's rows) are sent as
  views: nothing is held through the step for them, and no tile is held to its end;
- split by features, a piece of a tile is the producer's whole tile (a view), but a
  piece of the column layer's input gradient is strided and sent from a copy made for
  the send: none is held through the step; it lives from the consumer's backward
  through the producer's backward kernel (the sender finds the send complete at its next
  call into the transport). Every piece is 32 x 32 float32: 4 KiB.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.sparse_mlp import Fill, write_sparse_mlp
from onnx2soap.importer import load_model
from onnx2soap.sim.memory import add_edges
from onnx2soap.soap import Partitioner, Strategy, analyze, load_plan
from tests.executor.test_reduction_splits import config, save
from tests.executor.test_sends_let_go import tensor_parallel_plan

BATCH, HIDDEN = 32, 64
PIECE = BATCH * HIDDEN // 2 * 4  # the peer's half of a column layer's input: 4 KiB


def _edges(tmp_path: Path, reader: str):
    plan = load_plan(tensor_parallel_plan(tmp_path, 4, HIDDEN, BATCH, reader))
    graph = load_model(plan.model_path, plan.batch).graph
    pg = Partitioner(graph).partition(plan.strategy(graph, analyze(graph)))
    held = [0, 0]
    edges = add_edges(held, pg, 4, objects=False)
    index = {op.name: i for i, op in enumerate(graph.ops)}
    return held, edges, index


@pytest.mark.parametrize("reader", ["n", "f"])
def test_no_sent_piece_is_held_through_the_step(tmp_path: Path, reader: str) -> None:
    held, edges, index = _edges(tmp_path, reader)
    assert held == [0, 0]  # no staging copy made once and kept
    assert index["relu1"] not in edges.until  # no tile held by a send to the step's end


def test_views_add_nothing_to_the_receive_buffers(tmp_path: Path) -> None:
    _, edges, index = _edges(tmp_path, "n")
    relu1, matmul2 = index["relu1"], index["matmul2"]
    assert dict(edges.posted[relu1]) == {0: PIECE, 1: PIECE}  # the receive buffers alone
    assert dict(edges.recv_grads[(matmul2, 0)]) == {0: PIECE, 1: PIECE}
    # the column layer's whole input gradient, through relu1's backward kernel
    assert dict(edges.sent[(matmul2, 0)]) == {0: 2 * PIECE, 1: 2 * PIECE}


def test_a_staged_piece_lives_as_the_receive_buffer_at_the_other_end(tmp_path: Path) -> None:
    _, edges, index = _edges(tmp_path, "f")
    relu1, matmul2 = index["relu1"], index["matmul2"]
    assert dict(edges.posted[relu1]) == {0: PIECE, 1: PIECE}  # a whole tile: a view
    # the gradient's: the peer's piece it receives, and its own input gradient's copy it
    # sends, from matmul2's backward through relu1's backward kernel
    assert dict(edges.recv_grads[(matmul2, 0)]) == {0: PIECE, 1: PIECE}
    assert dict(edges.staged_grads[(matmul2, 0)]) == {0: PIECE, 1: PIECE}
    assert (matmul2, 0) not in edges.sent


def test_a_gradient_sent_whole_goes_once_it_is_sent(tmp_path: Path) -> None:
    """relu1 by features over devices 0 and 2, matmul2 whole on device 1: no producer
    task on device 1 reads matmul2's input gradient, which goes to the others in two
    strided column blocks, each from a copy; so the step drops it once they are sent
    (executor/lifetimes.py), not when relu1's backward gathers (``unread_grads``). On
    the plan of two devices (reader 'f') a relu1 task on each device gathers it."""
    mlp = write_sparse_mlp(tmp_path, 4, HIDDEN, fill=Fill.RANDOM)
    graph = load_model(mlp.model, BATCH).graph
    configs = {}
    for op in graph.ops:
        if op.name == "relu1":
            configs[op.name] = config(graph, op.name, (0, 2), f=2)
        elif op.name == "matmul2":
            configs[op.name] = config(graph, op.name, (1,))
        else:
            configs[op.name] = config(graph, op.name, (0, 1, 2), n=3)
    plan = load_plan(save(graph, mlp.model, BATCH, Strategy(3, configs), tmp_path / "p.json"))
    pg = Partitioner(graph).partition(plan.strategy(graph, analyze(graph)))
    edges = add_edges([0, 0, 0], pg, 4, objects=False)
    matmul2 = [op.name for op in graph.ops].index("matmul2")
    whole = BATCH * HIDDEN * 4
    assert dict(edges.unread_grads[(matmul2, 0)]) == {1: whole}
    assert dict(edges.staged_grads[(matmul2, 0)]) == {1: whole}  # two halves, copied
    _, gathered, index = _edges(tmp_path / "two", "f")
    assert (index["matmul2"], 0) not in gathered.unread_grads
