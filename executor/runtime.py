"""Run one rank's program: a training step = forward, backward, all-reduce, SGD update.

The rank holds only what its tasks need: the weight Rects they read (one copy per Rect,
shared by the rank's tasks of a replica group), the data rows they read, their input
buffers, output tiles and gradients. What it moves, and where to, comes from the
compiled program.

Everything that can be is made once, before the first step (executor/layout.py): input
buffers with their padding, receive buffers, gradient accumulators, statistics slots,
the kernels' fixed arguments. A step then fills those buffers, calls the kernels (whose
results cupy takes from its memory pool) and moves tiles; on a GPU the host waits for
nothing but the loss at the end of the step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import numpy as np

from executor.buffers import global_slices, local_slices
from executor.device import CpuDevice, Device
from executor.layout import (
    Alias,
    Copy,
    Fixed,
    GradAlias,
    GradSum,
    InputSource,
    Rows,
    TaskKey,
    grad_source,
    input_source,
)
from executor.optim import OptimizerConfig, apply_update
from executor.program import (
    AllReduce,
    Compute,
    Partial,
    Phase,
    Program,
    Recv,
    ReduceStats,
    Send,
    ShareGrad,
    SumOutputs,
    Transfer,
    Wait,
)
from executor.trace import Tracer, task_name
from executor.transport import Transport
from onnx2soap.ir import Graph, TensorRole
from onnx2soap.ops import TaskArgs, definition
from onnx2soap.ops.base import RandomKey
from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.partition import Rect, Task, owners, rect_shape

WeightKey = tuple[str, Rect]


@dataclass(frozen=True)
class Batch:
    """One step's data on one rank: for every data input by name (floats already in the
    run's dtype, ids int64) and for the labels, the rows from ``first_row[name]`` on
    that this rank's tasks read (all rows when ``first_row`` lacks the name)."""

    inputs: Mapping[str, np.ndarray]
    labels: np.ndarray
    step: int = 0  # numbers the random ops' draws
    first_row: Mapping[str, int] = field(default_factory=dict)
    loss_scale: float | None = None  # a mean loss's divisor over the whole batch

    def rows(self, name: str, labels_name: str | None) -> tuple[np.ndarray, int]:
        held = self.labels if name == labels_name else self.inputs[name]
        return held, self.first_row.get(name, 0)


def loss_scale(graph: Graph, labels: np.ndarray) -> float:
    """The divisor of a mean loss over the whole batch (each kernel sees only its part)."""
    loss = graph.loss_op
    scale = definition(loss.type).loss_scale
    return scale(loss.attrs, labels, graph.tensors[loss.inputs[0]].shape)


