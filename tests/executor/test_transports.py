"""Transports, the per-pair order they rely on, buffers made once, and rows per rank.

- The compiled programs give every pair of ranks one order: the i-th send from a to b is
  the i-th receive b posts from a (what tagless MPI matching and NCCL need), for random
  plans of several models; and every wait follows its receive.
- ``mpi-host`` (arrays staged through host buffers, as on a GPU) trains random plans on
  N ranks under mpiexec like one device.
- A rank's step reuses the buffers made before the first step; staging buffers are made
  in the first step only.
- Messages match by order past MPI's guaranteed tag bound (32767).
- A rank holds only the data rows its tasks read, and those rows equal the whole batch's.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from executor.data import SyntheticData, rows_needed
from executor.device import CpuDevice
from executor.program import Recv, Send, Wait, compile_program
from executor.runtime import Runtime
from executor.transport import MpiTransport
from onnx2soap.importer import load_model
from onnx2soap.ir import DType
from onnx2soap.search.baselines import data_parallel, random_strategy
from onnx2soap.soap import Partitioner, analyze
from tests.executor.mpi import assert_same_training, make_plan, mpirun, reference

MODELS = {"cnn": 4, "bnnet": 4, "tokens": 4, "tied": 4, "spatial": 4}  # -> batch
STEPS, LR = 2, 0.05


def _partition(path: Path, batch: int, devices: int, seed: int):
    graph = load_model(path, batch).graph
    strategy = random_strategy(graph, analyze(graph), devices, np.random.default_rng(seed))
    return Partitioner(graph).partition(strategy)


@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(devices=st.integers(2, 5), seed=st.integers(0, 10_000))
def test_each_pair_of_ranks_sends_and_receives_in_one_order(export_model, name, devices, seed):
    pg = _partition(export_model(name), MODELS[name], devices, seed)
    programs = [compile_program(pg, rank) for rank in range(devices)]
    sent, posted = defaultdict(list), defaultdict(list)
    for program in programs:
        received = set()
        for ins in program.instructions:
            if isinstance(ins, Send):
                assert ins.transfer.src == program.rank
                sent[(ins.transfer.src, ins.transfer.dst)].append(ins.transfer.id)
            elif isinstance(ins, Recv):
                assert ins.transfer.dst == program.rank
                posted[(ins.transfer.src, ins.transfer.dst)].append(ins.transfer.id)
                received.add(ins.transfer.id)
            elif isinstance(ins, Wait):
                assert ins.transfer.id in received, "a wait before its receive"
    assert sent == posted


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("name", "ranks", "seed"), [("cnn", 3, 1), ("bnnet", 2, 5), ("tokens", 3, 2)]
)
def test_host_staged_transport_trains_like_one_device(export_model, tmp_path, name, ranks, seed):
    model = export_model(name)
    one = tmp_path / "one.json"
    make_plan(model, one, 1, MODELS[name], "data-parallel")
    losses, weights = reference(one, STEPS, DType.FLOAT64, LR)
    plan = tmp_path / f"{name}-{ranks}.json"
    make_plan(model, plan, ranks, MODELS[name], "random", seed)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64")
    run = mpirun(plan, ranks, tmp_path, *args, "--transport", "mpi-host")
    assert_same_training(run, losses, weights, rtol=1e-10)


def _persistent(rt: Runtime) -> set[int]:
    """The ids of every array a step reuses."""
    b = rt.buffers
    arrays = [*b.grads.values(), *b.slots.values()]
    for sources in b.inputs.values():
        arrays += [getattr(s, "buffer", None) for s in sources]
    arrays += [getattr(s, "buffer", None) for s in b.grad_outputs.values()]
    arrays += list(rt.shards.values())
    return {id(a) for a in arrays if a is not None}


def test_steps_reuse_the_buffers_made_before_the_first(export_model):
    path = export_model("bnnet")
    graph = load_model(path, 4).graph
    # Several tasks per op on one device: assembled buffers, statistics slots.
    strategy = random_strategy(graph, analyze(graph), 1, np.random.default_rng(3))
    pg = Partitioner(graph).partition(strategy)
    model = load_model(path, 4)
    rt = Runtime(
        pg,
        compile_program(pg, 0),
        MpiTransport(MPI.COMM_SELF, CpuDevice()),
        {**model.weights, **model.state},
        np.float64,
        model.constants,
    )
    data = SyntheticData(graph, 0, np.dtype(np.float64))
    rows = rows_needed(pg, 0)
    rt.step(data.batch(0, rows), 0.01)
    before = _persistent(rt)
    for step in (1, 2):
        rt.step(data.batch(step, rows), 0.01)
        assert _persistent(rt) == before


def test_staged_messages_match_by_order_past_the_tag_bound():
    """More messages than MPI's guaranteed tag bound, all without tags, arrive in the
    order they were sent; staging buffers are made in the first step only."""
    transport = MpiTransport(MPI.COMM_SELF, CpuDevice(), staged=True)
    count = 33_000
    made = []
    for step in range(2):
        values = np.arange(count, dtype=np.float64) + step
        boxes = [np.empty(1) for _ in range(count)]
        pending = []
        for i in range(count):
            transport.send(values[i : i + 1], 0)
            pending.append(transport.recv(boxes[i], 0))
        for p in pending:
            transport.wait(p)
        transport.end_step()
        made.append(transport._pool.made)
        np.testing.assert_array_equal(np.concatenate(boxes), values)
    assert made[0] == made[1]


def test_a_rank_holds_only_the_rows_its_tasks_read(export_model):
    path = export_model("tokens")
    graph = load_model(path, 8).graph
    pg = Partitioner(graph).partition(data_parallel(graph, analyze(graph), 4))
    data = SyntheticData(graph, 7, np.dtype(np.float64))
    whole = data.batch(3)
    for rank in range(4):
        rows = rows_needed(pg, rank)
        assert rows and all(span == (2 * rank, 2 * rank + 2) for span in rows.values())
        mine = data.batch(3, rows)
        for name in graph.inputs:
            np.testing.assert_array_equal(
                mine.inputs[name], whole.inputs[name][rows[name][0] :][:2]
            )
        np.testing.assert_array_equal(mine.labels, whole.labels[2 * rank : 2 * rank + 2])
        assert mine.loss_scale == whole.loss_scale


class _PeerOfOnes:
    """A 2-rank communicator (mpi4py's method names) seen from rank 0, whose peer's
    chunks are ones and whose messages complete at once (null requests test as done)."""

    def Get_size(self) -> int:
        return 2

    def Get_rank(self) -> int:
        return 0

    def Isend(self, buf, dest):
        return MPI.REQUEST_NULL

    def Irecv(self, buf, source):
        buf[...] = 1.0
        return MPI.REQUEST_NULL


def test_a_ring_holds_its_scratch_only_while_it_runs():
    """A ring's receive scratch is made when its turn comes and dropped when it is done:
    the step keeps every finished ring to its end, and data parallelism had kept a
    1/k-sized scratch of every gradient through the backward (resnet18: 13 % of a rank's
    peak)."""
    from executor.transport import _Counter, _Ring, _Runs

    flat = np.arange(6, dtype=np.float64)
    ring = _Ring(_PeerOfOnes(), _Runs([flat], np), _Counter(), CpuDevice())
    assert ring.scratch is None and not ring.done  # queued: nothing made yet
    assert ring.advance() and ring.done
    assert ring.scratch is None
    # rank 0 sums chunk 1 (its own + the peer's ones) and takes chunk 0 from the peer
    np.testing.assert_array_equal(flat, [1, 1, 1, 4, 5, 6])


def test_a_bucket_rings_over_its_gradients_as_one_run():
    """A gradient bucket's ring (soap/buckets.py) works on the arrays' concatenation,
    never made: of the 7 elements, chunk 0, [0, 4), spans both arrays. Rank 0 sends it
    first, a message a piece, each a view of its array in place (a derived datatype over
    both had crawled through MPICH's shared-memory cells where ranks nap), adds the
    peer's ones into chunk 1, then takes chunk 0 from the peer into its scratch, a
    receive a piece, and lands it piece by piece."""
    from executor.transport import _Counter, _Ring, _Runs

    first, second = np.arange(3, dtype=np.float64), np.arange(10, 14, dtype=np.float64)
    sent, received = [], []

    class Peer(_PeerOfOnes):
        def Isend(self, buf, dest):
            sent.append(buf)
            return MPI.REQUEST_NULL

        def Irecv(self, buf, source):
            received.append(buf.size)
            return super().Irecv(buf, source)

    runs = _Runs([first, second.reshape(2, 2)], np)
    assert runs.size == 7
    assert runs.spans(0, 4) == [(0, 3), (3, 4)]
    assert [a.base is first or a.base is second for a in runs.pieces(0, 4)] == [True, True]
    ring = _Ring(Peer(), runs, _Counter(), CpuDevice())
    assert ring.advance() and ring.done
    np.testing.assert_array_equal(first, [1, 1, 1])
    np.testing.assert_array_equal(second, [1, 12, 13, 14])
    # step 1 sends chunk 0 in two pieces (3 and 1) and receives chunk 1 (3 elements of
    # the second array) in one; step 2 sends chunk 1 and receives chunk 0 in two
    assert [a.size for a in sent] == [3, 1, 3]
    assert received == [3, 3, 1]


def test_a_bucket_reduce_scatters_its_gradients_as_one_run():
    """ZeRO's bucket (soap/buckets.py): rank 0 of 2 owns rows [0, 4) of A and [0, 1) of
    B, laid out first in the shard-major run; its one step sends its run of the peer's
    (A[4:6], B[1:4]) and adds the peer's ones into its own, in the arrays themselves."""
    a, b = np.arange(6, dtype=np.float64), np.arange(10, 14, dtype=np.float64)
    transport = MpiTransport(MPI.COMM_SELF, CpuDevice())
    transport._groups[(0, 1)] = _PeerOfOnes()
    pending = transport.reduce_scatter_all(
        [a, b.reshape(2, 2)], (0, 1), [((0, 4), (4, 6)), ((0, 1), (1, 4))]
    )
    transport.wait(pending)
    np.testing.assert_array_equal(a, [1, 2, 3, 4, 4, 5])
    np.testing.assert_array_equal(b, [11, 11, 12, 13])
    assert transport.bytes_sent == 5 * 8  # the peer's run: 2 + 3 elements


def test_closing_frees_the_groups_so_a_process_can_train_plan_after_plan():
    """MPI has about two thousand communicator contexts a process (MPICH: 2046 here):
    a process that trains one plan after another (benchmarks/interleave.py, the
    probes) makes a transport and its groups each time, and must free them."""
    for _ in range(2100):
        transport = MpiTransport(MPI.COMM_SELF, CpuDevice())
        transport.make_groups([(0,)])
        transport.close()
    # Closed, the transport's groups are made again where asked.
    transport.make_groups([(0,)])
    assert (0,) in transport._groups
    transport.close()
