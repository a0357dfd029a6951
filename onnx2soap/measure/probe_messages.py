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
were predicted several times too fast. The steps run untraced, as a user's run does and
as the in-step calibration of ``onnx2soap profile`` counts a step. The ranks' processor
time is measured beside it, and

    busy = (alternating processor time - one-rank processor time, all ranks) / messages / 2

is what a message costs each of its two ends: all of the message where ranks spin
while they wait, a part of it where they nap (ranks that outnumber the cores: 45 of
125 us on 4 ranks on 2 cores here), the rest of which their cores are free for others.

A ring all-reduce's step costs more than a message: every member posts a send and a
receive, waits for both, sums or copies the chunk. So the rings are measured in the
runtime too: a chain of tiny BatchNormalizations trained data parallel over every rank,
traced. In each of its statistics rings (forward and backward, one per op) the member
that comes last spends only the ring's own time in it (the others wait for it there
too), so

    ring step = median over rings of (the least time a member spends in it) / (2 (ranks - 1))

(its few dozen floats take a fraction of a microsecond): 17-18 us on 2 ranks of a 2-core
VM in three probes in a row, 35 in one on a busier host. The chain's ops take
microseconds, so these rings come back to back; what a ring costs after an op's compute
is the machine's cooling (``probe_cooling.py``). The probe this replaced took the
difference of two steps, data-parallel and on one rank, over its rings: 10-15 us a step
here, and its figure moved by 2x from probe to probe, and with it every data-parallel
plan's prediction.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

CHAIN_OPS = 16
WIDTH = 8
BATCH = 2
STEPS = 24
RING_ROWS = 2  # the norm chain's samples per rank: its ops take microseconds
SKIPPED = 3  # the first steps make buffers and settle the heap
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
    names = [f"h{i}" for i in range(CHAIN_OPS)] + ["logits"]
    nodes = [
        helper.make_node("Relu", [a], [b], name=f"relu{i}")
        for i, (a, b) in enumerate(itertools.pairwise(names))
    ]
    return chain_of(folder, "chain", nodes, WIDTH, BATCH)


def chain_of(folder: Path, name: str, nodes, width: int, batch: int, params=(), opset=17):
    """The model of ``nodes`` from h0 [batch, width] to logits [batch, width]
    (cross-entropy attached), saved in ``folder`` and imported."""
    from onnx2soap.importer import load_model

    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("h0", onnx.TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", width])],
        list(params),
    )
    path = folder / f"{name}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return load_model(path, batch=batch)


def norm_chain_model(folder: Path, ranks: int):
    """x [RING_ROWS per rank, WIDTH] -> CHAIN_OPS BatchNormalizations in training mode ->
    logits (cross-entropy attached)."""
    from onnx import numpy_helper

    names = [f"h{i}" for i in range(CHAIN_OPS)] + ["logits"]
    nodes, params = [], []
    for i, (a, b) in enumerate(itertools.pairwise(names)):
        inputs = [f"{role}{i}" for role in ("scale", "bias", "mean", "var")]
        params += [
            numpy_helper.from_array(np.full(WIDTH, value, np.float32), name)
            for name, value in zip(inputs, (1.0, 0.0, 0.0, 1.0), strict=True)
        ]
        outputs = [b, f"running_mean{i}", f"running_var{i}"]
        nodes.append(
            helper.make_node(
                "BatchNormalization", [a, *inputs], outputs, name=f"bn{i}", training_mode=1
            )
        )
    return chain_of(folder, "norm_chain", nodes, WIDTH, RING_ROWS * ranks, params, opset=15)


def whole_ops_plan(graph, devices: int, device_of: Callable[[int], int]):
    """Every op whole, op ``i`` on device ``device_of(i)``: the probes' chains."""
    from onnx2soap.soap import Partitioner, Strategy, analyze
    from onnx2soap.soap.partition import ParallelConfig

    space = analyze(graph)
    configs = {
        op.name: ParallelConfig((1,) * len(space[op.name]), (device_of(i),))
        for i, op in enumerate(graph.ops)
    }
    return Partitioner(graph).partition(Strategy(devices, configs))


def _plan(graph, devices: int, peer: int):
    """Every op whole; on rank 0, or (``peer`` > 0) alternating between 0 and ``peer``."""
    return whole_ops_plan(graph, devices, lambda i: peer if i % 2 else 0)


def _data_parallel(graph, devices: int):
    """Every op split by samples over every rank."""
    from onnx2soap.search.baselines import data_parallel
    from onnx2soap.soap import Partitioner, analyze

    return Partitioner(graph).partition(data_parallel(graph, analyze(graph), devices))


@dataclass(frozen=True)
class StepFigures:
    """A plan's step on the probe's ranks: the median step (the slowest rank's),
    the median processor time all ranks spent in it, and the rank's program."""

    seconds: float
    processor: float
    program: object  # executor.program.Program
    # traced: this rank's statistics rings, (name, step) -> seconds in the ring
    rings: dict[tuple[str, int], float] = field(default_factory=dict)