class Runtime:
    def __init__(
        self,
        pg: PartitionedGraph,
        program: Program,
        transport: Transport,
        weights: dict[str, np.ndarray],
        dtype: np.dtype,
        constants: dict[str, np.ndarray] | None = None,
        seed: int = 0,
        device: Device | None = None,
        optimizer: OptimizerConfig | None = None,
    ) -> None:
        """``weights`` holds the initial values of the weights and of the state tensors."""
        self.pg, self.graph, self.program = pg, pg.graph, program
        self.transport, self.dtype, self.rank = transport, np.dtype(dtype), program.rank
        self.device = device or CpuDevice()
        self.xp = self.device.xp
        self.seed = seed
        self.optimizer = optimizer or OptimizerConfig()
        self.tracer: Tracer | None = None  # set to time every instruction (--trace)
        self.updates = 0  # optimizer steps taken (Adam's bias correction counts them)
        self.tasks = [pg.tasks[op.name] for op in self.graph.ops]
        self.roles = [[self.graph.tensors[t].role for t in op.inputs] for op in self.graph.ops]
        self.shards: dict[WeightKey, object] = {}
        self.trainable: set[WeightKey] = set()
        for op in self.graph.ops:
            for group in pg.groups[op.name]:
                if self.rank in group.devices:
                    part = weights[group.weight][global_slices(group.rect)]
                    key = (group.weight, group.rect)
                    host = np.ascontiguousarray(part, dtype=self.dtype)
                    with self.device.compute():
                        self.shards[key] = self.device.to_device(host)
                    if group.trainable:
                        self.trainable.add(key)
        # Constants are small (scalars, broadcast vectors): every rank holds them whole,
        # floats in the run's dtype, ids int64.
        with self.device.compute():
            self.constants = {
                name: self.device.to_device(np.asarray(value, dtype=self.dtype_of(name)))
                for name, value in (constants or {}).items()
            }
        transport.make_groups(
            g.devices
            for op in self.graph.ops
            for g in pg.groups[op.name]
            if g.trainable and len(g.devices) > 1
        )
        transport.make_groups(
            g.devices
            for op in self.graph.ops
            for g in (*pg.stats[op.name], *pg.sums[op.name])
            if len(g.devices) > 1
        )
        # On a GPU, made on the compute stream that uses them (a non-blocking stream
        # does not wait for the default one), and complete before the first step.
        with self.device.compute():
            self.buffers = _Buffers(self)
            # The optimizer's state, shaped and sharded like each trainable shard.
            self.slots = {
                key: {name: self.xp.zeros_like(self.shards[key]) for name in self.optimizer.slots}
                for key in self.trainable
            }
        self.device.synchronize()

    def dtype_of(self, tensor: str) -> np.dtype:
        """Float tensors in the run's dtype; ids stay int64."""
        return self.dtype if self.graph.differentiable(tensor) else np.dtype(np.int64)

    def task(self, key: TaskKey) -> Task:
        return self.tasks[key[0]][key[1]]

    def forward(self, batch: Batch) -> dict[tuple[str, int], np.ndarray]:
        """Only the forward phase; the output tile (on the host) of every local task that
        owns one, by (op, task) (a partial sum is no tile)."""
        return self.evaluate(batch)[1]

    def evaluate(
        self, batch: Batch, ops: set[str] | None = None
    ) -> tuple[float, dict[tuple[str, int], np.ndarray]]:
        """The forward phase without training (no Dropout, no statistics updates): the
        sum of this rank's partial losses, and the owned output tiles (on the host) of
        ``ops`` (every op when None), by (op, task)."""
        state = _Step(self, batch, training=False)
        with self.device.compute():
            self._run(state, self.buffers.forward_program)
            self.transport.end_step()
            loss = state.loss()
        self.device.synchronize()  # staged copies finish before their buffers are reused
        names = [op.name for op in self.graph.ops]
        owned = {
            (i, t.index) for i, op in enumerate(self.graph.ops) for t in owners(op, self.tasks[i])
        }
        tiles = {
            (names[op], task): self.device.to_host(tile)
            for (op, task), tile in state.outputs.items()
            if (op, task) in owned and (ops is None or names[op] in ops)
        }
        return loss, tiles

    def step(self, batch: Batch, lr: float) -> float:
        """Run one training step at learning rate ``lr``; returns the sum of this rank's
        partial losses."""
        state = _Step(self, batch, training=True)
        with self.device.compute():
            for grad in self.buffers.grads.values():
                grad.fill(0)
            self._run(state, self.program.instructions)
            tracing = self.tracer is not None and self.tracer.active
            with self._timed("wait allreduce", "allreduce") if tracing else nullcontext():
                for pending in state.reductions:  # every gradient is summed before the update
                    self.transport.wait(pending)
                self.transport.end_step()
            self.updates += 1
            for key, grad in self.buffers.grads.items():
                shard, slots = self.shards[key], self.slots[key]
                with self._timed(f"update {key[0]}", "update") if tracing else nullcontext():
                    apply_update(self.xp, self.optimizer, shard, grad, slots, lr, self.updates)
            loss = state.loss()
        self.device.synchronize()
        return loss

    def _run(self, state: _Step, instructions) -> None:
        # Local, not on the step: bound methods held by the step would make it a cycle
        # that keeps a step's arrays alive until the garbage collector runs.
        dispatch = state.dispatch()
        if self.tracer is None or not self.tracer.active:
            for ins in instructions:
                dispatch[type(ins)](ins)
            return
        for ins in instructions:
            with self._timed(*task_name(self.pg, ins)):
                dispatch[type(ins)](ins)

    @contextmanager
    def _timed(self, name: str, kind: str):
        """Time one task for the trace: on a GPU, until the device has done it."""
        start = time.perf_counter()
        yield
        self.device.synchronize()
        self.tracer.record(name, kind, start, time.perf_counter())


