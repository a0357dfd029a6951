"""What a rank pays for having slept through a wait (``Machine.resume``), measured
through the executor's own runtime.

A rank that waits for a message spins, naps, and past ``SLEEPS_AFTER_S`` sleeps on its
doorbell (``executor/transport.py``); where ranks share cores, the others run on its
core meanwhile. When it comes back its first ops run several times their time (cold
caches, a core just handed over): on 4 ranks of a 2-core VM, GPT-2's first op after a
hand-off took 6-8x its time and the next few dozen 1.2-1.6x, 0.4-0.9 ms a hand-off in
all, which the messages' probe (``probe_messages.py``, whose receiver waits about one
op and never sleeps) does not see.

So a chain of small matrix products, each reading its own weight, is trained on rank 0
alone and, step by step in turn with it, handed from rank to rank in runs of ops, one
run per rank in rank order, as model parallelism splits a model: each hand-off finds
its receiver asleep for at least a run. What the hand-offs add to the measured step,
less what the simulator predicts they add without a resume (their messages, as
probed; the updates, which the ranks run at once), over the resumes the simulator
charges in that plan, is the resume's cost:

    cost = ((handed step - alone step) - (predicted handed - predicted alone)) / resumes

The median over the pairs of steps; never below zero. On this host's VM (2 vCPUs)
one figure spreads by about a factor of two from probe to probe (0.1-0.4 ms on 4
ranks): a pair of steps drifts together, but a step's own spread (a third) is several
resumes. ``machine probe`` measures it only where ranks share cores: ranks with a core
each spin while they wait and never sleep, and there the chain's figure (0.35-0.75 ms
on 2 ranks) was whatever else its few hand-offs cost, not a resume's.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from onnx import helper, numpy_helper

from onnx2soap.measure.probe_messages import BATCH, chain_of, whole_ops_plan
from onnx2soap.sim.machine import Machine, Resume

OPS = 128
PAIRS = 96  # steps of each plan, alternating (drift over seconds cancels in a pair)
SKIPPED = 3
WIDTH = 64  # a 16 KiB weight per op: a small model's layer


def matmul_chain_model(folder: Path):
    """x [BATCH, WIDTH] -> OPS MatMuls by [WIDTH, WIDTH] weights -> logits (cross-entropy
    attached)."""
    names = [f"h{i}" for i in range(OPS)] + ["logits"]
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(
            (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32), f"w{i}"
        )
        for i in range(OPS)
    ]
    nodes = [
        helper.make_node("MatMul", [a, f"w{i}"], [b], name=f"matmul{i}")
        for i, (a, b) in enumerate(itertools.pairwise(names))
    ]
    return chain_of(folder, "matmul_chain", nodes, WIDTH, BATCH, weights)


def handed_plan(graph, devices: int, handed: bool):
    """Every op whole; on rank 0, or (``handed``) in contiguous runs of ops, one per rank
    in rank order, as model parallelism splits a model."""
    count = len(graph.ops)
    return whole_ops_plan(graph, devices, lambda i: i * devices // count if handed else 0)


def predicted(machine: Machine, pg) -> float:
    """The plan's step on ``machine`` with roofline op costs: they cancel between the
    two plans (the chain runs one op at a time on either) but for the updates, which
    the handed plan's ranks run at once: a roofline error in those goes into the cost."""
    from onnx2soap.sim import RooflineCost, Simulator

    return Simulator(machine, RooflineCost()).evaluate(pg).step_time_s


def charged(machine: Machine, after: float, pg) -> int:
    """How many resumes the simulator charges the plan on the step's critical path: a
    cost small enough that each is paid in full by its device's next compute task."""
    tiny = 1e-7
    owed = replace(machine, resume=Resume(after, tiny))
    return round((predicted(owed, pg) - predicted(machine, pg)) / tiny)


def paired_steps(comm, model, plans, steps: int) -> np.ndarray:
    """Each plan's step (the slowest rank's), the plans taking turns step by step:
    ``[steps, plans]`` seconds, the ranks napping and sleeping on their bells while
    they wait, as ranks that share cores do. On this host a plan's step drifts by a
    third over seconds, more than the resumes it holds; a pair of steps a few ms apart
    drifts together."""
    from mpi4py import MPI

    from executor.crew import IDLE_NAP_S
    from executor.data import SyntheticData, rows_needed
    from executor.device import CpuDevice
    from executor.doorbell import Doorbell
    from executor.host_memory import release_python_heap, settle_python_heap
    from executor.program import compile_program
    from executor.runtime import Runtime
    from executor.transport import NAP_S, MpiTransport, wait_patiently

    graph, rank, dtype = model.graph, comm.Get_rank(), np.dtype(np.float32)
    device, values = CpuDevice(), {**model.weights, **model.state}
    comms = [comm.Dup() for _ in plans]  # a plan's messages never meet another's
    bells = [Doorbell.open(c) for c in comms]
    transports = [
        MpiTransport(c, device, nap=True, bell=bell) for c, bell in zip(comms, bells, strict=True)
    ]
    runtimes = [
        Runtime(pg, compile_program(pg, rank), t, values, dtype, model.constants, device=device)
        for pg, t in zip(plans, transports, strict=True)
    ]
    # A rank a plan leaves without work waits as the executor's idle ranks do
    # (executor/crew.py): napping 50 us at a time it takes the working ranks' cores,
    # which made the one-rank plan 1.5x slower on 4 ranks of 2 cores.
    naps = [NAP_S if rt.program.instructions else IDLE_NAP_S for rt in runtimes]
    data = SyntheticData(graph, 0, dtype)
    times = np.empty((steps + SKIPPED, len(plans)))
    try:
        for step in range(steps + SKIPPED):
            for k, (pg, rt) in enumerate(zip(plans, runtimes, strict=True)):
                batch = data.batch(step + 1, rows_needed(pg, rank))
                wait_patiently(comm.Ibarrier().Test, nap=True, nap_s=naps[k])
                start = time.perf_counter()
                rt.step(batch, 0.0)
                times[step, k] = time.perf_counter() - start
            if step == 0:
                settle_python_heap()
    finally:
        release_python_heap()
        for t in transports:
            t.close()
        for bell in bells:
            if bell is not None:  # None where the platform has no abstract sockets
                bell.close()
        for c in comms:
            c.Free()
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return slowest[SKIPPED:]


def resume_cost(comm, machine: Machine, after: float, pairs: int = PAIRS) -> Resume:
    """The machine's resume past waits of ``after`` seconds (every rank calls this, on
    two ranks or more that share cores, so napping while they wait; ``machine`` as
    probed so far, without a resume)."""
    size = comm.Get_size()
    with tempfile.TemporaryDirectory() as folder:
        model = matmul_chain_model(Path(folder)) if comm.Get_rank() == 0 else None
    model = comm.bcast(model, root=0)
    plans = handed_plan(model.graph, size, False), handed_plan(model.graph, size, True)
    resumes, extra = 0, 0.0
    if comm.Get_rank() == 0:
        extra = predicted(machine, plans[1]) - predicted(machine, plans[0])
        resumes = charged(machine, after, plans[1])
    resumes, extra = comm.bcast((resumes, extra), root=0)
    steps = paired_steps(comm, model, plans, pairs)
    if not resumes:
        return Resume(after, 0.0)
    added = float(np.median(steps[:, 1] - steps[:, 0]))
    return Resume(after, max((added - extra) / resumes, 0.0))
