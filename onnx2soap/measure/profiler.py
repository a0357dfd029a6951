"""Time a model's tasks with the executor's kernels (``onnx2soap profile``, under mpiexec).

    mpiexec -n N python -m onnx2soap.measure.profiler MODEL --batch B --devices D --db FILE

What is timed: for every op, every candidate config the search may choose on D devices
(``soap/candidates.py``), every task of it (``Partitioner.tasks``), one timing per
distinct ``cost_key`` and phase; plus the SGD update of every weight shard size those
configs make. A timing is the median of the repeats after a warm-up call, of the kernels
as the executor calls them: buffers cut as ``executor/buffers.py`` cuts them (the pad
value where a window reads past the tensor), ``TaskArgs`` as the runtime fixes them, a
random key (Dropout drops), and for ops with statistics their partial half, the combine
and the finishing half together (the simulator splits the phase in two).

Then the in-step calibration: every rank runs the executor's own runtime in-process on the
one-device plan (all its tasks are among those timed), on a communicator of its own and on
the profiled kind of device (under ``--device cuda``, the GPU the executor would give the
rank; the tracer then waits for each instruction's kernels, and the untraced steps, whose
launches overlap, scale the sum), with the executor's tracer timing each instruction as
``--trace`` does, for a second of clean steps (after the one tracemalloc slows), then as
many steps untraced. A task's time in a step is that of its instructions (a statistics op
has three), each counted from the end of the one before it, so the runtime's dispatch
between instructions is in it; per task the median over the traced steps, scaled so the
tasks add up to the median untraced step (what a run pays, without the tracer's own time);
per key the mean over its tasks and over the ranks, stored next to the isolated timing
(``InStep``). A profile that finds every task of that plan calibrated skips it.

The N ranks time at once, each its share, so every timing sees the others computing (as
the executor's ranks do); one BLAS thread per rank. Rank 0 reads which keys the database
already holds (they are skipped: a profile resumes), and after every round stores the
round's timings in one transaction, so an interrupted profile loses at most a round.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from executor.buffers import empty_buffer, local_slices  # the executor's cut, not a copy
from executor.trace import MEMORY_STEP
from onnx2soap.errors import UserError
from onnx2soap.importer import load_model
from onnx2soap.ir import Graph, LossKind, Op, TensorRole
from onnx2soap.measure.cost_writer import CostWriter
from onnx2soap.ops import TaskArgs, definition
from onnx2soap.ops.base import RandomKey
from onnx2soap.sim.calibration_plan import (
    Traced,
    calibration_keys,
    calibration_plan,
    one_device_keys,
)
from onnx2soap.sim.costdb import (
    CostDB,
    DeviceKind,
    InStep,
    Phase,
    Timing,
    cost_key,
    host_fingerprint,
    update_key,
)
from onnx2soap.sim.costs import task_bytes, task_flops
from onnx2soap.soap import Partitioner, analyze
from onnx2soap.soap.candidates import candidates
from onnx2soap.soap.partition import ParallelConfig, Task, rect_shape, rect_volume

MASK_BOUND = 2  # ids no op bounds are drawn in [0, 2), as the executor's synthetic data
ROUND_ITEMS = 4  # timings per rank between two commits
# SGD's multiply by the learning rate, by 1 so that repeats never reach denormals (which
# are slow on CPUs); the cost of the multiply is the same.
LR = 1.0
# The calibration's clean steps (step 1 warms up, tracemalloc slows step 2): enough for a
# second at least. A burst of the host's noise lasting 100 ms then moves the median of
# many steps little; over nine (60 ms of GPT-2's) it moved the whole calibration, and
# the profile's prediction of the one-device step by up to 40 % from one profile to the
# next.
CALIBRATION_SECONDS = 1.0
MIN_CLEAN_STEPS, MAX_CLEAN_STEPS = 9, 500
CALIBRATION_LR = 1e-3  # small: the weights stay where the synthetic data keeps them finite


@dataclass(frozen=True)
class Item:
    """One timing to take: a task of one op under one config, or an SGD update."""

    phase: Phase
    key: str
    op_type: str
    flops: float
    nbytes: float
    op: int = -1  # the op's index in the graph (-1: an update)
    config: ParallelConfig | None = None
    task: int = 0
    numel: int = 0  # an update's element count


def _shapes(graph: Graph, op: Op) -> list[tuple[int, ...]]:
    return [graph.tensors[t].shape for t in op.inputs]


def _configs(graph: Graph, devices: int) -> Iterator[tuple[int, Op, ParallelConfig]]:
    """Every op's candidate configs, one per degree vector (placement does not change a
    task's shapes)."""
    space = analyze(graph)
    for index, op in enumerate(graph.ops):
        seen = set()
        for config in candidates(space[op.name], devices):
            if config.degrees not in seen:
                seen.add(config.degrees)
                yield index, op, config


