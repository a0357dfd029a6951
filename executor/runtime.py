"""Run one rank's program: a training step = forward, backward, all-reduce, SGD update.

The rank holds only what its tasks need: the weight Rects they read (one copy per Rect,
shared by the rank's tasks of a replica group), their input buffers, output tiles and
gradients. What it moves, and where to, comes from the compiled program.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from executor.buffers import empty_buffer, global_slices, local_slices, slice_from_full
from executor.program import (
    AllReduce,
    Compute,
    Partial,
    Phase,
    Piece,
    Program,
    ReduceStats,
    Send,
    ShareGrad,
    SumOutputs,
    Transfer,
    Wait,
)
from executor.transport import Transport
from onnx2soap.ir import Graph, TensorRole
from onnx2soap.ops import TaskArgs, definition
from onnx2soap.ops.base import RandomKey
from onnx2soap.soap import PartitionedGraph
from onnx2soap.soap.partition import Rect, Task, owners, rect_shape

TaskKey = tuple[int, int]  # (op index, task index)
WeightKey = tuple[str, Rect]


@dataclass(frozen=True)
class Batch:
    """One step's data, whole on every rank (each task cuts its own region): every data
    input by name (floats already in the run's dtype, ids int64), and the labels."""

    inputs: Mapping[str, np.ndarray]
    labels: np.ndarray
    step: int = 0  # numbers the random ops' draws


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
    ) -> None:
        """``weights`` holds the initial values of the weights and of the state tensors."""
        self.pg, self.graph, self.program = pg, pg.graph, program
        self.transport, self.dtype, self.rank = transport, np.dtype(dtype), program.rank
        self.seed = seed
        self.tasks = [pg.tasks[op.name] for op in self.graph.ops]
        self.roles = [[self.graph.tensors[t].role for t in op.inputs] for op in self.graph.ops]
        self.shards: dict[WeightKey, np.ndarray] = {}
        self.trainable: set[WeightKey] = set()
        for op in self.graph.ops:
            for group in pg.groups[op.name]:
                if self.rank in group.devices:
                    part = weights[group.weight][global_slices(group.rect)]
                    key = (group.weight, group.rect)
                    self.shards[key] = np.array(part, dtype=self.dtype)
                    if group.trainable:
                        self.trainable.add(key)
        # Constants are small (scalars, broadcast vectors): every rank holds them whole,
        # floats in the run's dtype, ids int64.
        self.constants = {
            name: np.asarray(value, dtype=self.dtype_of(name))
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

    def dtype_of(self, tensor: str) -> np.dtype:
        """Float tensors in the run's dtype; ids stay int64."""
        return self.dtype if self.graph.differentiable(tensor) else np.dtype(np.int64)

    def task(self, key: TaskKey) -> Task:
        return self.tasks[key[0]][key[1]]

    def forward(self, batch: Batch) -> dict[tuple[str, int], np.ndarray]:
        """Only the forward phase; the output tile of every local task that owns one, by
        (op, task) (a partial sum is no tile)."""
        state = _Step(self, batch, forward_only=True)
        self._run(state, forward_only=True)
        names = [op.name for op in self.graph.ops]
        owned = {
            (i, t.index) for i, op in enumerate(self.graph.ops) for t in owners(op, self.tasks[i])
        }
        return {
            (names[op], task): tile
            for (op, task), tile in state.outputs.items()
            if (op, task) in owned
        }

    def step(self, batch: Batch, lr: float) -> float:
        """Run one SGD step; returns the sum of this rank's partial losses."""
        state = _Step(self, batch)
        self._run(state, forward_only=False)
        for key, grad in state.grads.items():
            self.shards[key] -= lr * grad
        return state.loss

    def _run(self, state: _Step, forward_only: bool) -> None:
        for ins in self.program.instructions:
            if forward_only and _phase(ins) is not Phase.FORWARD:
                continue
            if isinstance(ins, Partial):
                state.partial(ins)
            elif isinstance(ins, ReduceStats):
                state.reduce_stats(ins)
            elif isinstance(ins, SumOutputs):
                state.sum_outputs(ins)
            elif isinstance(ins, ShareGrad):
                state.share_grad(ins)
            elif isinstance(ins, Compute) and ins.phase is Phase.FORWARD:
                state.forward(ins)
            elif isinstance(ins, Compute):
                state.backward(ins)
            elif isinstance(ins, Send):
                state.send(ins.transfer)
            elif isinstance(ins, Wait):
                state.received[ins.transfer.tag][0].Wait()
            elif isinstance(ins, AllReduce):
                group = self.pg.groups[self.graph.ops[ins.op].name][ins.group]
                self.transport.allreduce_sum(state.grads[(group.weight, group.rect)], ins.devices)
        for request, _ in state.sent:
            request.Wait()


def _phase(ins) -> Phase:
    if isinstance(ins, Compute | Partial | ReduceStats):
        return ins.phase
    if isinstance(ins, SumOutputs):
        return Phase.FORWARD
    if isinstance(ins, Send | Wait):
        return ins.transfer.phase
    return Phase.BACKWARD  # all-reduces of weight gradients


class _Step:
    """The buffers of one step on one rank."""

    def __init__(self, rt: Runtime, batch: Batch, forward_only: bool = False) -> None:
        self.rt, self.batch = rt, batch
        self.training = not forward_only
        # Ops with statistics, by (phase, op, task): partial sums, then the group's sums.
        self.partials: dict[tuple[Phase, int, int], np.ndarray] = {}
        self.totals: dict[tuple[Phase, int, int], np.ndarray] = {}
        self.grad_outputs: dict[TaskKey, np.ndarray] = {}
        self.updated: set[WeightKey] = set()  # state shards this step has written
        self.inputs: dict[TaskKey, list[np.ndarray]] = {}
        self.outputs: dict[TaskKey, np.ndarray] = {}
        self.input_grads: dict[TaskKey, tuple[np.ndarray | None, ...]] = {}
        self.grads = {k: np.zeros_like(v) for k, v in rt.shards.items() if k in rt.trainable}
        self.sent: list[tuple[object, np.ndarray]] = []
        self.loss = 0.0
        self.scale = loss_scale(rt.graph, batch.labels) if rt.graph.loss_op else 1.0
        self.received = {}
        for t in rt.program.receives:
            if forward_only and t.phase is not Phase.FORWARD:
                continue
            tensor = rt.graph.ops[t.producer[0]].output
            buf = np.empty(rect_shape(t.rect), dtype=rt.dtype_of(tensor))
            self.received[t.tag] = (rt.transport.irecv(buf, t.src, t.tag), buf)

    def _piece(self, piece: Piece, source: np.ndarray, origin: Rect) -> np.ndarray:
        if piece.tag is not None:
            return self.received[piece.tag][1]
        return source[local_slices(piece.rect, origin)]

    def _assemble_inputs(self, ins: Compute, task: Task) -> list[np.ndarray]:
        op = self.rt.graph.ops[ins.op]
        buffers = []
        for k, (name, role) in enumerate(zip(op.inputs, self.rt.roles[ins.op], strict=True)):
            region = task.inputs[k]
            if role in (TensorRole.WEIGHT, TensorRole.STATE):
                buffers.append(self.rt.shards[(name, region.data)])
            elif role is TensorRole.CONSTANT:
                buffers.append(slice_from_full(np, self.rt.constants[name], region))
            elif role is TensorRole.INPUT:
                buffers.append(slice_from_full(np, self.batch.inputs[name], region))
            elif role is TensorRole.LABELS:
                buffers.append(slice_from_full(np, self.batch.labels, region))
            else:
                buffers.append(empty_buffer(np, region, self.rt.dtype_of(name)))
        for piece in ins.pieces:
            producer = self.rt.task(piece.peer)
            tile = self._piece(piece, self.outputs.get(piece.peer), producer.output)
            buffers[piece.operand][local_slices(piece.rect, task.inputs[piece.operand].buffer)] = (
                tile
            )
        return buffers

    def _args(self, op_index: int, task: Task) -> TaskArgs:
        op = self.rt.graph.ops[op_index]
        key = (op_index, task.index)
        return TaskArgs(
            out_shape=rect_shape(task.output),
            valid=tuple(r.valid for r in task.inputs),
            loss_scale=self.scale,
            origin=tuple(lo for lo, _ in task.output),
            full_shape=self.rt.graph.tensors[op.output].shape,
            random=RandomKey(self.rt.seed, self.batch.step, op_index) if self.training else None,
            stats=self.totals.get((Phase.FORWARD, *key)),
            grad_stats=self.totals.get((Phase.BACKWARD, *key)),
            float_dtype=self.rt.dtype,
            box=task.box,
        )

    def partial(self, ins: Partial) -> None:
        """First half of an op with statistics: assemble, then the task's partial sums."""
        key = (ins.op, ins.task)
        op, task = self.rt.graph.ops[ins.op], self.rt.task(key)
        stats = definition(op.type).statistics
        as_compute = Compute(ins.phase, ins.op, ins.task, ins.pieces)
        if ins.phase is Phase.FORWARD:
            self.inputs[key] = self._assemble_inputs(as_compute, task)
            partial = stats.forward(np, op.attrs, self.inputs[key], self._args(ins.op, task))
        else:
            grad = self.grad_outputs[key] = self._grad_output(as_compute, task)
            inputs, output = self.inputs[key], self.outputs[key]
            args = self._args(ins.op, task)
            partial = stats.backward(np, op.attrs, inputs, output, grad, args)
        self.partials[(ins.phase, *key)] = np.ascontiguousarray(partial, dtype=self.rt.dtype)

    def _local(self, op_index: int, tasks) -> list[int]:
        return [t for t in tasks if self.rt.task((op_index, t)).device == self.rt.rank]

    def sum_outputs(self, ins: SumOutputs) -> None:
        """The group's partial tiles summed; the owner's output becomes the sum."""
        group = self.rt.pg.sums[self.rt.graph.ops[ins.op].name][ins.group]
        mine = self._local(ins.op, group.tasks)
        total = self.outputs[(ins.op, mine[0])].copy()
        for t in mine[1:]:
            total += self.outputs[(ins.op, t)]
        if len(group.devices) > 1:
            self.rt.transport.allreduce_sum(total, group.devices)
        if group.owner in mine:
            self.outputs[(ins.op, group.owner)] = total

    def share_grad(self, ins: ShareGrad) -> None:
        """Every task of the group gets the gradient of the tile its owner received."""
        group = self.rt.pg.sums[self.rt.graph.ops[ins.op].name][ins.group]
        mine = self._local(ins.op, group.tasks)
        owner = self.rt.task((ins.op, group.owner))
        if group.owner in mine:
            as_compute = Compute(Phase.BACKWARD, ins.op, group.owner, ins.pieces)
            grad = self._grad_output(as_compute, owner)
        else:
            grad = np.zeros(rect_shape(owner.output), dtype=self.rt.dtype)
        if len(group.devices) > 1:
            self.rt.transport.allreduce_sum(grad, group.devices)
        for t in mine:
            self.grad_outputs[(ins.op, t)] = grad

    def reduce_stats(self, ins: ReduceStats) -> None:
        """Gather the group's partials (each task's in its slot, by an exact all-reduce
        of a zeroed array) and combine them in task order."""
        op = self.rt.graph.ops[ins.op]
        group = self.rt.pg.stats[op.name][ins.group]
        mine = [t for t in group.tasks if self.rt.task((ins.op, t)).device == self.rt.rank]
        first = self.partials[(ins.phase, ins.op, mine[0])]
        slots = np.zeros((len(group.tasks), *first.shape), dtype=self.rt.dtype)
        for t in mine:
            slots[group.tasks.index(t)] = self.partials.pop((ins.phase, ins.op, t))
        if len(group.devices) > 1:
            self.rt.transport.allreduce_sum(slots, group.devices)
        stats = definition(op.type).statistics
        combine = stats.combine_forward if ins.phase is Phase.FORWARD else stats.combine_backward
        total = combine(np, slots)
        for t in mine:
            self.totals[(ins.phase, ins.op, t)] = total

    def forward(self, ins: Compute) -> None:
        key = (ins.op, ins.task)
        op, task = self.rt.graph.ops[ins.op], self.rt.task(key)
        synced = bool(op.nest.sync_dims)
        buffers = self.inputs[key] if synced else self._assemble_inputs(ins, task)
        args = self._args(ins.op, task)
        d = definition(op.type)
        out = d.forward(np, op.attrs, buffers, args)
        self.inputs[key], self.outputs[key] = buffers, out
        if synced and self.training:
            for k, value in d.statistics.update(np, op.attrs, buffers, args):
                # Every copy of the state gets the same sums, so replicas stay identical;
                # the rank's other tasks on the same channels must not update it again.
                shard = (op.inputs[k], task.inputs[k].data)
                if shard not in self.updated:
                    self.updated.add(shard)
                    self.rt.shards[shard][...] = value
        if op.is_loss:
            self.loss += float(out)

    def _grad_output(self, ins: Compute, task: Task) -> np.ndarray:
        op = self.rt.graph.ops[ins.op]
        if op.is_loss:
            return np.ones((), dtype=self.rt.dtype)
        grad = np.zeros(rect_shape(task.output), dtype=self.rt.dtype)
        for piece in ins.pieces:
            consumer = self.rt.task(piece.peer)
            source = self.input_grads[piece.peer][piece.operand] if piece.tag is None else None
            origin = consumer.inputs[piece.operand].buffer
            grad[local_slices(piece.rect, task.output)] += self._piece(piece, source, origin)
        return grad

    def backward(self, ins: Compute) -> None:
        key = (ins.op, ins.task)
        op, task = self.rt.graph.ops[ins.op], self.rt.task(key)
        shared = op.nest.sync_dims or op.nest.partial_dims
        grad_out = self.grad_outputs.pop(key) if shared else self._grad_output(ins, task)
        grads = definition(op.type).backward(
            np, op.attrs, self.inputs[key], self.outputs[key], grad_out, self._args(ins.op, task)
        )
        for k, (name, role) in enumerate(zip(op.inputs, self.rt.roles[ins.op], strict=True)):
            if role is TensorRole.WEIGHT:
                self.grads[(name, task.inputs[k].data)] += grads[k]
        # Keep only what producers still collect: activation gradients.
        self.input_grads[key] = tuple(
            g if role is TensorRole.ACTIVATION else None
            for g, role in zip(grads, self.rt.roles[ins.op], strict=True)
        )

    def send(self, t: Transfer) -> None:
        if t.phase is Phase.FORWARD:
            tile = self.outputs[t.producer][local_slices(t.rect, self.rt.task(t.producer).output)]
        else:
            consumer = self.rt.task(t.consumer)
            origin = consumer.inputs[t.operand].buffer
            tile = self.input_grads[t.consumer][t.operand][local_slices(t.rect, origin)]
        tile = np.ascontiguousarray(tile)
        self.sent.append((self.rt.transport.isend(tile, t.dst, t.tag), tile))
