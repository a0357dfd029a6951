"""Run one rank's program: a training step = forward, backward, all-reduce, SGD update.

The rank holds only what its tasks need: the weight Rects they read (one copy per Rect,
shared by the rank's tasks of a replica group), the data rows they read, their input
buffers, output tiles and gradients. What it moves, and where to, comes from the
compiled program.

What every step reuses is made once, before the first step (executor/layout.py): the
data rows' buffers with their padding, statistics slots, the kernels' fixed
arguments. A step (executor/step.py) then fills those buffers, makes what lives
less than a step (receive buffers, assembled inputs, gathered gradients, partial sums'
arrays: executor/lifetimes.py), calls the kernels (whose results cupy
takes from its memory pool) and moves tiles; on a GPU
the host waits for nothing but the loss at the end of the step (and, in a pipeline's
step, for a microbatch's work before a later one reuses its buffers: ``Reopen``).

A pipeline's step runs the rank's stage's passes of ``microbatches`` microbatches, one
``Step`` each on the buffers of its slot (executor/program.py); the weight gradients
accumulate over the microbatches and are summed over replicas once, in the stage's last
backward; the update follows once per step.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext

import numpy as np

from executor.batch import Batch, loss_scale  # noqa: F401  (re-exported: the runtime's API)
from executor.buffers import global_slices
from executor.device import CpuDevice, Device
from executor.layout import (
    Assembled,
    GradSource,
    InputSource,
    TaskKey,
    grad_source,
    input_source,
)
from executor.lifetimes import lifetimes
from executor.optim import OptimizerConfig, apply_update
from executor.precision import HalfStorage, Rounding
from executor.program import (
    Compute,
    Partial,
    Phase,
    Program,
    Recv,
    ShareGrad,
    Transfer,
    forward_program,
)
from executor.recompute import recompute_plan
from executor.step import Step
from executor.trace import Tracer, task_name
from executor.transport import Transport
from onnx2soap.errors import UserError
from onnx2soap.importer.prepare import compact
from onnx2soap.importer.weights import StoredTensor
from onnx2soap.ir import TensorRole
from onnx2soap.ops import TaskArgs, definition
from onnx2soap.precision import Precision
from onnx2soap.soap import PartitionedGraph, analyze
from onnx2soap.soap.dims import DimKind
from onnx2soap.soap.partition import Rect, Task, held_rects, owners, rect_shape
from onnx2soap.soap.saved import backward_reads, wanted_gradients
from onnx2soap.soap.streamed import KeyBlock, key_blocks
from onnx2soap.soap.zero import Zero, ZeroGroup, ZeroStage, group_stage, zero_group

WeightKey = tuple[str, Rect]


def _refuse_nonfinite(name: str, part: np.ndarray) -> None:
    """Weights are checked where they are loaded, box by box: planning never reads them."""
    finite = np.isfinite(part)
    if not finite.all():
        raise UserError(
            f"initializer '{name}': {finite.size - int(finite.sum())} of the {finite.size} "
            "values this rank loads are NaN or infinite; pass --allow-nonfinite to train "
            "with them anyway"
        )


class Runtime:
    def __init__(
        self,
        pg: PartitionedGraph,
        program: Program,
        transport: Transport,
        weights: Mapping[str, np.ndarray | StoredTensor],
        dtype: np.dtype,
        constants: dict[str, np.ndarray] | None = None,
        seed: int = 0,
        device: Device | None = None,
        optimizer: OptimizerConfig | None = None,
        refuse_nonfinite: bool = False,
        precision: Precision = Precision.FP32,
        zero: Zero | ZeroStage = ZeroStage.NONE,
        recompute: frozenset[str] = frozenset(),
    ) -> None:
        """``weights`` gives the initial values of the weights and of the state tensors:
        arrays, or ``StoredTensor``s, of which only the boxes this rank holds are read.
        ``refuse_nonfinite``: a NaN or infinity in them is a ``UserError``.
        ``precision``: mixed precision (``executor/precision.py``) on float32 shards.
        ``zero``: the plan's ZeRO stages (soap/zero.py): the program must be compiled
        with them. ``recompute``: the plan's recomputed ops (executor/recompute.py)."""
        self.pg, self.graph, self.program = pg, pg.graph, program
        self.transport, self.dtype, self.rank = transport, np.dtype(dtype), program.rank
        self.device = device or CpuDevice()
        self.xp = self.device.xp
        self.seed = seed
        self.optimizer = optimizer or OptimizerConfig()
        self.tracer: Tracer | None = None  # set to time every instruction (--trace)
        self.rounding = Rounding(self.xp, precision)  # weight gradients' values
        self.half = HalfStorage(self.xp, precision)  # what the step stores
        # fp16 on a GPU: matrix products on tensor cores (CuPy has float16, not bfloat16).
        half = precision is Precision.FP16 and self.xp is not np
        self.matmul_dtype = self.xp.float16 if half else None
        self.updates = 0  # optimizer steps taken (Adam's bias correction counts them)
        self.tasks = [pg.tasks[op.name] for op in self.graph.ops]
        # A reduce-scattering sum's holders hold a chunk of their tile, not all of it.
        self.held: dict[TaskKey, Rect] = {
            (i, t): rect
            for i, op in enumerate(self.graph.ops)
            for t, rect in held_rects(pg.sums[op.name]).items()
        }
        self.roles = [[self.graph.tensors[t].role for t in op.inputs] for op in self.graph.ops]
        # ring attention: the key blocks each local streamed task takes its keys and
        # values in (soap/streamed.py); a task absent takes them whole
        self.key_blocks: dict[TaskKey, tuple[KeyBlock, ...]] = {
            (i, t.index): blocks
            for i, op in enumerate(self.graph.ops)
            if definition(op.type).streams is not None
            for t in self.tasks[i]
            if t.device == self.rank and (blocks := key_blocks(op, self.tasks[i], t))
        }
        self.shards: dict[WeightKey, object] = {}
        self.trainable: set[WeightKey] = set()
        self.zero_stages = zero = Zero.of(zero)
        # ZeRO: the rank's sharded groups; it updates, and keeps optimizer state for,
        # its own rows of each (``slot_rect``).
        self.zero: dict[WeightKey, ZeroGroup] = {}
        # ZeRO-3: the rank holds its rows of these alone (``held_rect``); a step gathers
        # the whole Rect for each op that reads it (``Step.gather_weight``).
        self.zero3: dict[WeightKey, ZeroGroup] = {}
        for op in self.graph.ops:
            for group in pg.groups[op.name]:
                if self.rank in group.devices:
                    key = (group.weight, group.rect)
                    sharded = zero_group(group, zero)
                    if sharded is not None:
                        self.zero[key] = sharded
                        if group_stage(group, zero).shards_weights:
                            self.zero3[key] = sharded
                    held = (group.weight, self.held_rect(key))
                    self.shards[key] = self._shard(weights[group.weight], held, refuse_nonfinite)
                    if group.trainable:
                        self.trainable.add(key)
        # Updated in this order (the shards' own: graph order), every step.
        self.trainable_order = tuple(k for k in self.shards if k in self.trainable)
        # Mixed precision: the kernels read each trainable weight in the half format, a
        # copy remade after every update; the shard stays the float32 master. Under
        # ZeRO-3 none is kept: the step narrows the rank's rows as it gathers them.
        self.compute_copies: dict[WeightKey, object] = {}
        if self.half.active:
            with self.device.compute():
                for key in self.trainable_order:
                    if key not in self.zero3:
                        self.compute_copies[key] = self.half.narrow(self.shards[key])
        # Constants are small (scalars, broadcast vectors): every rank holds them whole,
        # floats in the run's dtype, ids int64; one repeated along axes (a causal mask at
        # the bound batch) as its distinct values, broadcast (read-only) to its shape.
        with self.device.compute():
            self.constants = {
                name: self._constant(name, value) for name, value in (constants or {}).items()
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
        self.forward_program = forward_program(program)  # evaluation's
        # ZeRO-3: the weights a step gathered for an op's phase go after the op's last
        # task of the phase on the rank: (phase, op, task) -> their keys
        self.gathered_until = _gathered_until(self, program) if self.zero3 else {}
        # A pipeline's microbatches: each random op's sample axis (its draws are those
        # of its samples in the whole batch: executor/step.py).
        self.random_axes = random_axes(self.graph) if program.microbatches > 1 else {}
        # On a GPU, made on the compute stream that uses them (a non-blocking stream
        # does not wait for the default one), and complete before the first step.
        with self.device.compute():
            # A set of buffers per slot: one per microbatch open at once on the rank
            # (one without a pipeline); the step's weight gradients are shared.
            grads: dict[tuple, object] = {}
            slots = max(program.slots, self.forward_program.slots, 1)
            self.slot_buffers = tuple(_Buffers(self, grads) for _ in range(slots))
            self.buffers = self.slot_buffers[0]
            self.recompute = recompute_plan(self, recompute) if recompute else None
            self.lifetimes = lifetimes(self, self.recompute.ops if self.recompute else frozenset())
            # The optimizer's state, shaped and sharded like each trainable shard (under
            # ZeRO like the rank's rows of it).
            self.slots = {
                key: {
                    name: self.xp.zeros(rect_shape(self.slot_rect(key)), dtype=self.dtype)
                    for name in self.optimizer.slots
                }
                for key in self.trainable
            }
        self.device.synchronize()
        # The simulator's name of every instruction's task, made once for the trace, in
        # the order each list runs them.
        self._step_names = tuple(task_name(pg, ins) for ins in program.instructions)
        self._forward_names = tuple(task_name(pg, ins) for ins in self.forward_program.instructions)

    def _constant(self, name: str, value):
        value = np.asarray(value)
        distinct = compact(value)
        held = self.device.to_device(np.asarray(distinct, dtype=self.dtype_of(name)))
        return held if distinct.shape == value.shape else self.xp.broadcast_to(held, value.shape)

    def _shard(self, source, key: WeightKey, refuse_nonfinite: bool):
        """The rank's copy of one Rect of a weight or state tensor, on its device."""
        part = source[global_slices(key[1])]  # a StoredTensor reads this box only
        if refuse_nonfinite:
            _refuse_nonfinite(key[0], part)
        host = np.ascontiguousarray(part, dtype=self.dtype)
        if self.xp is np and isinstance(source, StoredTensor):
            return host  # read fresh from the file: the rank's own, no second copy
        with self.device.compute():
            return self.device.to_device(host)

    def held_rect(self, key: WeightKey) -> Rect:
        """The Rect of a weight or state shard the rank holds between steps: the shard,
        or under ZeRO-3 the rank's rows of it."""
        sharded = self.zero3.get(key)
        return key[1] if sharded is None else sharded.shard(self.rank)

    def written(self, group) -> list[tuple[int, Rect]]:
        """Who writes a replica group's values, and which Rect of them (each Rect of a
        tensor once): the group's lowest device the whole shard, or under ZeRO-3 every
        member its rows. From the plan alone: the same on every rank, member or not."""
        stage = group_stage(group, self.zero_stages)
        sharded = zero_group(group, stage) if stage.shards_weights else None
        if sharded is None:
            return [(group.devices[0], group.rect)]
        return list(zip(group.devices, sharded.shards, strict=True))

    def slot_rect(self, key: WeightKey) -> Rect:
        """The Rect of a trainable shard this rank updates and keeps optimizer state for:
        the shard, or under ZeRO the rank's rows of it."""
        sharded = self.zero.get(key)
        return key[1] if sharded is None else sharded.shard(self.rank)

    def owned_gradient(self, key: WeightKey):
        """The summed gradient of ``slot_rect(key)``: the shard's, or under ZeRO-1 the
        rank's rows of the full-size buffer (its other rows are partly summed), under
        ZeRO-2 the array ``Step`` kept of them."""
        grad = self.buffers.gradient(key, self.xp)
        sharded = self.zero.get(key)
        if sharded is None or self.zero_stages.weight(key[0]).shards_gradients:
            return grad
        lo, hi = sharded.rows(self.rank)
        return grad[lo:hi]

    def dtype_of(self, tensor: str) -> np.dtype:
        """Float tensors in the run's dtype; ids stay int64."""
        return self.dtype if self.graph.differentiable(tensor) else np.dtype(np.int64)

    def storage_of(self, tensor: str) -> np.dtype:
        """What the step stores a tensor's tiles, buffers and pieces in: activations and
        data in the half format under mixed precision (``HalfStorage``); labels,
        constants and ids as ``dtype_of``."""
        role = self.graph.tensors[tensor].role
        stored = role is TensorRole.ACTIVATION or role is TensorRole.INPUT
        if stored and self.half.active and self.graph.differentiable(tensor):
            return self.half.dtype
        return self.dtype_of(tensor)

    def task(self, key: TaskKey) -> Task:
        return self.tasks[key[0]][key[1]]

    def output_rect(self, key: TaskKey) -> Rect:
        """The rect a task's output array spans: its tile, or the chunk of it a
        reduce-scattering sum's holder ends with."""
        held = self.held.get(key)
        return self.task(key).output if held is None else held

    def forward(self, batch: Batch, microbatch: int = 0) -> dict[tuple[str, int], np.ndarray]:
        """Only the forward phase; the output tile (on the host) of every local task that
        owns one, by (op, task) (a partial sum is no tile), of microbatch ``microbatch``
        (a plan without a pipeline has one)."""
        return self.evaluate(batch)[1][microbatch]

    def evaluate(
        self, batch: Batch, ops: set[str] | None = None
    ) -> tuple[float, tuple[dict[tuple[str, int], np.ndarray], ...]]:
        """The forward phase without training (no Dropout, no statistics updates): the
        sum of this rank's partial losses, and per microbatch the owned output tiles (on
        the host) of ``ops`` (every op when None), by (op, task)."""
        steps = self._steps(batch, self.forward_program, training=False)
        with self.device.compute():
            self._run(steps, self.forward_program.instructions, self._forward_names)
            self.transport.end_step()
            loss = steps[0].loss()
        self.device.synchronize()  # staged copies finish before their buffers are reused
        names = [op.name for op in self.graph.ops]
        owned = {
            (i, t.index) for i, op in enumerate(self.graph.ops) for t in owners(op, self.tasks[i])
        } | set(self.held)  # every chunk of a reduce-scattered sum: each holder has one
        tiles = tuple(
            {
                (names[op], task): self.device.to_host(self.half.widen(tile))
                for (op, task), tile in state.outputs.items()
                if (op, task) in owned and (ops is None or names[op] in ops)
            }
            for state in steps
        )
        return loss, tiles

    def _steps(self, batch: Batch, program: Program, training: bool, grad_seed: float = 1.0):
        """One ``Step`` per microbatch, each on its slot's buffers; the first holds what
        the step shares (losses, gradient sums in flight)."""
        first = Step(self, batch, training, grad_seed, 0, self.slot_buffers[program.slot_of[0]])
        return [first] + [
            Step(self, batch, training, grad_seed, m, self.slot_buffers[program.slot_of[m]], first)
            for m in range(1, program.microbatches)
        ]

    def step(self, batch: Batch, lr: float) -> float:
        """Run one training step at learning rate ``lr``; returns the sum of this rank's
        partial losses."""
        loss = self.forward_backward(batch)
        self.update(lr)
        return loss

    def forward_backward(self, batch: Batch, grad_seed: float = 1.0) -> float:
        """The step's forward and backward passes, every weight gradient summed over the
        microbatches and its replica group; the backward starts from ``grad_seed``
        (fp16's loss scale). The sum of this rank's partial losses (unscaled)."""
        steps = self._steps(batch, self.program, training=True, grad_seed=grad_seed)
        state = steps[0]
        with self.device.compute():
            self._run(steps, self.program.instructions, self._step_names)
            with self._timed("wait allreduce", "allreduce") if self._tracing else nullcontext():
                for pending in state.reductions:  # every gradient is summed before the update
                    self.transport.wait(pending)
                state.finish_scatters()
                self.transport.end_step()
            loss = state.loss()
        return loss

    def nonfinite_gradients(self) -> bool:
        """Whether a weight gradient of this step holds an infinity or NaN."""
        with self.device.compute():
            grads = [self.owned_gradient(key) for key in list(self.buffers.grads)]
            finite = [self.xp.isfinite(g).all() for g in grads]
            return not all(bool(f) for f in finite)

    def update(self, lr: float, grad_scale: float = 1.0, skip: bool = False) -> None:
        """Apply the optimizer to every trainable shard with its gradient times
        ``grad_scale`` (1 / fp16's loss scale), or, with ``skip``, drop the gradients: a
        skipped step is no optimizer step (Adam's count stays)."""
        with self.device.compute():
            if not skip:
                self.updates += 1
                tracing = self._tracing
                gathers = []
                for key in self.trainable_order:
                    with self._timed(f"update {key[0]}", "update") if tracing else nullcontext():
                        gathers += self._update_shard(key, lr, grad_scale)
                if gathers:
                    self._gather(gathers)
            self.buffers.grads.clear()  # the gradients live from their backward to here
        self.device.synchronize()

    def _update_shard(self, key: WeightKey, lr: float, grad_scale: float) -> list:
        """Update the rank's part of a trainable shard; under ZeRO start the all-gather
        that gives every member the others' updated rows (returned, in flight)."""
        grad = self.owned_gradient(key)
        if grad_scale != 1.0:
            grad *= grad_scale
        slots, sharded = self.slots[key], self.zero.get(key)
        if sharded is None or key in self.zero3:  # the whole shard, or ZeRO-3's rows
            apply_update(self.xp, self.optimizer, self.shards[key], grad, slots, lr, self.updates)
            self.refresh_compute_copy(key)
            return []
        lo, hi = sharded.rows(self.rank)
        param = self.shards[key][lo:hi]  # a view: the update writes the shard in place
        apply_update(self.xp, self.optimizer, param, grad, slots, lr, self.updates)
        devices = sharded.group.devices
        return [(key, self.transport.all_gather(self.shards[key], devices, sharded.chunks))]

    def _gather(self, gathers: list) -> None:
        """Complete the step's all-gathers (started in update order, one ring at a time
        per communicator), then remake the half-format copies of what they wrote. Their
        arrays are the weights, held anyway; the next step's ``end_step`` retires them
        (a second ``end_step`` in a step would retire NCCL's backward arrays early)."""
        with self._timed("wait allgather", "allreduce") if self._tracing else nullcontext():
            for _, pending in gathers:
                self.transport.wait(pending)
        for key, _ in gathers:
            self.refresh_compute_copy(key)

    @property
    def _tracing(self) -> bool:
        return self.tracer is not None and self.tracer.active

    def weight_values(self, key: WeightKey):
        """What kernels read of a weight or state shard: in mixed precision, a trainable
        weight's copy rounded to the half format; else the shard itself."""
        return self.compute_copies.get(key, self.shards[key])

    def refresh_compute_copy(self, key: WeightKey) -> None:
        """Remake a weight's half-format copy from its master (after it changed)."""
        copy = self.compute_copies.get(key)
        if copy is not None:
            copy[...] = self.half.narrow(self.shards[key])

    def _run(self, steps: list[Step], instructions, names: tuple[tuple[str, str], ...]) -> None:
        # Local, not on the step: bound methods held by the step would make it a cycle
        # that keeps a step's arrays alive until the garbage collector runs.
        dispatch = [state.dispatch() for state in steps]
        if self.tracer is None or not self.tracer.active:
            for ins in instructions:
                dispatch[ins.microbatch][type(ins)](ins)
            return
        # Timed inline, not through ``_timed``: a context manager per instruction cost
        # about 2 us of each, which a traced step of 400 instructions noticed.
        clock, synchronize, record = time.perf_counter, self.device.synchronize, self.tracer.record
        for ins, (name, kind) in zip(instructions, names, strict=True):
            start = clock()
            dispatch[ins.microbatch][type(ins)](ins)
            synchronize()
            record(name, kind, start, clock())

    @contextmanager
    def _timed(self, name: str, kind: str):
        """Time one task for the trace: on a GPU, until the device has done it."""
        start = time.perf_counter()
        yield
        self.device.synchronize()
        self.tracer.record(name, kind, start, time.perf_counter())


class _Buffers:
    """What a rank's steps reuse: made once, from the program; one set per slot (a
    microbatch open on the rank), the weight gradients (``grads``) shared by all."""

    def __init__(self, rt: Runtime, grads: dict) -> None:
        # Each trainable shard's gradient in the step, from its first backward kernel to
        # the update (``Step._weight_grad``), summed over the microbatches; none between
        # steps.
        self.grads = grads
        self._shapes = {k: rect_shape(k[1]) for k in rt.trainable}  # the whole Rect's
        self._dtype = rt.dtype
        # Every microbatch runs the same instructions: the first one's tell the buffers.
        first = [ins for ins in rt.program.instructions if ins.microbatch == 0]
        # Each receive's buffer, (shape, dtype): made by the step that posts it, dropped
        # once read (executor/step.py), so that it lives only while it is in flight.
        self.receives = {
            t.id: (rect_shape(t.rect), rt.storage_of(_tensor(rt, t)))
            for t in (ins.transfer for ins in first if isinstance(ins, Recv))
        }
        self.inputs: dict[TaskKey, tuple[InputSource, ...]] = {}
        self.grad_outputs: dict[TaskKey, GradSource] = {}
        self.args: dict[TaskKey, TaskArgs] = {}
        self.slots: dict[tuple, object] = {}  # statistics and partial sums, by group
        for ins in first:
            self._prepare(rt, ins)
        # How many local tasks read each assembled buffer (layout.Assembled.share): the
        # step lets go of a shared one after the last of them has taken it.
        self.readers: Counter = Counter(
            s.share
            for sources in self.inputs.values()
            for s in sources
            if isinstance(s, Assembled) and s.share is not None
        )

    def gradient(self, key, xp):
        """The shard's gradient this step: zeros where no kernel made one."""
        if key not in self.grads:
            self.grads[key] = xp.zeros(self._shapes[key], dtype=self._dtype)
        return self.grads[key]

    def _prepare(self, rt: Runtime, ins) -> None:
        """The buffers of the instruction that assembles a task's inputs (forward) or
        output gradient (backward): a ``Partial`` where the op has one, else ``Compute``
        (a ``ShareGrad`` for the holders of a partial sum)."""
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
            elif assembles and not (op.is_loss or rt.pg.sums[op.name]):
                self.grad_outputs[key] = grad_source(rt, key, ins.pieces)
        elif isinstance(ins, ShareGrad):
            group = rt.pg.sums[rt.graph.ops[ins.op].name][ins.group]
            key = (ins.op, group.holder(rt.rank))
            self.grad_outputs[key] = grad_source(rt, key, ins.pieces)


def _gathered_until(rt: Runtime, program: Program) -> dict[tuple, tuple[WeightKey, ...]]:
    """Per op and phase with ZeRO-3 weights, its last ``Compute`` on the rank (the same
    for every microbatch) -> the weights gathered for it."""
    last: dict[tuple, tuple] = {}
    for ins in program.instructions:
        if isinstance(ins, Compute) and ins.microbatch == 0:
            last[(ins.phase, ins.op)] = (ins.phase, ins.op, ins.task)
    out: dict[tuple, tuple[WeightKey, ...]] = {}
    for (phase, i), at in last.items():
        op = rt.graph.ops[i]
        keys = tuple(
            (g.weight, g.rect)
            for g in rt.pg.groups[op.name]
            if (g.weight, g.rect) in rt.zero3
            if phase is Phase.FORWARD or backward_reads(rt.graph, op, g.weight)
        )
        if keys:
            out[at] = keys
    return out


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
        matmul_dtype=rt.matmul_dtype,
        wanted=wanted_gradients(rt.graph, op),
    )


def random_axes(graph) -> dict[int, int]:
    """Op index -> the output axis that holds the samples, for every op that draws
    random values (``OpDef.draws_random``) and has one."""
    random = {i for i, op in enumerate(graph.ops) if definition(op.type).draws_random}
    if not random:
        return {}
    space = analyze(graph)
    axes = {}
    for i in random:
        op = graph.ops[i]
        sample = [d.axis for d in space[op.name] if d.kind is DimKind.SAMPLE and d.axis is not None]
        if sample:
            axes[i] = sample[0]
    return axes