def profile_items(graph: Graph, devices: int, itemsize: int) -> list[Item]:
    """What to time for ``graph`` on ``devices`` devices: distinct keys, each once."""
    partitioner, items, seen = Partitioner(graph), [], set()
    shards: set[int] = set()
    for index, op, config in _configs(graph, devices):
        backward = graph.differentiable(op.output)  # ids: the executor runs no backward
        for task in partitioner.tasks(op, config):
            key = cost_key(op, task)
            flops, nbytes = task_flops(op, task), task_bytes(task, itemsize)
            phases = [(Phase.FORWARD, 1)] + [(Phase.BACKWARD, 2)] * backward
            for phase, factor in phases:  # the backward counted as RooflineCost counts it
                if (phase, key) not in seen:
                    seen.add((phase, key))
                    items.append(
                        Item(
                            phase,
                            key,
                            op.type,
                            flops * factor,
                            nbytes * factor,
                            index,
                            config,
                            task.index,
                        )
                    )
            for k, name in enumerate(op.inputs):
                if graph.tensors[name].role is TensorRole.WEIGHT:
                    shards.add(rect_volume(task.inputs[k].data))
    for numel in sorted(shards):
        items.append(
            Item(
                Phase.UPDATE, update_key(numel), "SGD", 2 * numel, 3 * numel * itemsize, numel=numel
            )
        )
    return items


# --- one timing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernels:
    """Where and how to run: numpy or cupy, the float dtype, how to wait for the device."""

    xp: object
    dtype: np.dtype
    sync: Callable[[], None]


@dataclass(frozen=True)
class Target:
    """What a rank times: the graph, its partitioner (tasks memoized per config), where."""

    graph: Graph
    partitioner: Partitioner
    kernels: Kernels


def numpy_kernels(dtype: np.dtype) -> Kernels:
    return Kernels(np, np.dtype(dtype), lambda: None)


def cuda_kernels(dtype: np.dtype, rank: int) -> Kernels:
    """Rank r on GPU r mod the visible GPUs, as the executor places ranks."""
    try:
        import cupy
    except ImportError as e:
        raise UserError("--device cuda needs CuPy (pip install .[gpu])") from e
    count = cupy.cuda.runtime.getDeviceCount()
    if count < 1:
        raise UserError("--device cuda: no GPU visible")
    cupy.cuda.Device(rank % count).use()
    return Kernels(cupy, np.dtype(dtype), lambda: cupy.cuda.Device().synchronize())


def _bound(graph: Graph, op: Op, k: int) -> int:
    d = definition(op.type)
    bound = d.id_bound(op, k, graph.tensors) if d.id_bound is not None else None
    return MASK_BOUND if bound is None else max(int(bound), 1)


def _buffers(graph: Graph, op: Op, task: Task, kernels: Kernels, seed: int) -> list:
    """The task's input buffers: random data where the tensor is, the pad value around it."""
    rng = np.random.default_rng(seed)
    out = []
    for k, (name, region) in enumerate(zip(op.inputs, task.inputs, strict=True)):
        t = graph.tensors[name]
        dtype = kernels.dtype if t.dtype.is_float else np.dtype(np.int64)
        buf = empty_buffer(np, region, dtype)
        shape = rect_shape(region.data)
        if t.dtype.is_float:
            values = rng.standard_normal(shape).astype(dtype)
        else:
            values = rng.integers(0, _bound(graph, op, k), size=shape, dtype=np.int64)
        buf[local_slices(region.data, region.buffer)] = values
        out.append(kernels.xp.asarray(buf))
    return out


def _args(graph: Graph, op: Op, index: int, task: Task, dtype: np.dtype) -> TaskArgs:
    """As the runtime fixes them (executor/runtime.py ``_fixed_args``), with a random key."""
    return TaskArgs(
        out_shape=rect_shape(task.output),
        valid=tuple(r.valid for r in task.inputs),
        origin=tuple(lo for lo, _ in task.output),
        full_shape=graph.tensors[op.output].shape,
        float_dtype=dtype,
        box=task.box,
        random=RandomKey(0, 0, index),
    )