def _step_seconds(comm, model, pg, nap: bool, traced: bool = False) -> StepFigures:
    """Trains ``pg`` for ``STEPS`` steps at learning rate 0 on the probe's ranks;
    ``traced``: with the executor's tracer, keeping the statistics rings' times."""
    from mpi4py import MPI

    from executor.data import SyntheticData, rows_needed
    from executor.device import CpuDevice
    from executor.doorbell import Doorbell
    from executor.host_memory import release_python_heap, settle_python_heap
    from executor.program import compile_program
    from executor.runtime import Runtime
    from executor.trace import Tracer
    from executor.transport import MpiTransport, wait_patiently

    graph, rank, dtype = model.graph, comm.Get_rank(), np.dtype(np.float32)
    program = compile_program(pg, rank)
    device = CpuDevice()
    values = {**model.weights, **model.state}
    bell = Doorbell.open(comm) if nap else None  # as the executor waits
    transport = MpiTransport(comm, device, nap=nap, bell=bell)
    rt = Runtime(pg, program, transport, values, dtype, model.constants, device=device)
    if traced:
        rt.tracer = Tracer(rank, pg, device, traced_steps=STEPS)
    data, rows = SyntheticData(graph, 0, dtype), rows_needed(pg, rank)
    times, cpu = [], []
    try:
        for step in range(1, STEPS + 1):
            batch = data.batch(step, rows)
            wait_patiently(comm.Ibarrier().Test, nap=nap)  # ranks start a step together
            if rt.tracer is not None:
                rt.tracer.begin_step(step)
            start, processor = time.perf_counter(), time.process_time()
            rt.step(batch, 0.0)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - processor)
            if rt.tracer is not None:
                rt.tracer.end_step()
            if step == 1:  # as the executor's steps run: see settle_python_heap
                settle_python_heap()
    finally:
        release_python_heap()
    transport.close()
    if bell is not None:
        bell.close()
    slowest, spent = np.empty(STEPS), np.empty(STEPS)
    comm.Allreduce(np.array(times), slowest, op=MPI.MAX)
    comm.Allreduce(np.array(cpu), spent, op=MPI.SUM)
    return StepFigures(
        statistics.median(slowest[SKIPPED:].tolist()),
        statistics.median(spent[SKIPPED:].tolist()),
        program,
        {} if rt.tracer is None else _statistics_rings(rt.tracer.records),
    )


def _statistics_rings(records) -> dict[tuple[str, int], float]:
    """The traced statistics rings of the steps after ``SKIPPED``: (name, step) -> the
    seconds this rank spent in the ring (the tracer counts steps from 1)."""
    return {
        (name, step): seconds
        for name, _, _, seconds, step in records
        if name.startswith("stats ") and step > SKIPPED
    }


def message_costs(comm, nap: bool, rounds: int = ROUNDS) -> list[MessageCost]:
    """Per peer of rank 0 (every rank calls this), what a message between rank 0 and
    that peer costs a step and each of its ends, the medians over ``rounds`` rounds;
    empty on one rank."""
    with tempfile.TemporaryDirectory() as folder:
        model = chain_model(Path(folder)) if comm.Get_rank() == 0 else None
    model = comm.bcast(model, root=0)
    if comm.Get_size() == 1:
        return []
    from executor.program import Send

    peers = range(1, comm.Get_size())
    seconds: list[list[float]] = [[] for _ in peers]
    busy: list[list[float]] = [[] for _ in peers]
    size, graph = comm.Get_size(), model.graph
    for _ in range(rounds):
        alone = _step_seconds(comm, model, _plan(graph, size, 0), nap)  # one for every peer
        for i, peer in enumerate(peers):
            apart = _step_seconds(comm, model, _plan(graph, size, peer), nap)
            sends = sum(isinstance(x, Send) for x in apart.program.instructions)
            messages = comm.allreduce(sends)
            seconds[i].append(max(apart.seconds - alone.seconds, 0.0) / messages)
            busy[i].append(max(apart.processor - alone.processor, 0.0) / messages / 2)
    return [
        MessageCost(statistics.median(s), statistics.median(b))
        for s, b in zip(seconds, busy, strict=True)
    ]


def ring_step_seconds(comm, nap: bool, rounds: int = ROUNDS) -> float | None:
    """What one step of a ring all-reduce over every rank costs a step of the runtime
    (every rank calls this): the median over ``rounds`` traced runs' statistics rings of
    the least time a member spent in the ring, per ring step; None on one rank."""
    size = comm.Get_size()
    with tempfile.TemporaryDirectory() as folder:
        model = norm_chain_model(Path(folder), size) if comm.Get_rank() == 0 else None
    model = comm.bcast(model, root=0)
    if size == 1:
        return None
    spread, least = _data_parallel(model.graph, size), []
    for _ in range(rounds):
        rings = comm.gather(_step_seconds(comm, model, spread, nap, traced=True).rings, root=0)
        if rings is not None:
            least += [min(rank[key] for rank in rings) for key in rings[0]]
    step = statistics.median(least) / (2 * (size - 1)) if comm.Get_rank() == 0 else None
    return comm.bcast(step, root=0)