class _Buffers:
    """What a rank's steps reuse: made once, from the program."""

    def __init__(self, rt: Runtime) -> None:
        xp = rt.xp
        self.forward_program = tuple(
            ins for ins in rt.program.instructions if _phase(ins) is Phase.FORWARD
        )
        self.grads = {k: xp.zeros_like(v) for k, v in rt.shards.items() if k in rt.trainable}
        self.received = {
            t.id: xp.empty(rect_shape(t.rect), dtype=rt.dtype_of(_tensor(rt, t)))
            for t in rt.program.receives
        }
        self.inputs: dict[TaskKey, tuple[InputSource, ...]] = {}
        self.grad_outputs: dict[TaskKey, GradAlias | GradSum] = {}
        self.args: dict[TaskKey, TaskArgs] = {}
        self.slots: dict[tuple, object] = {}  # statistics and partial sums, by group
        self.staging: dict[int, object] = {}  # strided tiles to send, by transfer
        for ins in rt.program.instructions:
            self._prepare(rt, ins)

    def _prepare(self, rt: Runtime, ins) -> None:
        """The buffers of the instruction that assembles a task's inputs (forward) or
        output gradient (backward): a ``Partial`` where the op has one, else ``Compute``
        (a ``ShareGrad`` for the owner of a partial sum)."""
        if isinstance(ins, Compute | Partial):
            key = (ins.op, ins.task)
            op, task = rt.graph.ops[ins.op], rt.task(key)
            self.args.setdefault(key, _fixed_args(rt, key, task))
            assembles = isinstance(ins, Partial) or not op.nest.sync_dims
            if ins.phase is Phase.FORWARD and assembles:
                pieces = list(ins.pieces)
                self.inputs[key] = tuple(
                    input_source(rt, key, task, k, pieces) for k in range(len(op.inputs))
                )
            elif assembles and not (op.is_loss or op.nest.partial_dims):
                self.grad_outputs[key] = grad_source(rt, task, ins.pieces)
        elif isinstance(ins, ShareGrad):
            group = rt.pg.sums[rt.graph.ops[ins.op].name][ins.group]
            owner = rt.task((ins.op, group.owner))
            if owner.device == rt.rank:
                self.grad_outputs[(ins.op, group.owner)] = grad_source(rt, owner, ins.pieces)


def _tensor(rt: Runtime, t: Transfer) -> str:
    return rt.graph.ops[t.producer[0]].output


def _fixed_args(rt: Runtime, key: TaskKey, task: Task) -> TaskArgs:
    """A task's kernel arguments that never change; a step adds its random key, the
    loss's divisor and the statistics."""
    op = rt.graph.ops[key[0]]
    return TaskArgs(
        out_shape=rect_shape(task.output),
        valid=tuple(r.valid for r in task.inputs),
        origin=tuple(lo for lo, _ in task.output),
        full_shape=rt.graph.tensors[op.output].shape,
        float_dtype=rt.dtype,
        box=task.box,
    )


def _phase(ins) -> Phase:
    if isinstance(ins, Compute | Partial | ReduceStats):
        return ins.phase
    if isinstance(ins, SumOutputs):
        return Phase.FORWARD
    if isinstance(ins, Send | Recv | Wait):
        return ins.transfer.phase
    return Phase.BACKWARD  # all-reduces of weight gradients