def _phases(target: Target, item: Item) -> Callable[[], None]:
    """The call to time for a task item: its forward, or its backward (the forward run
    once before, untimed, for the output and statistics the backward reads)."""
    graph, kernels = target.graph, target.kernels
    xp, op = kernels.xp, graph.ops[item.op]
    task = target.partitioner.tasks(op, item.config)[item.task]
    d = definition(op.type)
    bufs = _buffers(graph, op, task, kernels, seed=item.op)
    args = _args(graph, op, item.op, task, kernels.dtype)
    stats = d.statistics

    def forward():
        a = args
        if stats is not None:  # partial half, combine (one task's share), finishing half
            partial = xp.ascontiguousarray(stats.forward(xp, op.attrs, bufs, a), kernels.dtype)
            a = replace(a, stats=stats.combine_forward(xp, partial[None]))
            out = d.forward(xp, op.attrs, bufs, a)
            stats.update(xp, op.attrs, bufs, a)
            return out, a
        return d.forward(xp, op.attrs, bufs, a), a

    if item.phase is Phase.FORWARD:
        return lambda: forward()
    out, fargs = forward()
    grad = xp.ones((), kernels.dtype) if op.is_loss else xp.ones_like(out)

    def backward():
        a = fargs
        if stats is not None:
            partial = stats.backward(xp, op.attrs, bufs, out, grad, a)
            partial = xp.ascontiguousarray(partial, kernels.dtype)
            a = replace(a, grad_stats=stats.combine_backward(xp, partial[None]))
        d.backward(xp, op.attrs, bufs, out, grad, a)

    return backward


def _update(item: Item, kernels: Kernels) -> Callable[[], None]:
    """SGD as the executor applies it (executor/optim.py): grad *= lr; param -= grad."""
    xp = kernels.xp
    param = xp.ones(item.numel, kernels.dtype)
    grad = xp.full(item.numel, 0.5, kernels.dtype)

    def step() -> None:
        grad.__imul__(LR)
        param.__isub__(grad)

    return step


def time_call(run: Callable[[], object], kernels: Kernels, repeat: int, min_s: float) -> float:
    """Median seconds of ``run`` over at least ``repeat`` calls and ``min_s`` seconds,
    after one warm-up call (buffers allocated, caches and BLAS warmed)."""
    run()
    kernels.sync()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < repeat or (time.perf_counter() - began < min_s and len(times) < 1000):
        start = time.perf_counter()
        run()
        kernels.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(target: Target, item: Item, repeat: int, min_s: float) -> Timing:
    update = item.phase is Phase.UPDATE
    run = _update(item, target.kernels) if update else _phases(target, item)
    seconds = time_call(run, target.kernels, repeat, min_s)
    return Timing(item.phase, item.key, item.op_type, item.flops, item.nbytes, seconds)


# --- in the executor's step -----------------------------------------------------------------


def clean_steps(step_seconds: float) -> int:
    """How many clean steps calibrate: ``CALIBRATION_SECONDS`` of them, within bounds."""
    wanted = math.ceil(CALIBRATION_SECONDS / max(step_seconds, 1e-9))
    return min(MAX_CLEAN_STEPS, max(MIN_CLEAN_STEPS, wanted))


def timing_weights(graph) -> dict[str, np.ndarray]:
    """Values for the calibration's weights and state. A kernel's time does not depend on
    them, so the model's weight bytes are never read: small random weights keep every op
    finite, and state (running statistics, which training mode only updates) is ones."""
    rng = np.random.default_rng(0)
    weights = {t.name: rng.uniform(-0.05, 0.05, t.shape) for t in graph.weights}
    return {**weights, **{t.name: np.ones(t.shape) for t in graph.states}}


