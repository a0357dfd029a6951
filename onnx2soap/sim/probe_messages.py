"""What one message costs a step of the executor, measured through its own runtime.

``onnx2soap machine probe`` writes a link's latency from this: a chain of tiny Relus
(no weights, a few bytes a tile) is trained on the probe's ranks under two plans, every
op on rank 0, and the ops alternating between rank 0 and a peer. Under the second every
edge of the chain is a message (its tile forward, its gradient back), each on the step's
critical path, and nothing else differs, so

    message = (alternating step - one-rank step) / messages

is what a message adds to a step as the runtime runs it: the Send, the posted Recv and
the Wait instructions with their dispatch between instructions, the transport's calls,
and the peer's wake-up. A ping-pong of bare transport calls sees about a fifth of it
(2 against 10-15 us on a 2-core VM), which is why transfers and small all-reduce rings
were predicted several times too fast. The steps are traced as ``--trace`` traces them,
as the in-step calibration of ``onnx2soap profile`` is, so the two agree on what a
traced instruction costs. The ranks' processor time is measured beside it, and

    busy = (alternating processor time - one-rank processor time, all ranks) / messages / 2

is what a message costs each of its two ends: all of the message where ranks spin
while they wait, a part of it where they nap (ranks that outnumber the cores: 45 of
125 us on 4 ranks on 2 cores here), the rest of which their cores are free for others.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

CHAIN_OPS = 16
WIDTH = 8
BATCH = 2
STEPS = 24
SKIPPED = 3  # the first steps make buffers, and the tracer's second runs tracemalloc
# Rounds of (one-rank chain, then the alternating chain of every peer); a peer's figure is
# the median over the rounds. One round's figure spreads by +-25 % on a 2-core VM (14-26
# us a message in six back to back), which every message-bound plan's prediction took.
ROUNDS = 5


@dataclass(frozen=True)
class MessageCost:
    """What one message between rank 0 and a peer adds to a step (``seconds``), and of
    it, the processor time it costs each of its two ends (``busy``)."""

    seconds: float
    busy: float


def chain_model(folder: Path):
    """x [BATCH, WIDTH] -> CHAIN_OPS Relus -> logits (cross-entropy attached)."""
    from onnx2soap.importer import load_model

    names = [f"h{i}" for i in range(CHAIN_OPS)] + ["logits"]
    nodes = [
        helper.make_node("Relu", [a], [b], name=f"relu{i}")
        for i, (a, b) in enumerate(itertools.pairwise(names))
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("h0", onnx.TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", WIDTH])],
    )
    path = folder / "chain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return load_model(path, batch=BATCH)


def _plan(graph, devices: int, peer: int):
    """Every op whole; on rank 0, or (``peer`` > 0) alternating between 0 and ``peer``."""
    from onnx2soap.soap import Partitioner, Strategy, analyze
    from onnx2soap.soap.partition import ParallelConfig

    space = analyze(graph)
    configs = {
        op.name: ParallelConfig((1,) * len(space[op.name]), (peer if i % 2 else 0,))
        for i, op in enumerate(graph.ops)
    }
    return Partitioner(graph).partition(Strategy(devices, configs))


def _step_seconds(comm, model, peer: int, nap: bool) -> tuple[float, float, int]:
    """The median traced step of the plan over the ranks (the slowest rank's), the
    median over the steps of the processor time all ranks spent in it, and how many
    messages it sends."""
    from mpi4py import MPI

    from executor.data import SyntheticData, rows_needed
    from executor.device import CpuDevice
    from executor.host_memory import release_python_heap, settle_python_heap
    from executor.program import Send, compile_program
    from executor.runtime import Runtime
    from executor.trace import Tracer
    from executor.transport import MpiTransport, wait_patiently

    graph, rank, dtype = model.graph, comm.Get_rank(), np.dtype(np.float32)
    pg = _plan(graph, comm.Get_size(), peer)
    program = compile_program(pg, rank)
    device = CpuDevice()
    tracer = Tracer(rank, pg, device)
    rt = Runtime(pg, program, MpiTransport(comm, device, nap=nap), {}, dtype, device=device)
    rt.tracer = tracer
    data, rows = SyntheticData(graph, 0, dtype), rows_needed(pg, rank)
    times, cpu = [], []
    try:
        for step in range(1, STEPS + 1):
            batch = data.batch(step, rows)
            wait_patiently(comm.Ibarrier().Test, nap=nap)  # ranks start a step together
            start, processor = time.perf_counter(), time.process_time()
            tracer.begin_step(step)
            rt.step(batch, 0.0)
            tracer.end_step()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - processor)
            if step == 1:  # as the executor's steps run: see settle_python_heap
                settle_python_heap()
    finally:
        release_python_heap()
    slowest, spent = np.empty(STEPS), np.empty(STEPS)
    comm.Allreduce(np.array(times), slowest, op=MPI.MAX)
    comm.Allreduce(np.array(cpu), spent, op=MPI.SUM)
    sends = sum(isinstance(ins, Send) for ins in program.instructions)
    return (
        statistics.median(slowest[SKIPPED:].tolist()),
        statistics.median(spent[SKIPPED:].tolist()),
        comm.allreduce(sends),
    )


def message_costs(comm, nap: bool) -> list[MessageCost]:
    """Per peer of rank 0 (every rank calls this), what a message between rank 0 and
    that peer costs a step and each of its ends, the medians over ``ROUNDS`` rounds;
    empty on one rank."""
    with tempfile.TemporaryDirectory() as folder:
        model = chain_model(Path(folder)) if comm.Get_rank() == 0 else None
    model = comm.bcast(model, root=0)
    if comm.Get_size() == 1:
        return []
    peers = range(1, comm.Get_size())
    seconds: list[list[float]] = [[] for _ in peers]
    busy: list[list[float]] = [[] for _ in peers]
    for _ in range(ROUNDS):
        alone, alone_cpu, _ = _step_seconds(comm, model, 0, nap)  # one for every peer
        for i, peer in enumerate(peers):
            apart, apart_cpu, messages = _step_seconds(comm, model, peer, nap)
            seconds[i].append(max(apart - alone, 0.0) / messages)
            busy[i].append(max(apart_cpu - alone_cpu, 0.0) / messages / 2)
    return [
        MessageCost(statistics.median(s), statistics.median(b))
        for s, b in zip(seconds, busy, strict=True)
    ]
