"""One step on one rank: the arrays it produces, over the buffers made once.

``Step`` runs the instructions ``Runtime`` dispatches to it: it assembles inputs from
local tiles and received pieces, calls the kernels, moves tiles through the transport,
sums gradient pieces, reduces statistics and partial sums. A step of a pipeline has one
``Step`` per microbatch, on the buffers of the microbatch's slot; what it makes lives
until the microbatch's ``Close`` (its last instruction on the rank). The step's losses,
weight gradients and their sums in flight are shared by its microbatches.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from executor.batch import Batch, loss_scale
from executor.buffers import global_slices, local_slices
from executor.layout import (
    Alias,
    Assembled,
    Copy,
    Fixed,
    Gathered,
    GradAlias,
    Received,
    Rows,
    TaskKey,
)
from executor.lifetimes import compute_event, gather_event, send_event, sum_event
from executor.program import (
    AllReduce,
    Close,
    Compute,
    GatherWeight,
    Partial,
    Phase,
    Recv,
    ReduceScatter,
    ReduceStats,
    Reopen,
    Send,
    ShareGrad,
    SumOutputs,
    Wait,
    WaitWeight,
)
from onnx2soap.ir import TensorRole
from onnx2soap.ops import TaskArgs, definition
from onnx2soap.ops.base import RandomKey, Released, released
from onnx2soap.soap.partition import Rect, SumGroup, rect_shape
from onnx2soap.soap.streamed import KeyBlock, block_of

WeightKey = tuple[str, Rect]


def _owns(array, inputs) -> bool:
    """A kernel's result that owns its memory: made afresh, not a view of anything and
    not one of its input buffers (those a step may round or keep in place)."""
    return getattr(array, "base", True) is None and all(array is not x for x in inputs)


class Step:
    """One step on one rank: the arrays it produces, over the buffers made once."""

    def __init__(
        self,
        rt,
        batch: Batch,
        training: bool,
        grad_seed: float = 1.0,
        microbatch: int = 0,
        buffers=None,
        first: Step | None = None,
    ) -> None:
        """``rt`` is the rank's ``Runtime``: its program, buffers, shards and transport.
        ``grad_seed``: the loss's gradient, where the backward starts (fp16's loss scale).
        ``microbatch``: which of the step's microbatches of ``batch`` this is, on
        ``buffers`` (its slot's; the runtime's first set when None); ``first``: the
        step's first microbatch, whose losses and sums in flight this one shares."""
        self.rt, self.batch, self.training = rt, batch.microbatch(microbatch), training
        self.microbatch = microbatch
        self.grad_seed = grad_seed
        self.rounding = rt.rounding
        self.half = rt.half
        self.buf = buffers if buffers is not None else rt.buffers
        self.xp = rt.xp
        self.outputs: dict[TaskKey, object] = {}
        self.inputs: dict[TaskKey, list] = {}
        self.input_grads: dict[TaskKey, list] = {}
        self.grad_outputs: dict[TaskKey, object] = {}
        self.stashes: dict[TaskKey, dict] = {}  # OpDef.stashes: forward to backward
        self.partials: dict[tuple[Phase, int, int], object] = {}
        self.totals: dict[tuple[Phase, int, int], object] = {}
        self.updated: set[WeightKey] = set()  # state shards this microbatch has written
        self.pending: dict[int, object] = {}
        # ZeRO-3: weights gathered whole for the op whose phase runs (``wait_weight``),
        # and those being gathered for the next: (the array, the gather in flight)
        self.gathered: dict[WeightKey, object] = {}
        self.gathering: dict[WeightKey, tuple] = {}
        # receive buffers, by transfer: made when posted, dropped once read (assembled,
        # summed, or taken as the input buffer or output gradient they are whole)
        self.received: dict[int, object] = {}
        # assembled input buffers more than one local task reads, until the last has
        # taken it: (tensor, region) -> [buffer, readers still to take it]
        self.assembled: dict[tuple, list] = {}
        # The plan's recomputed ops (executor/recompute.py); a forward-only pass keeps all.
        self.recompute = rt.recompute if training else None
        if first is not None:
            self.reductions, self.scatters = first.reductions, first.scatters
            self.losses, self.scale = first.losses, first.scale
            return
        self.reductions: list = []  # weight gradients' all-reduces in flight
        self.scatters: list = []  # ZeRO: (a bucket's shard keys, its reduce-scatter in flight)
        self.losses: list = []
        self.scale = 1.0
        if rt.graph.loss_op is not None:
            self.scale = batch.loss_scale
            if self.scale is None:
                self.scale = loss_scale(rt.graph, batch.labels, batch.microbatches)

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
            ReduceScatter: self.reduce_scatter,
            GatherWeight: self.gather_weight,
            WaitWeight: self.wait_weight,
            Reopen: self.reopen,
            Close: self.close,
        }

    def reopen(self, ins: Reopen) -> None:
        """This microbatch takes buffers an earlier one of the step used. On a GPU the
        host waits for the device, so that no receive (communication stream) or host copy
        writes a buffer the earlier microbatch's kernels still read."""
        if self.xp is not np:
            self.rt.device.synchronize()

    def close(self, ins: Close) -> None:
        """The microbatch is done on this rank: drop its activations and gradients (an
        evaluation keeps its outputs, which the runtime returns)."""
        if self.training:
            for held in (self.outputs, self.inputs, self.input_grads, self.grad_outputs):
                held.clear()
            self.totals.clear()

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
        shape, dtype = self.buf.receives[t.id]
        buffer = self.received[t.id] = self.xp.empty(shape, dtype=dtype)
        self.pending[t.id] = self.rt.transport.recv(buffer, t.src)

    def wait(self, ins: Wait) -> None:
        self.rt.transport.wait(self.pending.pop(ins.transfer.id))

    def send(self, ins: Send) -> None:
        t = ins.transfer
        if t.phase is Phase.FORWARD:
            whole = self.outputs[t.producer]
            origin = self.rt.output_rect(t.producer)
        else:
            whole = self.input_grads[t.consumer][t.operand]
            origin = self.rt.task(t.consumer).inputs[t.operand].buffer
        tile = whole[local_slices(t.rect, origin)]
        if not tile.flags.c_contiguous:
            # A strided piece goes through a copy made for this send, which the transport
            # holds until the send completes and then lets go: kept per transfer across
            # steps, Megatron's sequence-parallel pieces of LLaMA-3-8B had been 151 GB
            tile = self.xp.ascontiguousarray(tile)
        self.rt.transport.send(tile, t.dst)
        if not self.training:
            return
        if t.phase is Phase.BACKWARD:
            self._drop_grads(self.rt.lifetimes.grads_after.get(send_event(t.id), ()))
            return
        self._drop_tiles(self.rt.lifetimes.tiles_after.get(send_event(t.id), ()))
        if self.recompute:
            self._drop(self.recompute.drop_after.get(send_event(t.id), ()))

    def _source(self, copy: Copy, forward: bool):
        if copy.transfer is not None:
            return self.received.pop(copy.transfer)  # read once: copied, then gone
        if forward:
            return self.outputs[copy.peer][copy.source]
        return self.input_grads[copy.peer][copy.operand][copy.source]

    def _assemble_inputs(self, key: TaskKey) -> list:
        return [self._input(source) for source in self.buf.inputs[key]]

    def _input(self, source):
        if isinstance(source, Fixed):
            return source.array
        if isinstance(source, Gathered):
            return self.gathered[source.key]
        if isinstance(source, Alias):
            return self.outputs[source.producer]
        if isinstance(source, Received):
            return self.received.pop(source.transfer)
        if isinstance(source, Rows):
            return self._rows(source)
        return self._assembled(source)

    def _assemble_streamed(self, key: TaskKey, blocks: tuple[KeyBlock, ...]):
        """Ring attention: the task's inputs, but its streamed operands' received pieces
        (whose waits the program leaves to the kernel) only waited for and copied in as
        the kernel reaches their block of keys (``Streamed``): (the buffers, per block
        what arrives with it: (transfer, operand, where in its buffer or None for the
        whole, whether this task fills it))."""
        streams = definition(self.rt.graph.ops[key[0]].type).streams
        buffers, later = [], [[] for _ in blocks]
        for k, source in enumerate(self.buf.inputs[key]):
            if k not in streams.operands or not isinstance(source, Assembled | Received):
                buffers.append(self._input(source))
            elif isinstance(source, Received):  # one piece of every key: the first block's
                later[0].append((source.transfer, k, None, False))
                buffers.append(self.received.pop(source.transfer))
            else:
                buffers.append(self._streamed_buffer(source, k, streams.axis, blocks, later))
        return buffers, later

    def _streamed_buffer(self, source: Assembled, k: int, axis: int, blocks, later) -> object:
        """``_assembled`` with the received pieces left to their blocks (``later``); the
        local ones copied now. A buffer another local task filled already is taken as
        it is, this task's own pieces waited for and dropped at their blocks."""
        readers = self.buf.readers[source.share] if source.share is not None else 1
        entry = self.assembled.get(source.share) if readers > 1 else None
        fresh = entry is None
        if fresh:
            entry = [source.make(self.xp), readers]
            if readers > 1:
                self.assembled[source.share] = entry
        first = source.region.buffer[axis][0]  # the buffer's first key
        for copy in source.copies:
            if copy.transfer is None:
                if fresh:
                    entry[0][copy.into] = self._source(copy, forward=True)
                continue
            keys = (first + copy.into[axis].start, first + copy.into[axis].stop)
            later[block_of(blocks, keys)].append((copy.transfer, k, copy.into, fresh))
        entry[1] -= 1
        if entry[1] == 0:
            self.assembled.pop(source.share, None)
        return entry[0]

    def _arrive(self, arriving, buffers: list, wide: list) -> None:
        """A block's received pieces: waited for and copied into their buffers; where
        the kernel reads float32 copies of half-format buffers (made before the pieces
        were there), those too."""
        for transfer, k, into, fills in arriving:
            self.rt.transport.wait(self.pending.pop(transfer))
            widened = wide[k] is not buffers[k]
            if into is None:  # the whole buffer, received in place
                if widened:
                    wide[k][...] = self.half.widen(buffers[k])
                continue
            data = self.received.pop(transfer)  # read once: copied, then gone
            if fills:
                buffers[k][into] = data
                if widened:
                    wide[k][into] = self.half.widen(data)

    def _assembled(self, source: Assembled):
        """The buffer, made and filled by the first local task that reads it, the same
        array for the others (kernels never write their inputs); their own pieces are
        dropped unread."""
        readers = self.buf.readers[source.share] if source.share is not None else 1
        entry = self.assembled.get(source.share) if readers > 1 else None
        if entry is None:
            buffer = source.make(self.xp)
            for copy in source.copies:
                buffer[copy.into] = self._source(copy, forward=True)
            entry = [buffer, readers]
            if readers > 1:
                self.assembled[source.share] = entry
        else:
            for copy in source.copies:
                if copy.transfer is not None:
                    self.received.pop(copy.transfer)
        entry[1] -= 1
        if entry[1] == 0:
            self.assembled.pop(source.share, None)
        return entry[0]

    def _rows(self, source: Rows):
        held, first = self.batch.rows(source.name, self.rt.graph.labels)
        (lo, hi), *rest = source.data
        rows = held[(slice(lo - first, hi - first), *global_slices(tuple(rest)))]
        stored = source.buffer.dtype != rows.dtype  # data in the half format; targets not
        if source.host is None:  # numpy: straight into the buffer
            source.buffer[source.into] = self.half.narrow(rows) if stored else rows
        else:
            np.copyto(source.host, rows)
            target = source.buffer if source.staged is None else source.staged
            self.rt.device.to_device(source.host, out=target)
            if source.staged is not None:
                staged = source.staged
                source.buffer[source.into] = self.half.narrow(staged) if stored else staged
        return source.buffer

    def _grad_output(self, key: TaskKey):
        """The task's output gradient, gathered from its readers' input gradients; those
        read here for the last time on the rank are dropped (executor/lifetimes.py)."""
        grad = self._gather_grad(key)
        if self.training:
            self._drop_grads(self.rt.lifetimes.grads_after.get(gather_event(key), ()))
        return grad

    def _drop_grads(self, keys) -> None:
        for consumer, k in keys:
            grads = self.input_grads[consumer]
            grads[k] = None
            if all(g is None for g in grads):
                del self.input_grads[consumer]

    def _gather_grad(self, key: TaskKey):
        op = self.rt.graph.ops[key[0]]
        if op.is_loss:
            return self.xp.full((), self.grad_seed, dtype=self.rt.dtype)
        source = self.buf.grad_outputs[key]
        if isinstance(source, GradAlias):
            return self.input_grads[source.consumer][source.operand]
        if isinstance(source, Received):
            return self.received.pop(source.transfer)
        grad = self.xp.zeros(source.shape, dtype=self.rt.dtype)  # summed in float32
        for copy in source.copies:
            grad[copy.into] += self.half.widen(self._source(copy, forward=False))
        return grad

    # -- computing --------------------------------------------------------------------

    def _args(self, key: TaskKey) -> TaskArgs:
        op = self.rt.graph.ops[key[0]]
        args = replace(
            self.buf.args[key],
            loss_scale=self.scale,
            random=RandomKey(self.rt.seed, self.batch.step, key[0]) if self.training else None,
            stats=self.totals.get((Phase.FORWARD, *key)),
            grad_stats=self.totals.get((Phase.BACKWARD, *key)),
            # kept from the forward to the backward (a recomputed forward fills it again)
            stash=self.stashes.setdefault(key, {}) if definition(op.type).stashes else None,
        )
        axis = self.rt.random_axes.get(key[0]) if self.microbatch else None
        if axis is None:
            return args
        # A random op numbers its elements in the whole batch's output: microbatch m's
        # samples follow the m before it along the sample axis, so a sample draws the
        # bits it draws in a step without microbatches (where the samples are the
        # axis's outer part: a plain batch axis, or one merged with the heads behind it).
        size = args.full_shape[axis]
        origin = list(args.origin)
        origin[axis] += self.microbatch * size
        full = list(args.full_shape)
        full[axis] = size * self.rt.program.microbatches
        return replace(args, origin=tuple(origin), full_shape=tuple(full))

    def compute(self, ins: Compute) -> None:
        # sends found complete go before the kernel allocates: without a call into the
        # transport since, a rank would keep them through it (sim/memory.py prices a
        # sent piece through the kernel that reads it, where its receiver has taken it)
        self.rt.transport.let_go()
        if ins.phase is Phase.FORWARD:
            self.forward(ins)
        else:
            self.backward(ins)
        for key in self.rt.gathered_until.get((ins.phase, ins.op, ins.task), ()):
            del self.gathered[key]  # the op's last task of the phase on the rank has run

    def gather_weight(self, ins: GatherWeight) -> None:
        """ZeRO-3: start gathering a sharded group's whole Rect from the members' rows,
        an op ahead of the one whose tasks read it (``wait_weight``); in mixed precision
        the rows narrowed to the half format first, as FSDP's param_dtype does: half
        the bytes moved and held, and no half copy kept between steps."""
        key = self._group_key(ins)
        sharded = self.rt.zero3[key]
        rows = self.half.narrow(self.rt.shards[key])
        full = self.xp.empty(rect_shape(key[1]), dtype=rows.dtype)
        lo, hi = sharded.rows(self.rt.rank)
        full[lo:hi] = rows
        del rows
        pending = self.rt.transport.all_gather(full, ins.devices, sharded.chunks)
        self.gathering[key] = (full, pending)

    def wait_weight(self, ins: WaitWeight) -> None:
        """ZeRO-3: the gather complete, for the op's tasks of the phase on the rank
        (gathered in the half format where the kernels read it so)."""
        key = self._group_key(ins)
        full, pending = self.gathering.pop(key)
        self.rt.transport.wait(pending)
        self.gathered[key] = full

    def _group_key(self, ins: GatherWeight | WaitWeight) -> WeightKey:
        group = self.rt.pg.groups[self.rt.graph.ops[ins.op].name][ins.group]
        return (group.weight, group.rect)

    def _regathered(self, key: TaskKey) -> None:
        """ZeRO-3: the task's weights as gathered again for its backward (its forward
        kept none of them; one its backward does not read is not gathered)."""
        held = self.inputs[key]
        for k, source in enumerate(self.buf.inputs[key]):
            if isinstance(source, Gathered) and source.key in self.gathered:
                held[k] = self.gathered[source.key]

    def partial(self, ins: Partial) -> None:
        """First half of an op with statistics: assemble, then the task's partial sums."""
        key = (ins.op, ins.task)
        op = self.rt.graph.ops[ins.op]
        stats = definition(op.type).statistics
        xp = self.xp
        if ins.phase is Phase.FORWARD:
            self.inputs[key] = self._assemble_inputs(key)
            inputs = self.half.widen_all(self.inputs[key])
            partial = stats.forward(xp, op.attrs, inputs, self._args(key))
        else:
            if self.recompute:
                self._rematerialize(key)
            if self.gathered:
                self._regathered(key)
            grad = self.grad_outputs[key] = self._grad_output(key)
            args = self._args(key)
            inputs, out, grad = self._widened(key, grad)
            partial = stats.backward(xp, op.attrs, inputs, out, grad, args)
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
        """The group's partial tiles summed; this rank's holder's output becomes the sum,
        or where the group reduce-scatters, its chunk of the sum."""
        self.rt.transport.let_go()  # before the sum's arrays, as before a kernel
        group = self.rt.pg.sums[self.rt.graph.ops[ins.op].name][ins.group]
        if group.scatter is not None:
            self._scatter_outputs(ins, group)
            return
        mine = self._local(ins.op, group.tasks)
        first = self.outputs[(ins.op, mine[0])]
        total = self.xp.zeros(first.shape, dtype=self.rt.dtype)  # the step's, float32
        for t in mine:
            total += self.half.widen(self.outputs.pop((ins.op, t)))  # summed: gone
        if len(group.devices) > 1:
            self.rt.transport.wait(self.rt.transport.allreduce(total, group.devices))
        # the op's output, as one task's would be: stored in the half format (a copy),
        # or rounded to its values in place; it lives as any tile (executor/lifetimes.py)
        holder = (ins.op, group.holder(self.rt.rank))
        if self.half.active:
            self.outputs[holder] = self.half.narrow(total)
        else:
            self.rounding(total)
            self.outputs[holder] = total
        if self.training:
            self._drop_tiles(self.rt.lifetimes.tiles_after.get(sum_event(ins.op, ins.group), ()))

    def _scatter_outputs(self, ins: SumOutputs, group: SumGroup) -> None:
        """Reduce-scatter: the local partial tiles summed into a buffer of the step's
        (the tile with the scatter's axis first, where each chunk is one run), the ring
        leaves this rank's chunk summed, and the holder keeps a copy of it alone (the
        full-size buffer goes at once: a member holds 1/k of the sum)."""
        xp, axis = self.xp, group.scatter.axis
        mine = self._local(ins.op, group.tasks)
        moved = xp.moveaxis(self.half.widen(self.outputs[(ins.op, mine[0])]), axis, 0)
        # Summed in place where the kernel made the partial tile afresh (or it was
        # widened from the half format) and the layout is already the ring's; else into
        # a copy (never into an input of the kernel).
        owned = self.half.active or self._owned_output(ins.op, mine[0])
        total = moved if owned and moved.flags.c_contiguous else xp.ascontiguousarray(moved)
        for t in mine[1:]:
            total += xp.moveaxis(self.half.widen(self.outputs[(ins.op, t)]), axis, 0)
        runs = group.scatter.runs(group.tile)
        self.rt.transport.wait(self.rt.transport.reduce_scatter(total, group.devices, runs))
        for t in mine:  # summed: the partial tiles go (``total`` may be the first's)
            self.outputs.pop((ins.op, t))
        holder = group.holder(self.rt.rank)
        lo, hi = runs[group.devices.index(self.rt.rank)]
        chunk = rect_shape(group.held(self.rt.rank))
        first = (chunk[axis], *chunk[:axis], *chunk[axis + 1 :])
        part = xp.moveaxis(total.reshape(-1)[lo:hi].reshape(first), 0, axis).copy()
        if self.half.active:  # the op's output, as one task's would be
            self.outputs[(ins.op, holder)] = self.half.narrow(part)
        else:
            self.rounding(part)
            self.outputs[(ins.op, holder)] = part
        if self.training:
            self._drop_tiles(self.rt.lifetimes.tiles_after.get(sum_event(ins.op, ins.group), ()))

    def _owned_output(self, op: int, task: int) -> bool:
        out = self.outputs[(op, task)]
        return _owns(out, self.inputs.get((op, task), ()))

    def share_grad(self, ins: ShareGrad) -> None:
        """Every task of the group gets the gradient of its tile: the pieces its holders
        received, summed over the group (all-reduce); where the group reduce-scattered,
        each holder's pieces cover its chunk alone, and an all-gather of the chunks
        gives every member the whole tile's gradient."""
        self.rt.transport.let_go()  # before the gradient's copy, as before a kernel
        group = self.rt.pg.sums[self.rt.graph.ops[ins.op].name][ins.group]
        mine = self._local(ins.op, group.tasks)
        holder = (ins.op, group.holder(self.rt.rank))
        if group.scatter is None:
            source = self._grad_output(holder)
            grad = self.half.widen(source)  # a float32 array of the step's own, summed
            if grad is source:  # in place by the ring: a copy, not a reader's gradient
                grad = self.xp.array(source, dtype=self.rt.dtype)
            if len(group.devices) > 1:
                self.rt.transport.wait(self.rt.transport.allreduce(grad, group.devices))
        else:
            axis = group.scatter.axis
            tile = rect_shape(group.tile)
            moved = (tile[axis], *tile[:axis], *tile[axis + 1 :])
            gathered = self.xp.empty(moved, dtype=self.rt.dtype)  # the ring fills it
            runs = group.scatter.runs(group.tile)
            lo, hi = runs[group.devices.index(self.rt.rank)]
            own = self.xp.moveaxis(self.half.widen(self._grad_output(holder)), axis, 0)
            gathered.reshape(-1)[lo:hi] = own.reshape(-1)
            pending = self.rt.transport.all_gather(gathered, group.devices, runs)
            self.rt.transport.wait(pending)
            grad = self.xp.moveaxis(gathered, 0, axis)  # a view: kernels never write it
        for t in mine:
            self.grad_outputs[(ins.op, t)] = grad

    def reduce_stats(self, ins: ReduceStats) -> None:
        """Gather each member group's partials (each task's in its slot, by an exact
        all-reduce of a zeroed array: the members' slots side by side in one, so a run of
        ops pays one ring) and combine each member's in task order."""
        xp, pg, graph = self.xp, self.rt.pg, self.rt.graph
        members = []  # (op index, group, the rank's tasks in it, its slots' shape)
        for i, g in ins.members:
            group = pg.stats[graph.ops[i].name][g]
            mine = self._local(i, group.tasks)
            first = self.partials[(ins.phase, i, mine[0])]
            members.append((i, group, mine, (len(group.tasks), *first.shape)))
        sizes = [int(np.prod(shape)) for *_, shape in members]
        flat = self._slots((ins.phase, ins.members), (sum(sizes),))
        offsets = np.cumsum([0, *sizes])
        views = []
        for (i, group, mine, shape), lo, hi in zip(members, offsets, offsets[1:], strict=False):
            slots = flat[lo:hi].reshape(shape)
            for t in mine:
                slots[group.tasks.index(t)] = self.partials.pop((ins.phase, i, t))
            views.append(slots)
        if len(ins.devices) > 1:
            self.rt.transport.wait(self.rt.transport.allreduce(flat, ins.devices))
        forward = ins.phase is Phase.FORWARD
        for (i, _, mine, _), slots in zip(members, views, strict=True):
            stats = definition(graph.ops[i].type).statistics
            combine = stats.combine_forward if forward else stats.combine_backward
            total = combine(xp, slots)
            for t in mine:
                self.totals[(ins.phase, i, t)] = total

    def forward(self, ins: Compute) -> None:
        key = (ins.op, ins.task)
        op = self.rt.graph.ops[ins.op]
        synced = bool(op.nest.sync_dims)
        blocks = self.rt.key_blocks.get(key)
        if blocks:
            buffers, later = self._assemble_streamed(key, blocks)
        else:
            buffers = self.inputs[key] if synced else self._assemble_inputs(key)
        args = self._args(key)
        d = definition(op.type)
        into = self._stored_tile(op, args)
        wide = self.half.widen_all(buffers)
        if d.overwrites and not synced:  # statistics read the copies after the kernel
            args = replace(args, owned=self.half.owned(buffers, wide))
        if blocks:  # ring attention: each block computed on as soon as it is there

            def arrive(j: int) -> None:
                self._arrive(later[j], buffers, wide)

            spans = [b.spans for b in blocks]
            out = d.streams.forward(self.xp, op.attrs, wide, args, spans, arrive)
        else:
            out = d.forward(self.xp, op.attrs, wide, args)
        if not op.is_loss:
            out = self._stored(out, wide, into)
        self.inputs[key], self.outputs[key] = buffers, out
        if synced and self.training:
            task = self.rt.task(key)
            for k, value in d.statistics.update(self.xp, op.attrs, wide, args):
                # Every copy of the state gets the same sums, so replicas stay identical;
                # the rank's other tasks on the same channels must not update it again.
                shard = (op.inputs[k], task.inputs[k].data)
                if shard not in self.updated:
                    self.updated.add(shard)
                    self.rt.shards[shard][...] = value
        if op.is_loss:
            self.losses.append(out)
        if not self.training:
            if self.gathered:  # ZeRO-3: not held past the op's tasks (evaluation)
                sources = self.buf.inputs[key]
                for k, source in enumerate(sources):
                    if isinstance(source, Gathered):
                        buffers[k] = released(buffers[k])
            return
        kept, _ = self.rt.lifetimes.keeps[ins.op]
        if self.rt.zero3 and not (self.recompute and ins.op in self.recompute.ops):
            # ZeRO-3: a gathered weight is gathered again for the backward, not kept
            sources = self.buf.inputs[key]
            kept = {k for k in kept if not isinstance(sources[k], Gathered)}
        for k, buffer in enumerate(buffers):
            if k not in kept and buffer is not None:
                buffers[k] = released(buffer)  # its backward reads the shape alone
        self._drop_tiles(self.rt.lifetimes.tiles_after.get(compute_event(key), ()))
        if self.recompute:
            self._drop(self.recompute.drop_after.get(compute_event(key), ()))

    def backward(self, ins: Compute) -> None:
        key = (ins.op, ins.task)
        op, task = self.rt.graph.ops[ins.op], self.rt.task(key)
        if self.recompute:
            self._rematerialize(key)
        if self.gathered:
            self._regathered(key)
        shared = op.nest.sync_dims or self.rt.pg.sums[op.name]
        grad_out = self.grad_outputs.pop(key) if shared else self._grad_output(key)
        inputs, out, wide_grad = self._widened(key, grad_out)
        d, args = definition(op.type), self._args(key)
        if d.overwrites:  # its float32 copies are the kernel's to write over
            args = replace(args, owned=self.half.owned(self.inputs[key], inputs))
        blocks = self.rt.key_blocks.get(key)
        if blocks:  # ring attention's backward, block by block of keys
            spans = [b.spans for b in blocks]
            grads = d.streams.backward(self.xp, op.attrs, inputs, out, wide_grad, args, spans)
        else:
            grads = d.backward(self.xp, op.attrs, inputs, out, wide_grad, args)
        self.stashes.pop(key, None)
        passed = [g is wide_grad for g in grads]  # the output gradient itself, passed on
        # the float32 copies go before rounding makes its temporaries (as the memory
        # model prices a kernel's conversions and rounding's at different moments)
        del inputs, out, wide_grad
        roles = self.rt.roles[ins.op]
        weights = [role is TensorRole.WEIGHT for role in roles]
        if self.rounding.active:  # a weight's rounded, summed in float32; others stored
            grads = tuple(
                self._rounded(g, key) if w else self.half.narrow(g) if act else None
                for g, w, act in zip(grads, weights, self._activations(roles), strict=True)
            )
        for k, (name, weight) in enumerate(zip(op.inputs, weights, strict=True)):
            if weight:
                self._weight_grad((name, task.inputs[k].data), grads[k], passed[k], key)
        # Keep only what producers still collect: activation gradients, until their last
        # reader on the rank (executor/lifetimes.py).
        kept = [
            g if role is TensorRole.ACTIVATION else None
            for g, role in zip(grads, roles, strict=True)
        ]
        if any(g is not None for g in kept):
            self.input_grads[key] = kept
        if self.recompute:
            if ins.op in self.recompute.ops:
                self._drop((key,))  # its consumers' backwards are done: they come first
            for tile in self.recompute.release_after.get(key, ()):
                self.outputs.pop(tile, None)  # made again for backwards all done now
        # Nothing reads its buffers or its tile any more: its consumers' backwards came
        # first (a reader that kept the tile in place holds its own reference).
        self.inputs.pop(key, None)
        self.outputs.pop(key, None)

    # -- lifetimes (executor/lifetimes.py) -------------------------------------------------

    def _drop_tiles(self, keys) -> None:
        """Let go of tiles whose last forward reader on the rank has run."""
        for key in keys:
            self.outputs.pop(key, None)

    @staticmethod
    def _activations(roles) -> list[bool]:
        return [role is TensorRole.ACTIVATION for role in roles]

    def _stored_tile(self, op, args):
        """Under mixed precision, the array a float op's forward result is narrowed
        into, made before its kernel runs. The kernel's float32 arrays then lie above the
        tile in the heap and, freed, merge back into its free top; made after them, the
        kept tile would sit over the hole they leave, which glibc keeps
        (``host_memory.py``): a bf16 GPT's ranks peaked 10 MB higher so."""
        graph = self.rt.graph
        if not self.half.active or op.is_loss or not graph.tensors[op.output].dtype.is_float:
            return None
        return self.half.empty(args.out_shape)

    def _stored(self, out, inputs, into=None):
        """A kernel's result as the step keeps it: in the half format (a copy, into
        ``into`` where given), or rounded to its values in place where the kernel made
        it afresh (a view of an input holds rounded values already)."""
        if self.half.active:
            return self.half.narrow(out, into)
        if _owns(out, inputs):
            self.rounding(out)
        return out

    def _widened(self, key: TaskKey, grad_out):
        """A backward kernel's arguments in float32: the task's inputs, its output (or
        its stand-in) and its output gradient."""
        inputs = self.half.widen_all(self.inputs[key])
        return inputs, self.half.widen(self._saved_output(key)), self.half.widen(grad_out)

    def _saved_output(self, key: TaskKey):
        """The task's output tile for its backward: the tile, or where its op's backward
        does not read it (and it is gone), its shape and dtype."""
        out = self.outputs.get(key)
        if out is not None:
            return out
        op = self.rt.graph.ops[key[0]]
        return Released(rect_shape(self.rt.output_rect(key)), self.rt.dtype_of(op.output))

    # -- recomputation (executor/recompute.py) ----------------------------------------------

    def _drop(self, keys) -> None:
        """Let go of recomputed tiles and of every reference a consumer kept to them (a
        consumer that released it reads its shape alone)."""
        for key in keys:
            self.outputs.pop(key, None)
            for consumer, k in self.recompute.alias_readers.get(key, ()):
                inputs = self.inputs.get(consumer)
                if inputs is not None and not isinstance(inputs[k], Released):
                    inputs[k] = None

    def _rematerialize(self, key: TaskKey, for_readers: bool = False) -> None:
        """Before a task's backward: its inputs and, if recomputed, its output where its
        backward reads it, computed again where they were dropped (their producers'
        first, recursively: ``for_readers``, a reader needs the output)."""
        inputs = self.inputs[key]
        for k, buffer in enumerate(inputs):
            if buffer is None:
                producer = self.buf.inputs[key][k].producer  # only an Alias is dropped
                if producer not in self.outputs:
                    self._rematerialize(producer, for_readers=True)
                inputs[k] = self.outputs[producer]
        needed = for_readers or key[0] in self.recompute.own_output
        if key[0] in self.recompute.ops and key not in self.outputs and needed:
            op = self.rt.graph.ops[key[0]]
            wide = self.half.widen_all(inputs)
            out = definition(op.type).forward(self.xp, op.attrs, wide, self._args(key))
            self.outputs[key] = self._stored(out, wide)  # as the forward stored it

    def _rounded(self, grad, key: TaskKey):
        """A kernel's gradient in the half format: rounded in place where the kernel made
        it afresh, else (a view, an argument) as a rounded copy."""
        if grad is None or grad.dtype != np.float32:
            return grad
        if not _owns(grad, self.inputs[key]):
            grad = self.xp.array(grad, order="C")
        self.rounding(grad)
        return grad

    def _weight_grad(self, shard, grad, passed: bool, key: TaskKey) -> None:
        """Sum a task's weight gradient into the shard's. The first one this step becomes
        the shard's gradient as it is, when the kernel made it afresh (no accumulator is
        kept between steps: a weight-sized buffer fewer at the peak, no zeroing, no sum).
        Else it is copied, in C order: the all-reduce sums it in place through a flat
        view (a view of another array, or the kernel's own arguments, are not its to own;
        ``passed``: it is the output gradient the kernel was given)."""
        summed = self.buf.grads.get(shard)
        if summed is not None:
            summed += grad
            return
        fresh = (
            _owns(grad, self.inputs[key])
            and grad.dtype == self.rt.dtype
            and grad.flags.c_contiguous
            and not passed
        )
        if not fresh:
            grad = self.xp.array(grad, dtype=self.rt.dtype, order="C")
        self.buf.grads[shard] = grad

    def allreduce(self, ins: AllReduce) -> None:
        """Start the sum of a gradient bucket's replica groups, their gradients as one
        run (soap/buckets.py); ``end_step`` completes it (the backward pass goes on
        meanwhile)."""
        keys = self._member_keys(ins.members)
        grads = [self.buf.gradient(key, self.xp) for key in keys]
        self.reductions.append(self.rt.transport.allreduce_all(grads, ins.devices))

    def reduce_scatter(self, ins: ReduceScatter) -> None:
        """ZeRO: start summing a bucket's sharded groups' gradients into each member's
        rows, as one collective. The rank first completes the one it started before
        (the previous bucket's): at ZeRO-2 that drops those full-size gradients, so
        that a rank holds at most one bucket's in flight besides the bucket its
        backward fills (the memory model counts the same)."""
        self.finish_scatters()
        keys = self._member_keys(ins.members)
        grads = [self.buf.gradient(key, self.xp) for key in keys]
        runs = [self.rt.zero[key].chunks for key in keys]
        pending = self.rt.transport.reduce_scatter_all(grads, ins.devices, runs)
        self.scatters.append((tuple(keys), pending))

    def _member_keys(self, members: tuple[tuple[int, int], ...]) -> list[tuple]:
        """The shard keys of a bucket's (op, group) members, in member order."""
        groups, ops = self.rt.pg.groups, self.rt.graph.ops
        return [(g.weight, g.rect) for g in (groups[ops[i].name][k] for i, k in members)]

    def finish_scatters(self) -> None:
        """Complete the reduce-scatters in flight; at ZeRO-2 the step keeps only the
        rank's rows of each gradient (a copy: a view would keep the whole buffer)."""
        for keys, pending in self.scatters:
            self.rt.transport.wait(pending)
            for key in keys:
                if self.rt.zero_stages.weight(key[0]).shards_gradients:
                    lo, hi = self.rt.zero[key].rows(self.rt.rank)
                    self.buf.grads[key] = self.buf.grads[key][lo:hi].copy()
        self.scatters.clear()