def in_step_times(
    model, dtype: np.dtype, comm=None, kind: DeviceKind = DeviceKind.CPU
) -> dict[tuple[Phase, str], float]:
    """Seconds of every task of the one-device plan inside the executor's step on this
    rank, per key (see ``_in_step_seconds``), on a device of ``kind`` (a GPU: the one
    ``python -m executor`` gives this rank). Ranks calibrating at once pass their
    communicator: they agree on the number of steps, so each runs all of them beside the
    others."""
    from mpi4py import MPI

    from executor.data import SyntheticData, rows_needed
    from executor.device import open_device
    from executor.host_memory import release_python_heap, settle_python_heap
    from executor.program import compile_program
    from executor.runtime import Runtime
    from executor.trace import Tracer
    from executor.transport import MpiTransport

    graph = model.graph
    pg = calibration_plan(graph)
    device = open_device(kind, comm if comm is not None else MPI.COMM_SELF)
    # As the executor makes it: before the runtime. Tracing every step run (on a GPU the
    # tracer waits for each instruction's kernels; the untraced steps scale the sum).
    tracer = Tracer(0, pg, device, traced_steps=1 + MAX_CLEAN_STEPS)
    rt = Runtime(
        pg,
        compile_program(pg, 0),
        # One device: no transfers; staged on a GPU, as the transport a shared GPU gets.
        MpiTransport(MPI.COMM_SELF, device, staged=kind is DeviceKind.CUDA),
        timing_weights(graph),
        dtype,
        model.constants,
        device=device,
    )
    rt.tracer = tracer
    data, rows = SyntheticData(graph, 0, dtype), rows_needed(pg, 0)

    def run(step: int) -> float:
        batch = data.batch(step, rows)
        began = time.perf_counter()
        tracer.begin_step(step)
        rt.step(batch, CALIBRATION_LR)
        tracer.end_step()
        return time.perf_counter() - began

    try:
        run(1)
        settle_python_heap()  # as the executor's steps run: see settle_python_heap
        run(MEMORY_STEP)
        seconds = run(MEMORY_STEP + 1)
        if comm is not None:
            seconds = comm.allreduce(seconds, op=MPI.MAX)
        clean = clean_steps(seconds)
        for step in range(MEMORY_STEP + 2, MEMORY_STEP + 1 + clean):
            run(step)
        # As many steps again past the tracer's window: the step a user's run takes.
        untraced_from = MEMORY_STEP + 1 + tracer.traced_steps
        untraced = [run(step) for step in range(untraced_from, untraced_from + clean)]
    finally:
        release_python_heap()
    return _in_step_seconds(tracer.events, calibration_keys(graph, pg), statistics.median(untraced))


def _in_step_seconds(events: list[dict], names: dict[str, Traced], step_seconds: float) -> dict:
    """Per key, the in-step seconds of its tasks: per traced clean step, each task's
    share of the step, then the median over the steps, and the mean over the tasks of
    one key.

    An instruction's seconds run from the end of the one before it (the step's start for
    the first) to its own end: the runtime's dispatch between two timed instructions is
    part of what a step pays per instruction. A task's instructions (a statistics op has
    three) add up. The medians are scaled to ``step_seconds``, the median untraced step,
    each in proportion to its time, so the calibration plan's step is what the sum
    predicts: a step is longer than the sum of its tasks' medians (3-5 % on resnet18
    here: each step the host interrupts some instruction or other), and the tracer's
    own time per instruction is no part of a run without ``--trace``."""
    steps: dict[int, list[dict]] = {}
    for e in events:
        if e["args"]["step"] > MEMORY_STEP:  # it ran under tracemalloc
            steps.setdefault(e["args"]["step"], []).append(e)
    by_task: dict[str, list[float]] = {}  # an instruction outside the tasks: by its name
    for step_events in steps.values():
        per_step: dict[str, float] = {}
        last = 0.0
        for e in sorted(step_events, key=lambda e: e["ts"]):
            end = e["ts"] + e["dur"]
            traced = names.get(e["name"])
            task = traced.task if traced is not None else e["name"]
            per_step[task] = per_step.get(task, 0.0) + (end - last) * 1e-6
            last = end
        for task, seconds in per_step.items():
            by_task.setdefault(task, []).append(seconds)
    medians = {task: statistics.median(times) for task, times in by_task.items()}
    skew = step_seconds / sum(medians.values()) if medians else 1.0
    keys = {t.task: t.key for t in names.values()}
    by_key: dict[tuple[Phase, str], list[float]] = {}
    for task, seconds in medians.items():
        if task in keys:  # updates and ops of one key: their mean
            by_key.setdefault(keys[task], []).append(seconds * skew)
    return {key: statistics.fmean(values) for key, values in by_key.items()}


def _calibrated(db_path: Path, fp, graph: Graph) -> bool:
    """Rank 0: whether every task of the one-device plan has its in-step time."""
    wanted = one_device_keys(graph)
    with CostDB.open(db_path) as db:
        fp_id = db.find(fp)
        have = {(p.phase, p.key) for p in db.in_step(fp_id)} if fp_id is not None else set()
    return wanted <= have