class _Step:
    """One step on one rank: the arrays it produces, over the buffers made once."""

    def __init__(self, rt: Runtime, batch: Batch, training: bool) -> None:
        self.rt, self.batch, self.training = rt, batch, training
        self.buf = rt.buffers
        self.xp = rt.xp
        self.outputs: dict[TaskKey, object] = {}
        self.inputs: dict[TaskKey, list] = {}
        self.input_grads: dict[TaskKey, tuple] = {}
        self.grad_outputs: dict[TaskKey, object] = {}
        self.partials: dict[tuple[Phase, int, int], object] = {}
        self.totals: dict[tuple[Phase, int, int], object] = {}
        self.updated: set[WeightKey] = set()  # state shards this step has written
        self.pending: dict[int, object] = {}
        self.reductions: list = []  # weight gradients' all-reduces in flight
        self.losses: list = []
        self.scale = 1.0
        if rt.graph.loss_op is not None:
            self.scale = batch.loss_scale
            if self.scale is None:
                self.scale = loss_scale(rt.graph, batch.labels)

    def dispatch(self) -> dict[type, object]:
        """The method that runs each kind of instruction."""
        return {
            Partial: self.partial,
            ReduceStats: self.reduce_stats,
            SumOutputs: self.sum_outputs,
            ShareGrad: self.share_grad,
            Compute: self.compute,
            Send: self.send,
            Recv: self.recv,
            Wait: self.wait,
            AllReduce: self.allreduce,
        }

    def loss(self) -> float:
        if not self.losses:
            return 0.0
        total = self.losses[0]
        for value in self.losses[1:]:
            total = total + value
        return float(self.rt.device.to_host(self.xp.asarray(total)))

    # -- moving data ------------------------------------------------------------------

    def recv(self, ins: Recv) -> None:
        t = ins.transfer
        self.pending[t.id] = self.rt.transport.recv(self.buf.received[t.id], t.src)

    def wait(self, ins: Wait) -> None:
        self.rt.transport.wait(self.pending.pop(ins.transfer.id))

    def send(self, ins: Send) -> None:
        t = ins.transfer
        if t.phase is Phase.FORWARD:
            whole = self.outputs[t.producer]
            origin = self.rt.task(t.producer).output
        else:
            whole = self.input_grads[t.consumer][t.operand]
            origin = self.rt.task(t.consumer).inputs[t.operand].buffer
        tile = whole[local_slices(t.rect, origin)]
        if not tile.flags.c_contiguous:
            # A strided tile goes through a buffer made in the first step.
            staging = self.buf.staging.get(t.id)
            if staging is None:
                staging = self.buf.staging[t.id] = self.xp.empty(tile.shape, dtype=tile.dtype)
            staging[...] = tile
            tile = staging
        self.rt.transport.send(tile, t.dst)

    def _source(self, copy: Copy, forward: bool):
        if copy.transfer is not None:
            return self.buf.received[copy.transfer]
        if forward:
            return self.outputs[copy.peer][copy.source]
        return self.input_grads[copy.peer][copy.operand][copy.source]

    def _assemble_inputs(self, key: TaskKey) -> list:
        buffers = []
        for source in self.buf.inputs[key]:
            if isinstance(source, Fixed):
                buffers.append(source.array)
            elif isinstance(source, Alias):
                buffers.append(self.outputs[source.producer])
            elif isinstance(source, Rows):
                buffers.append(self._rows(source))
            else:
                for copy in source.copies:
                    source.buffer[copy.into] = self._source(copy, forward=True)
                buffers.append(source.buffer)
        return buffers

    def _rows(self, source: Rows):
        held, first = self.batch.rows(source.name, self.rt.graph.labels)
        (lo, hi), *rest = source.data
        rows = held[(slice(lo - first, hi - first), *global_slices(tuple(rest)))]
        if source.host is None:  # numpy: straight into the buffer
            source.buffer[source.into] = rows
            return source.buffer
        np.copyto(source.host, rows)
        target = source.buffer if source.staged is None else source.staged
        self.rt.device.to_device(source.host, out=target)
        if source.staged is not None:
            source.buffer[source.into] = source.staged
        return source.buffer

    def _grad_output(self, key: TaskKey):
        op = self.rt.graph.ops[key[0]]
        if op.is_loss:
            return self.xp.ones((), dtype=self.rt.dtype)
        source = self.buf.grad_outputs[key]
        if isinstance(source, GradAlias):
            return self.input_grads[source.consumer][source.operand]
        source.buffer.fill(0)
        for copy in source.copies:
            source.buffer[copy.into] += self._source(copy, forward=False)
        return source.buffer

    # -- computing --------------------------------------------------------------------

    def _args(self, key: TaskKey) -> TaskArgs:
        return replace(
            self.buf.args[key],
            loss_scale=self.scale,
            random=RandomKey(self.rt.seed, self.batch.step, key[0]) if self.training else None,
            stats=self.totals.get((Phase.FORWARD, *key)),
            grad_stats=self.totals.get((Phase.BACKWARD, *key)),
        )

    def compute(self, ins: Compute) -> None:
        if ins.phase is Phase.FORWARD:
            self.forward(ins)
        else:
            self.backward(ins)

    def partial(self, ins: Partial) -> None:
        """First half of an op with statistics: assemble, then the task's partial sums."""
        key = (ins.op, ins.task)
        op = self.rt.graph.ops[ins.op]
        stats = definition(op.type).statistics
        xp = self.xp
        if ins.phase is Phase.FORWARD:
            self.inputs[key] = self._assemble_inputs(key)
            partial = stats.forward(xp, op.attrs, self.inputs[key], self._args(key))
        else:
            grad = self.grad_outputs[key] = self._grad_output(key)
            args = self._args(key)
            partial = stats.backward(xp, op.attrs, self.inputs[key], self.outputs[key], grad, args)
        self.partials[(ins.phase, *key)] = xp.ascontiguousarray(partial, dtype=self.rt.dtype)

    def _local(self, op_index: int, tasks) -> list[int]:
        return [t for t in tasks if self.rt.task((op_index, t)).device == self.rt.rank]

    def _slots(self, key: tuple, shape: tuple[int, ...]):
        """A buffer made in the first step and zeroed in every later one."""
        slots = self.buf.slots.get(key)
        if slots is None or slots.shape != shape:
            slots = self.buf.slots[key] = self.xp.zeros(shape, dtype=self.rt.dtype)
        else:
            slots.fill(0)
        return slots

    def sum_outputs(self, ins: SumOutputs) -> None:
        """The group's partial tiles summed; the owner's output becomes the sum."""
        group = self.rt.pg.sums[self.rt.graph.ops[ins.op].name][ins.group]
        mine = self._local(ins.op, group.tasks)
        first = self.outputs[(ins.op, mine[0])]
        total = self._slots(("sum", ins.op, ins.group), first.shape)
        for t in mine:
            total += self.outputs[(ins.op, t)]
        if len(group.devices) > 1:
            self.rt.transport.wait(self.rt.transport.allreduce(total, group.devices))
        if group.owner in mine:
            self.outputs[(ins.op, group.owner)] = total

    def share_grad(self, ins: ShareGrad) -> None:
        """Every task of the group gets the gradient of the tile its owner received."""
        group = self.rt.pg.sums[self.rt.graph.ops[ins.op].name][ins.group]
        mine = self._local(ins.op, group.tasks)
        owner = self.rt.task((ins.op, group.owner))
        grad = self._slots(("share", ins.op, ins.group), rect_shape(owner.output))
        if group.owner in mine:
            grad += self._grad_output((ins.op, group.owner))
        if len(group.devices) > 1:
            self.rt.transport.wait(self.rt.transport.allreduce(grad, group.devices))
        for t in mine:
            self.grad_outputs[(ins.op, t)] = grad

    def reduce_stats(self, ins: ReduceStats) -> None:
        """Gather the group's partials (each task's in its slot, by an exact all-reduce
        of a zeroed array) and combine them in task order."""
        op = self.rt.graph.ops[ins.op]
        group = self.rt.pg.stats[op.name][ins.group]
        mine = self._local(ins.op, group.tasks)
        first = self.partials[(ins.phase, ins.op, mine[0])]
        slots = self._slots((ins.phase, ins.op, ins.group), (len(group.tasks), *first.shape))
        for t in mine:
            slots[group.tasks.index(t)] = self.partials.pop((ins.phase, ins.op, t))
        if len(group.devices) > 1:
            self.rt.transport.wait(self.rt.transport.allreduce(slots, group.devices))
        stats = definition(op.type).statistics
        combine = stats.combine_forward if ins.phase is Phase.FORWARD else stats.combine_backward
        total = combine(self.xp, slots)
        for t in mine:
            self.totals[(ins.phase, ins.op, t)] = total

    def forward(self, ins: Compute) -> None:
        key = (ins.op, ins.task)
        op = self.rt.graph.ops[ins.op]
        synced = bool(op.nest.sync_dims)
        buffers = self.inputs[key] if synced else self._assemble_inputs(key)
        args = self._args(key)
        d = definition(op.type)
        out = d.forward(self.xp, op.attrs, buffers, args)
        self.inputs[key], self.outputs[key] = buffers, out
        if synced and self.training:
            task = self.rt.task(key)
            for k, value in d.statistics.update(self.xp, op.attrs, buffers, args):
                # Every copy of the state gets the same sums, so replicas stay identical;
                # the rank's other tasks on the same channels must not update it again.
                shard = (op.inputs[k], task.inputs[k].data)
                if shard not in self.updated:
                    self.updated.add(shard)
                    self.rt.shards[shard][...] = value
        if op.is_loss:
            self.losses.append(out)

    def backward(self, ins: Compute) -> None:
        key = (ins.op, ins.task)
        op, task = self.rt.graph.ops[ins.op], self.rt.task(key)
        shared = op.nest.sync_dims or op.nest.partial_dims
        grad_out = self.grad_outputs.pop(key) if shared else self._grad_output(key)
        grads = definition(op.type).backward(
            self.xp, op.attrs, self.inputs[key], self.outputs[key], grad_out, self._args(key)
        )
        for k, (name, role) in enumerate(zip(op.inputs, self.rt.roles[ins.op], strict=True)):
            if role is TensorRole.WEIGHT:
                self.buf.grads[(name, task.inputs[k].data)] += grads[k]
        # Keep only what producers still collect: activation gradients.
        self.input_grads[key] = tuple(
            g if role is TensorRole.ACTIVATION else None
            for g, role in zip(grads, self.rt.roles[ins.op], strict=True)
        )

    def allreduce(self, ins: AllReduce) -> None:
        """Start the sum of a replica group's gradient; ``end_step`` completes it (the
        backward pass goes on meanwhile)."""
        group = self.rt.pg.groups[self.rt.graph.ops[ins.op].name][ins.group]
        grad = self.buf.grads[(group.weight, group.rect)]
        self.reductions.append(self.rt.transport.allreduce(grad, ins.devices))