def calibrate_ranks(
    comm, model, dtype: np.dtype, db: CostWriter | None, fp_id: int, kind: DeviceKind
) -> int:
    """Every rank at once (so each sees the others busy, as in a run); rank 0 stores the
    mean over the ranks. Returns how many in-step times were stored."""
    times = comm.gather(in_step_times(model, dtype, comm, kind), root=0)
    if db is None:
        return 0
    points = [
        InStep(phase, key, statistics.fmean(t[(phase, key)] for t in times))
        for phase, key in sorted(times[0], key=lambda k: (k[0].value, k[1]))
    ]
    db.add_in_step(fp_id, points)
    return len(points)


# --- under mpiexec ---------------------------------------------------------------------------


def _todo(db_path: Path, fp, items: list[Item], fresh: bool) -> tuple[int, list[Item]]:
    """Rank 0: the fingerprint's id and the items the database does not hold yet (all
    of them when ``fresh``), the largest first (so rounds of equal items keep the ranks
    equally busy)."""
    with CostWriter.open(db_path) as db:
        fp_id = db.add_fingerprint(fp)
        done = db.keys(fp_id)
    todo = [x for x in items if fresh or (x.phase, x.key) not in done]
    todo.sort(key=lambda x: x.flops + x.nbytes, reverse=True)
    return fp_id, todo


def run_ranks(comm, args: argparse.Namespace) -> dict:
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    kind = DeviceKind(args.device)
    kernels = numpy_kernels(dtype) if kind is DeviceKind.CPU else cuda_kernels(dtype, rank)
    loss = LossKind(args.loss) if args.loss else None
    model = load_model(args.model, args.batch, loss)
    graph = model.graph
    fp = host_fingerprint(kind, dtype.name)
    plan: tuple | str | None = None
    if rank == 0:
        try:
            items = profile_items(graph, args.devices, dtype.itemsize)
            fp_id, todo = _todo(Path(args.db), fp, items, args.fresh)
            calibrated = not args.fresh and _calibrated(Path(args.db), fp, graph)
            plan = (fp_id, todo, len(items), calibrated)
        except UserError as e:  # told to every rank, so none waits for ever
            plan = str(e)
    plan = comm.bcast(plan, root=0)
    if isinstance(plan, str):
        raise UserError(plan)
    fp_id, todo, total, calibrated = plan
    target = Target(graph, Partitioner(graph), kernels)
    mine = todo[rank::size]
    rounds = -(-len(todo) // (size * ROUND_ITEMS)) if todo else 0
    done, began, shown = 0, time.perf_counter(), 0.0
    db = CostWriter.open(Path(args.db)) if rank == 0 else None
    try:
        for r in range(rounds):
            batch = mine[r * ROUND_ITEMS : (r + 1) * ROUND_ITEMS]
            timed = [
                replace(measure(target, x, args.repeat, args.min_time), ranks=size) for x in batch
            ]
            gathered = comm.gather(timed, root=0)
            if rank == 0:
                flat = [t for part in gathered for t in part]
                db.add(fp_id, flat)
                done += len(flat)
                now = time.perf_counter() - began
                if now - shown >= args.progress_every or done == len(todo):
                    shown = now
                    print(
                        f"progress: {done}/{len(todo)} timings, {now:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
        in_step = 0 if calibrated else calibrate_ranks(comm, model, dtype, db, fp_id, kind)
    finally:
        if db is not None:
            db.close()
    return {
        "keys": total,
        "measured": len(todo),
        "skipped": total - len(todo),
        "in_step": in_step,
        "ranks": size,
        "seconds": time.perf_counter() - began,
        "fingerprint": fp.describe(),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m onnx2soap.measure.profiler")
    p.add_argument("model")
    p.add_argument("--batch", type=int)
    p.add_argument("--loss")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--device", choices=[k.value for k in DeviceKind], default="cpu")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.01)
    p.add_argument("--progress-every", type=float, default=1.0)
    p.add_argument("--fresh", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from mpi4py import MPI

    from executor.host_memory import keep_freed_memory

    comm = MPI.COMM_WORLD
    args = parse_args(argv)
    keep_freed_memory()  # the executor's allocator settings: kernels timed as they run
    try:
        summary = run_ranks(comm, args)
    except UserError as e:
        # Every rank raises the same error after the broadcast; one that fails alone
        # (its GPU) must not leave the others waiting: abort them.
        print(f"error: {e}", file=sys.stderr, flush=True)
        if comm.Get_size() > 1:
            comm.Abort(2)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    if comm.Get_rank() == 0:
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
