"""Per-device peak memory of one training step, as the executor allocates it.

A rank's peak is in its backward, over all it holds but the gradients the backward (in
reverse graph order) has yet to make or has let go of, or in its forward, over what it
holds before and during one kernel:

- made once, before the first step (``executor/layout.py``, ``runtime.py``): every
  weight and state Rect it holds, once, with the optimizer's state per trainable one
  (none for SGD, one array for momentum, two for Adam) and mixed precision's half-format
  copy; per task, the buffers of its data rows, labels (at their own width) and
  constants' cuts (none for a broadcast constant read without padding: a view);
- made by each step, each living as long as something reads it
  (``executor/lifetimes.py``; what an op's backward reads: ``soap/saved.py``): the
  batch rows its tasks read (the labels and the constants whole); every task's output
  tile, to its op's backward where that reads it, else to its last reader's forward
  (longer where a reader keeps it in place: ``EdgeMemory``),
  a partial sum's partial tiles while the sum runs (with a CPU rank's ring scratch,
  1/k of the sum, as the backward's share of its gradient has) and the sum then as any
  tile; its
  activation inputs' buffers, to its backward where that reads them, else while its
  forward runs, none where one piece fills one whole (a local producer's whole tile, or
  a received piece, whose receive buffer is then the input buffer); each receive
  buffer, from the producer's send to the consumer's forward (a gradient's, from the
  consumer's backward to the producer's gather, or to the end of its backward where it
  is the output gradient whole); the gradients of
  its activation inputs, from its backward until their producer's backward has gathered
  them (one whose pieces all go to other devices, and none as a view, until they are
  sent: ``EdgeMemory.unread_grads``); each task's gathered output gradient while its
  backward runs (an op with partial sums: the holder's while ``ShareGrad`` copies it
  into the group's shared one, which alone its kernels read); the losses; and
  each trainable Rect's gradient: the first backward kernel's fresh array, which later
  ones are summed into, kept until the update. Under mixed precision every stored array
  is 2 bytes an element (``stored``) and a kernel holds float32 copies of its stored
  operands and result (``_conversions``: none of the operands its kernels write over,
  ``OpDef.overwrites``) beside the stored tile it narrows into, made before it runs;
- under ZeRO (soap/zero.py), a sharded group's optimizer state is the member's rows
  only; at stage 3 so is its weight (no half-format copy kept), gathered whole in
  the format the kernels read for the kernels of each phase of its op;
  at stage 2 and 3 so is its gradient once the reduce-scatter is done: the full-size
  gradient counts in its op's backward kernels (their peak) and stays, in flight,
  through the backward of the ops after it in the backward's order until the rank's
  next reduce-scatter starts (``executor/step.py`` completes one before the next);
- sent pieces: the transport holds a sent array until its send completes, no longer
  (executor/transport.py, nccl.py), and a strided piece is sent from a copy made for the
  send (``executor/step.py``). A send completes once its receiver has taken it, which
  the receiver waits for where it reads it (the consumer's forward, the producer's
  gather); the sender finds it complete at its own next call into the transport or
  before its next kernel (``Transport.let_go``; tests/executor/test_sends_let_go.py). An
  MPI message past the eager size moves only as both ranks call into MPI, so on CPU
  ranks a send may complete well before that reader, or, its sender computing, after it:
  what small plans measure moves by their sent pieces' bytes (the measured tests' wider
  tolerances say where). So in the model's step order a sent piece lives through the
  kernel of the op that reads it: a tile a piece of which is sent as a view, to its
  readers' forwards as any tile (their kernels included); a staged forward piece on the
  producer's device from its send through the consumer's forward kernel
  (``EdgeMemory.staged_tiles``); a gradient a piece of which is sent as a view, and a
  staged gradient piece, on the consumer's device through the producer's backward kernel
  (``sent_grads``, ``staged_grads``), not only to its gather. Held to the step's end
  instead, as the executor had held them, pieces sent as views had been all of a
  tensor-parallel LLaMA-3-8B's column-parallel linears' input gradients (1.07 GB each),
  and the staged ones, under sequence parallelism, a permanent copy of every strided
  piece: 365 GB a GPU priced, 197 GB once they were let go;
- on top of that, what a kernel holds while it runs (``OpDef.workspace``: Conv's
  columns, MaxPool's tap copies), in the backward with the fresh gradients of data
  inputs (and of weights already given one) it returns before they are summed or
  dropped. The forward scan counts the tiles and buffers alive at each kernel, the
  backward scan what the forward left less what each backward lets go of
  (``_forward_peaks``, ``_backward_peaks``);
- a recomputed op (the plan's ``recompute``) keeps no output tile from its forward to
  its backward, as ``executor/recompute.py`` drops it: in the forward the tile lives
  from its kernel to its last reader's; in the backward from its rematerialization
  until the last backward that reads it. It is rematerialized before the backward of
  the first op, in the backward's (reverse graph) order, that needs it: itself where
  its backward reads its output, a kept reader that reads it in place and keeps it, or
  (recursively) a recomputed reader's rematerialization; so a segment of recomputed
  ops between checkpoints is made again whole at its last op's reader's backward and
  shrinks as its ops' backwards run (``rematerialized_at``, ``_redone_until``);
- the update, once the step's output tiles and input gradients are gone (its weight
  gradients still held): the optimizer's temporaries on the largest shard it updates
  (``UPDATE_TEMPORARIES``: Adam's three arrays of its size, momentum's one; under ZeRO
  of the rank's rows). A model whose weights outweigh its activations peaks there.

Bytes are what ``tracemalloc`` counts on CPU ranks (``--trace``): numpy's heap
allocations, and the runtime's own Python objects, which at small batches are a third of
the peak: per instruction of the rank's program (the instruction, its trace name and
traced event, its kernel arguments, input sources and the step's dict entries) and per
piece a task assembles (its copy and the slices it copies through), ``PER_INSTRUCTION``
and ``PER_PIECE`` bytes, counted with the op (compute, statistics, partial sums,
all-reduces) or the edge (sends, receives, waits, pieces) they belong to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from onnx2soap.ir import Graph, Op, TensorRole
from onnx2soap.ops import definition
from onnx2soap.sim.bucket_memory import ring_scratch, ring_scratch_bytes, ring_widest
from onnx2soap.soap import Edge, PartitionedGraph
from onnx2soap.soap.buckets import DEFAULT_BUCKET_MB, gradient_buckets
from onnx2soap.soap.partition import (
    ParallelConfig,
    Region,
    ReplicaGroup,
    SumGroup,
    Task,
    held_rects,
    rect_contiguous,
    rect_shape,
    rect_volume,
    stat_groups,
    sum_groups,
)
from onnx2soap.soap.partitioned import edge_configs, op_kinds_held
from onnx2soap.soap.recompute import recomputes
from onnx2soap.soap.saved import backward_reads, kept_for_backward
from onnx2soap.soap.streamed import key_blocks, streams_operand, widest_span
from onnx2soap.soap.zero import Zero, ZeroStage, group_stage, zero_group

# Arrays of optimizer state per trainable shard (the executor's ``--optimizer``).
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2, "adamw": 2}
# Arrays of a shard's size an update holds at once besides the shard, its gradient and
# its state, by the optimizer's slots (executor/optim.py on numpy): SGD none, momentum's
# ``lr * step`` one, Adam's ``(lr / c1) * (m / denom)`` with ``denom`` three (weight
# decay's ``wd * param`` comes before them). Under ZeRO a shard is the rank's rows.
UPDATE_TEMPORARIES = {0: 0, 1: 1, 2: 3}

Pieces = tuple[tuple[int, int], ...]  # (device, bytes)

# The executor's Python objects (tracemalloc, CPython 3.11): an instruction's program
# entry, trace name and record, TaskArgs and step dict entries; a piece's layout.Copy
# with its slice tuples. Fitted (least squares of the relative error) to the measured
# peaks of the 42 working ranks of 21 plans (data parallel, model parallel, expert, four
# random) of lstm_lm, gpt2 and the example CNN on cpu:2: 995 and 935 bytes, mean error
# 1.6 %; resnet18's 14 ranks of 7 such plans, left out of the fit, 2.2 %, worst 3.5 %
# (Dec 1, once the backward's peak left out the gradients not yet made, Conv's backward
# workspace stopped counting dW twice, and the executor's rings dropped their scratch
# when done; tests/sim/test_memory_sequences.py checks them). The fit before (1,000 and
# 730) had absorbed those; the one before it (1,050 each) numpy.random's modules, which a
# traced run imported after it began counting (0.55-0.87 MB on every rank, on an idle
# one all it measured), and the tracer's dict per event, now a tuple; and before the
# heap was settled after the first step (executor/host_memory.py), garbage awaiting the
# collector counted too.
PER_INSTRUCTION = 1000
PER_PIECE = 950


@dataclass(frozen=True)
class OpMemory:
    """One op's share of every device's peak: ``held`` until the step ends (the tiles it
    keeps to the end, ``outputs``, and its weight gradients, ``grads``, are part of it),
    the most one of its ``forward`` and one of its ``backward`` kernels holds at once
    besides, and what lives less than the step (below)."""

    held: Pieces
    outputs: Pieces
    grads: Pieces  # the weight gradients its backward makes, held until the update
    forward: Pieces
    backward: Pieces
    # ZeRO-2: the full-size gradients' bytes beyond the rank's rows of the op's sharded
    # groups, held after the op's backward until its bucket's reduce-scatter is done
    # (the rank's next one's start, ``Order.closes``)
    inflight: Pieces = ()
    update: Pieces = ()  # the optimizer's temporaries while it updates the op's largest shard
    # of ``held``, its weights' share: shards, state, optimizer state, half copies and
    # weight gradients (what a pipeline's stage holds once, however many microbatches)
    weights: Pieces = ()
    redone: Pieces = ()  # a recomputed op's output tiles (not in ``outputs`` nor ``held``)
    # of ``held``, the Python objects of its instructions that every microbatch of a
    # pipeline has its own of (all but the weight gradients' all-reduce)
    instructions: Pieces = ()
    # the gradients of its activation inputs, (operand, device, bytes): made by its
    # backward, kept until their producer's backward has gathered them
    act_grads: tuple[tuple[int, int, int], ...] = ()
    # its tasks' output gradients gathered from their readers' pieces (``GradSum``):
    # each made where its task's backward begins and dropped after it (the largest of a
    # device's tasks)
    grad_out: Pieces = ()
    # (executor/lifetimes.py) output tiles its backward reads, from its forward to its
    # backward; those only its readers' forwards read, until the last of them (longer
    # where a reader keeps one in place: ``EdgeMemory.kept_by``)
    kept_tiles: Pieces = ()
    read_tiles: Pieces = ()
    # the input buffers the step makes for its activation operands: those its backward
    # reads, from its forward to its backward; the others, while its forward runs
    kept_inputs: Pieces = ()
    read_inputs: Pieces = ()
    # ZeRO-3: the float32 arrays its forward's (and backward's) gathers fill, started
    # as the op before it in that phase begins (executor/program.py's prefetch): they
    # live through that op too (``_forward_peaks``, ``_backward_peaks``)
    gathering: Pieces = ()
    regathering: Pieces = ()
    # an op with partial sums: of ``grad_out``, the holders' own gathered gradients,
    # which ``ShareGrad`` copies into the group's shared one and lets go before the
    # kernels run; and a CPU rank's ring scratch while that all-reduce runs
    shared_from: Pieces = ()
    share_scratch: Pieces = ()


@dataclass(frozen=True)
class EdgeMemory:
    """What one edge adds per device: ``held`` through the step (the runtime's objects);
    ``grad_out``, a change to the producer's gathered output gradient (negative where a
    received piece is it whole); ``sent_grads``, of the consumer's input gradient, the
    arrays a piece of which the transport holds, as a view, through the producer's
    backward kernel (its send completes as that backward waits for it)."""

    held: Pieces
    grad_out: Pieces = ()
    sent_grads: Pieces = ()
    # changes to the consumer's input buffers (``OpMemory.kept_inputs``, ``read_inputs``):
    # none is made where it reads a piece in place
    kept_inputs: Pieces = ()
    read_inputs: Pieces = ()
    # the producer's tile held longer, by a consumer that reads it in place and keeps it
    # for its backward (a piece sent as a view holds it no longer than its readers do:
    # the send completes once the consumer's receive has taken it)
    kept_by: Pieces = ()
    # a consumer task reads a producer's whole tile in place (``layout.Alias``): where
    # the producer is recomputed, that reader needs it made again
    aliased: bool = False
    # receive buffers, made where the receive is posted and dropped once read
    # (executor/step.py): the forward's pieces on the consumer's device, from the
    # producer's send to the consumer's assembly (one it reads whole is then its input
    # buffer); the gradient's on the producer's device, from the consumer's backward to
    # the producer's gather (``recv_grads``), or, read in place as the output gradient,
    # to the end of its backward (``recv_grad_out``)
    recv_tiles: Pieces = ()
    recv_grads: Pieces = ()
    recv_grad_out: Pieces = ()
    recv_whole: Pieces = ()  # of the forward's, those that are then the input buffer
    # where the tensor has other readers: per device and region, the bytes of the input
    # buffer its consumer tasks assemble (a local task of another reader that assembles
    # the same region reads the same one: ``edge_totals``), and whether the consumer
    # keeps it for its backward
    assembled: tuple[tuple[int, Region, int], ...] = ()
    keeps: bool = True
    # the producer's output gradients that are a local consumer's whole input gradient,
    # read as it is (``GradAlias``): no sum of pieces is made for them
    grad_alias: Pieces = ()
    # strided pieces sent from a copy made for the send, which the transport lets go once
    # the send completes (executor/step.py): a forward piece's on the producer's device,
    # from its send through the consumer's forward kernel; a gradient piece's on the
    # consumer's device, from its backward through the producer's backward kernel
    staged_tiles: Pieces = ()
    staged_grads: Pieces = ()
    # the consumer's input gradients no producer task on their device gathers from, nor
    # a send views: the step drops one once its pieces are sent (executor/lifetimes.py),
    # right after the consumer's backward, not at its producer's
    unread_grads: Pieces = ()
    # the consumer streams the operand (ring attention, ``soap/streamed.py``): its
    # kernel copies each received piece in as it reaches the piece's block of keys, so
    # the receive buffers (``recv_tiles``) live on through the kernel's start
    streamed: bool = False


@dataclass(frozen=True)
class Order:
    """Per op (graph order), the ops that read its output and, per operand, the op that
    made it (None: a graph input, weight or constant): when tiles and gradients go."""

    consumers: tuple[tuple[int, ...], ...]
    producers: tuple[tuple[int | None, ...], ...]
    # per op, the readers whose backward reads its tile (``soap/saved.py``; () where
    # not known: every reader with a backward), and whether its own backward does
    keepers: tuple[frozenset[int], ...] = ()
    own: tuple[bool, ...] = ()
    # per op, whether a gradient bucket's reduce-scatters start after its backward (the
    # bucket's last op with one: ``soap/buckets.py``); () where not known: every op's
    closes: tuple[bool, ...] = ()


@dataclass(frozen=True)
class EdgeTotals:
    """The edges' ``grad_out`` summed per producer op, the gradient pieces they send per
    (consumer op, operand) (``sent``: the whole arrays views of which are sent, held
    through the producer's backward kernel; ``staged_grads``: strided pieces' copies),
    their input buffer changes summed per consumer op, and per producer op and device
    the latest its tile is held to (``until``: the op whose backward ends it) and its
    bytes, for ``total``."""

    grad_out: dict[int, Pieces]
    sent: dict[tuple[int, int], Pieces] = field(default_factory=dict)
    kept_inputs: dict[int, Pieces] = field(default_factory=dict)
    read_inputs: dict[int, Pieces] = field(default_factory=dict)
    until: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)
    aliased: frozenset[tuple[int, int]] | None = None  # (producer, consumer) read in place
    # receive buffers in flight (``EdgeMemory.recv_tiles``): posted after each producer
    # op's forward, read by each consumer op's (copied, or taken as the input buffer);
    # the staging copies of strided pieces sent (``staged_tiles``) are posted as they
    # are and go after each consumer op's forward kernel (``unstaged``)
    posted: dict[int, Pieces] = field(default_factory=dict)
    landed: dict[int, Pieces] = field(default_factory=dict)
    landed_whole: dict[int, Pieces] = field(default_factory=dict)
    # the gradient's, per (consumer op, operand): posted after the consumer's backward
    recv_grads: dict[tuple[int, int], Pieces] = field(default_factory=dict)
    recv_grad_out: dict[tuple[int, int], Pieces] = field(default_factory=dict)
    # an input buffer several readers share, made by the first (an op that does not
    # keep it): op -> (the op whose backward ends it, device, bytes), or (the last
    # reader, whose forward ends it, device, bytes) where none keeps it
    shared_to_backward: dict[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    shared_to_forward: dict[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    grad_alias: dict[int, Pieces] = field(default_factory=dict)  # per producer op
    unstaged: dict[int, Pieces] = field(default_factory=dict)  # per consumer op
    # the staging copies of strided gradient pieces sent, per (consumer op, operand):
    # made after the consumer's backward, gone after the producer's backward kernel
    staged_grads: dict[tuple[int, int], Pieces] = field(default_factory=dict)
    # per (consumer op, operand): input gradients gone once sent (``EdgeMemory``)
    unread_grads: dict[tuple[int, int], Pieces] = field(default_factory=dict)
    # per consumer op, the receive buffers of the pieces a streamed kernel (ring
    # attention) takes block by block: held through its kernel, not gone before it
    landed_late: dict[int, Pieces] = field(default_factory=dict)


def _width(t, itemsize: int) -> int:
    return itemsize if t.dtype.is_float else t.dtype.itemsize  # ids and labels: int64


def memory_key(name: str, config: ParallelConfig, sums: tuple[SumGroup, ...]) -> tuple:
    """An op's memory under a config, memoized by it and, where its readers' configs
    make some of its sums reduce-scatter, by which (``Partitioner.sums``)."""
    scatter = tuple(g.scatter for g in sums if g.scatter is not None)
    return (name, config, scatter) if scatter else (name, config)


def _add(held: dict[int, int], device: int, n: int) -> None:
    held[device] = held.get(device, 0) + n


def _op_bytes(
    graph: Graph,
    op: Op,
    tasks: tuple[Task, ...],
    groups: tuple[ReplicaGroup, ...],
    itemsize: int,
    slots: int = 0,
    objects: bool = True,
    rounding: int = 0,
    zero: Zero | ZeroStage = ZeroStage.NONE,
    optimizer_slots: int = 0,
    recompute: bool = False,
    sums: tuple[SumGroup, ...] | None = None,
    stored: int = 0,
) -> OpMemory:
    """What one op holds per device, and for how long, counting every activation input
    buffer and output gradient (``_edge_bytes`` takes back the ones the executor reads
    in place). ``rounding``: bytes per element mixed precision's rounding of a weight
    gradient holds while it runs (its temporaries). ``zero``:
    the plan's ZeRO stage; ``optimizer_slots`` of the ``slots`` (the optimizer's, not
    mixed precision's weight copy) are then the member's rows only, and the update's
    temporaries (``UPDATE_TEMPORARIES``) follow them. ``recompute``: the op's output
    tiles are not held from its forward to its backward, only while its forward kernel
    runs and again while its backward reruns the forward and runs (``_recomputed_tile``).
    ``sums``: the op's sum groups as ``Partitioner.sums`` decides them (None: as
    ``sum_groups`` makes them, all-reduced). ``stored``: bytes an element of what the
    step stores between kernels (mixed precision's half format, ``executor/precision.py``:
    tiles, their buffers and gradients, data rows, weights' compute copies; 0: as
    ``itemsize``); a kernel then holds float32 copies of its stored operands and its
    float32 result (``_conversions``), and the stored tile it narrows that into."""
    stored = stored or itemsize
    sums = sum_groups(op, tasks) if sums is None else sums
    held: dict[int, int] = {}
    outputs: dict[int, int] = {}
    grads: dict[int, int] = {}
    forward: dict[int, int] = {}
    backward_: dict[int, int] = {}
    excess: dict[int, int] = {}  # ZeRO-2: full-size gradients beyond the rank's rows
    update: dict[int, int] = {}
    weights: dict[int, int] = {}
    keeps_inputs, keeps_output = kept_for_backward(graph, op, recompute)
    kept_tiles: dict[int, int] = {}  # output tiles its backward reads
    read_tiles: dict[int, int] = {}  # output tiles only its readers' forwards read
    kept_inputs: dict[int, int] = {}  # activation input buffers its backward reads
    read_inputs: dict[int, int] = {}  # the others: while its forward runs
    act_grads: dict[tuple[int, int], int] = {}  # (operand, device): activation gradients
    partials: dict[int, int] = {}  # partial sums' tiles, until the op's sum
    grad_out: dict[int, int] = {}  # gathered output gradients, while its backward runs
    temporaries = UPDATE_TEMPORARIES.get(optimizer_slots, 0)
    backward = graph.differentiable(op.output)
    recompute = recompute and backward  # nothing to recompute for without a backward
    redone: dict[int, int] = {}  # recomputed tiles per device, live only in its kernels
    shards = {(g.weight, g.rect, d): g for g in groups for d in g.devices}
    gathered: dict[int, int] = {}  # ZeRO-3: elements gathered whole for the forward
    regathered: dict[int, int] = {}  # and for the backward (the weights it reads)
    narrowed: dict[int, int] = {}  # and the rank's rows in the half format, as gathered
    for (_, rect, d), group in shards.items():
        n = rect_volume(rect) * itemsize
        if not group.trainable:
            _add(held, d, n)
            _add(weights, d, n)
            continue
        sharded, stage = zero_group(group, zero), group_stage(group, zero)
        own = n if sharded is None else sharded.numel(d) * itemsize
        # the master and, in mixed precision, its half-format copy (ZeRO-3: the rank's
        # rows alone, narrowed as they are gathered whole for each phase in that format)
        whole = sharded is None or not stage.shards_weights
        master = n if whole else own
        copy = (slots - optimizer_slots) * rect_volume(rect) * stored if whole else 0
        if not whole:
            _add(gathered, d, rect_volume(rect))
            _add(narrowed, d, sharded.numel(d) if stored < itemsize else 0)
            if backward_reads(graph, op, group.weight):
                _add(regathered, d, rect_volume(rect))
        _add(held, d, master + copy + optimizer_slots * own)
        # Its gradient: the first backward kernel's own, until the update; at ZeRO-2 the
        # rank's rows of it, once the reduce-scatter is done.
        grad = own if stage.shards_gradients else n
        _add(held, d, grad)
        _add(weights, d, master + copy + optimizer_slots * own + grad)
        _add(grads, d, grad)
        update[d] = max(update.get(d, 0), temporaries * own)
        if n > grad:
            _add(excess, d, n - grad)
    adopted: set[tuple] = set()  # (weight, rect, device) whose first gradient is made
    chunks = held_rects(sums)  # a reduce-scattering holder's output and its gradient
    graded = {t.index for t in _graded(tasks, sums)} if backward and not op.is_loss else set()
    out_width = _width(graph.tensors[op.output], stored)
    narrowed_out = not op.is_loss and graph.tensors[op.output].dtype.is_float
    workspace = definition(op.type).workspace
    streams = definition(op.type).streams
    # ring attention's tasks (``soap/streamed.py``): a span's temporaries and the
    # running state (``Streamed.workspace``); per task, its widest span of keys
    streamed = {t.index: widest_span(key_blocks(op, tasks, t)) for t in tasks if streams}
    stash = definition(op.type).stash_bytes if backward else None
    tensors = [graph.tensors[name] for name in op.inputs]
    # Instructions: forward and backward Compute per task, a Partial before each where
    # the op has statistics, and per device of each group its statistics' reduction,
    # partial sums (SumOutputs, ShareGrad) and weight gradients' all-reduce.
    phases = 2 if backward else 1
    instruction = PER_INSTRUCTION if objects else 0
    per_task = phases * (2 if op.nest.sync_dims else 1) * instruction
    instructions: dict[int, int] = {}
    for t in tasks:
        _add(instructions, t.device, per_task)
    shared = stat_groups(op, tasks) if op.nest.sync_dims else ()
    if op.nest.partial_dims:
        shared += sums
    for group in shared:
        for d in group.devices:
            _add(instructions, d, phases * instruction)
    for d, n in instructions.items():
        _add(held, d, n)
    if backward:
        for g in groups:
            if g.trainable and len(g.devices) > 1:
                for d in g.devices:
                    _add(held, d, instruction)
    for t in tasks:
        out = rect_volume(t.output) * out_width
        # The tile and its gradient buffer; a holder's partial tile gives way to the sum
        # (the step keeps the summed slot, counted with its group below).
        tile = out
        if sums:  # a partial tile, summed into the holder's output while the sum runs
            _add(partials, t.device, tile)
            tile = 0
        elif recompute:
            _add(redone, t.device, tile)
            tile = 0
        elif not op.is_loss:  # the losses stay to the step's end
            _add(kept_tiles if keeps_output else read_tiles, t.device, tile)
            tile = 0
        _add(outputs, t.device, tile)
        own = rect_volume(chunks[t.index]) * out_width if t.index in chunks else out
        if t.index in graded:
            grad_out[t.device] = max(grad_out.get(t.device, 0), own)  # one task at a time
        total = tile
        dropped = 0  # gradients a backward kernel returns and the runtime sums or drops
        for k, (tensor, region) in enumerate(zip(tensors, t.inputs, strict=True)):
            n = rect_volume(region.buffer)
            grad = backward and graph.differentiable(tensor.name)
            if tensor.role in (TensorRole.WEIGHT, TensorRole.STATE):
                # The first task's weight gradient becomes the shard's; another task's on
                # the same device is summed into it, then dropped.
                shard = (tensor.name, region.data, t.device)
                if grad and tensor.role is TensorRole.WEIGHT and shard in adopted:
                    dropped += n * itemsize
                adopted.add(shard)
                continue
            if tensor.role is TensorRole.ACTIVATION:  # the step makes its buffer
                kept = kept_inputs if k in keeps_inputs else read_inputs
                _add(kept, t.device, n * _width(tensor, stored))
            elif not (tensor.distinct and region.buffer == region.data):
                # rows (stored as activations), labels and constants: made once (a
                # broadcast constant read without padding: a view of the one held whole)
                width = stored if tensor.role is TensorRole.INPUT else itemsize
                total += n * _width(tensor, width)
            if tensor.role is TensorRole.ACTIVATION and grad:
                # its gradient, kept for the producer's backward
                act_grads[(k, t.device)] = act_grads.get((k, t.device), 0) + n * stored
            elif tensor.role is TensorRole.INPUT:
                dropped += n * itemsize if grad else 0
        _add(held, t.device, total)
        if stash is not None:  # kept from its forward to its backward, as the inputs it reads
            _add(kept_inputs, t.device, stash(op.attrs, rect_shape(t.output), itemsize))
        shapes = [rect_shape(r.buffer) for r in t.inputs]
        if streamed.get(t.index):
            span = streamed[t.index]
            fw, bw = streams.workspace(op.attrs, shapes, rect_shape(t.output), itemsize, span)
        elif workspace:
            fw, bw = workspace(op.attrs, shapes, rect_shape(t.output), itemsize)
        else:
            fw, bw = 0, 0
        if stored < itemsize:  # mixed precision: float32 copies beside the kernel's own
            conv_fw, conv_bw, scratch = _conversions(
                op, t, tensors, keeps_inputs, keeps_output, itemsize
            )
            weights_in = [r for x, r in zip(tensors, t.inputs, strict=True) if x.role is WEIGHT]
            widest = max((rect_volume(r.buffer) for r in weights_in), default=0) * rounding
            # the stored tile is made before the kernel runs (``Step._stored_tile``); a
            # recomputed op's is counted with its kernel already (``redone``)
            premade = out if narrowed_out and not recompute else 0
            fw, bw = max(fw - scratch, 0) + conv_fw + premade, max(bw + conv_bw, widest)
        forward[t.device] = max(forward.get(t.device, 0), fw)
        if backward:
            backward_[t.device] = max(backward_.get(t.device, 0), bw + dropped)
    for phase, whole_weights in ((forward, gathered), (backward_, regathered)):
        if phase is backward_ and not backward:
            break
        for d, n in whole_weights.items():
            # ZeRO-3: the gathered weights (in the stored format) through the phase's
            # kernels; as each is gathered, the rank's rows narrowed beside it. A
            # recomputed op keeps its forward's to its backward (its forward runs again
            # from them), where the one gathered again takes its place.
            at_gather = (n + narrowed.get(d, 0)) * stored
            during = 0 if phase is backward_ and recompute else n * stored
            phase[d] = max(phase.get(d, 0) + during, at_gather)
    if recompute:
        for d, n in gathered.items():
            _add(kept_inputs, d, n * stored)
    slot_width = _width(graph.tensors[op.output], itemsize)  # sums are float32
    half = out_width < slot_width
    shared_from = dict(grad_out) if sums else {}
    share_scratch: dict[int, int] = {}
    for group in sums:
        n = group.numel * slot_width
        # a CPU rank's ring holds a receive scratch as wide as its widest chunk while the
        # sum (and the backward's all-reduce or all-gather) runs (``bucket_memory.py``)
        runs = group.scatter.runs(group.tile) if group.scatter is not None else ()
        members = len(group.devices)
        scratch = ring_scratch_bytes(group.numel, members, slot_width, runs) if objects else 0
        for d in group.devices:
            if backward:
                share_scratch[d] = max(share_scratch.get(d, 0), scratch)
            # The sum (or the chunk of it) the holder keeps as the op's output, a tile
            # like any other (executor/lifetimes.py); its gradient, shared by the
            # group's tasks, while the op's backward runs.
            chunk = group.held_numel(d) * out_width
            _add(kept_tiles if keeps_output else read_tiles, d, chunk)
            if backward:
                _add(grad_out, d, n)
            # While the sum runs: the partial tiles, the step's float32 sum (an
            # all-reduce's made afresh; a reduce-scatter's is the first partial tile
            # itself, or its float32 copy in the half format, and a copy in the ring's
            # layout where that is not the tile's), the ring's scratch and, in the half
            # format, the output narrowed from it.
            in_place = group.scatter is None or group.scatter.in_place(group.tile)
            made = n if group.scatter is None or half else 0
            ring = made + (0 if in_place else n) + (chunk if half else 0) + scratch
            forward[d] = max(forward.get(d, 0), partials.get(d, 0) + ring)
            if backward and not in_place:
                # The tasks read the gathered gradient strided, through a view of the
                # ring's layout (a reduce-scatter's): a product may copy it while it runs.
                _add(backward_, d, n)
    if backward:  # ZeRO-2: the whole gradient exists from the op's backward kernels on
        for d, n in excess.items():
            _add(backward_, d, n)
    for d, n in redone.items():  # made by the forward kernel (``total`` counts the rest)
        _add(forward, d, n)
    parts = (
        held,
        outputs,
        grads,
        forward,
        backward_,
        excess if backward else {},
        update,
        weights,
        redone,
        instructions,
    )
    made = tuple((k, d, n) for (k, d), n in act_grads.items())
    lives = (grad_out, kept_tiles, read_tiles, kept_inputs, read_inputs)
    ahead = (  # ZeRO-3: the array being gathered while the op before runs
        tuple((d, n * stored) for d, n in gathered.items()),
        tuple((d, n * stored) for d, n in regathered.items()) if backward else (),
        tuple(shared_from.items()),
        tuple(share_scratch.items()),
    )
    return OpMemory(
        *(tuple(x.items()) for x in parts), made, *(tuple(x.items()) for x in lives), *ahead
    )


WEIGHT = TensorRole.WEIGHT
STORED = (TensorRole.ACTIVATION, TensorRole.INPUT, TensorRole.WEIGHT)  # in the half format


def _conversions(
    op, task, tensors, keeps_inputs, keeps_output, itemsize: int
) -> tuple[int, int, int]:
    """Under mixed precision, the float32 copies a task's kernels hold besides their own
    temporaries (``executor/step.py``: ``HalfStorage.widen`` and ``narrow``): forward,
    its stored operands widened and its result before it is narrowed; backward, the
    operands it keeps and its output widened, its output gradient widened, and its
    activation inputs' gradients before they are narrowed, but those the kernel returns
    in the operand's copy (``OpDef.overwrites``). Third, the forward's scratch the
    kernel keeps in such a copy instead (its workspace less that)."""
    out = rect_volume(task.output)
    stored = [
        (k, rect_volume(r.buffer), x.role)
        for k, (x, r) in enumerate(zip(tensors, task.inputs, strict=True))
        if x.role in STORED and x.dtype.is_float
    ]
    overwrites = definition(op.type).overwrites
    forward = sum(n for _, n, _ in stored) + out
    kept = sum(n for k, n, _ in stored if k in keeps_inputs)
    grads = sum(
        n
        for k, n, role in stored
        if role is TensorRole.ACTIVATION and not (k in overwrites and k in keeps_inputs)
    )
    scratch = sum(n for k, n, _ in stored if k in overwrites)
    backward = kept + (out if keeps_output else 0) + out + grads
    return forward * itemsize, backward * itemsize, scratch * itemsize


def op_held(
    graph: Graph,
    op: Op,
    tasks: tuple[Task, ...],
    groups: tuple[ReplicaGroup, ...],
    itemsize: int,
    slots: int = 0,
    objects: bool = True,
    rounding: int = 0,
) -> Pieces:
    """What one op under one config holds per device where the forward turns into the
    backward (its share of every device's peak, as ``peak_memory`` counts it, less its
    kernels' workspace, its gradients and its edges' buffers): what it holds through
    the step and the tiles and input buffers its backward reads: a solver's memory rows
    (search/ilp.py)."""
    m = _op_bytes(graph, op, tasks, groups, itemsize, slots, objects, rounding)
    return tuple(_plus(m.held, m.kept_tiles, m.kept_inputs).items())


def _graded(tasks: tuple[Task, ...], sums: tuple[SumGroup, ...]) -> tuple[Task, ...]:
    """The tasks that gather an output gradient from their readers' pieces: every task,
    or for an op with partial sums each group's holders (``ShareGrad``)."""
    if not sums:
        return tasks
    held = {t for g in sums for t in g.holders}
    return tuple(t for t in tasks if t.index in held)


def _edge_bytes(
    graph: Graph,
    edge: Edge,
    ptasks: tuple[Task, ...],
    ctasks: tuple[Task, ...],
    itemsize: int,
    sole: bool,
    objects: bool = True,
    keeps: bool = True,
    stored: int = 0,
    streamed: bool = False,
) -> EdgeMemory:
    """What one edge adds per device: receive buffers in flight and staging copies where
    a piece crosses devices (both ways when a gradient flows back); minus the input
    buffer of a consumer whose one piece is a local producer's whole tile, read in place
    (a received piece that fills the whole buffer is that buffer, counted as it once
    landed); and, where the edge is the tensor's ``sole`` reader and the producer task
    receives one piece covering its whole tile, the output gradient it would gather,
    which the receive buffer stands in for (``executor/layout.py``: ``Alias``, ``Received``). A
    local consumer's whole input gradient read as the output gradient (``GradAlias``)
    needs no change: it is counted as that, the input gradient gone by then. The
    transport holds a sent array until the send completes (module docstring): a piece
    sent as a view of a tile adds nothing (the tile lives through its readers' forward
    kernels anyway), one of a consumer's input gradient keeps the whole array through
    the producer's backward kernel (``sent_grads``), a strided piece's staging copy
    lives through the kernel that reads the piece (``staged_tiles``,
    ``staged_grads``). ``keeps``: whether the consumer keeps the
    operand for its backward (``soap/saved.py``): its buffer, or the producer's tile it
    reads in place, lives until then. ``stored``: bytes an element of the pieces and
    gradients moved (mixed precision's half format; 0: ``itemsize``). ``streamed``: the
    consumer's kernel takes the operand block by block (``EdgeMemory.streamed``)."""
    itemsize = stored or itemsize  # what every buffer here holds
    width = _width(graph.tensors[edge.tensor], itemsize)
    grad = graph.differentiable(edge.tensor)
    feeds = Counter(o.dst_task for o in edge.overlaps)
    sends = Counter(o.src_task for o in edge.overlaps)
    held: dict[int, int] = {}
    grad_out: dict[int, int] = {}
    inputs: dict[int, int] = {}  # the consumer's input buffers not made
    kept_by: dict[int, int] = {}
    staged_tiles: dict[int, int] = {}
    staged_grads: dict[int, int] = {}
    viewed: set[int] = set()  # consumer tasks whose input gradient a send views
    gathered: set[int] = set()  # consumer tasks a producer task on their device reads
    recv_tiles: dict[int, int] = {}
    recv_whole: dict[int, int] = {}
    recv_grads: dict[int, int] = {}
    recv_grad_out: dict[int, int] = {}
    grad_alias: dict[int, int] = {}
    aliased = False
    in_place: set[int] = set()  # consumer tasks whose one piece is their input buffer
    instruction, piece = (PER_INSTRUCTION, PER_PIECE) if objects else (0, 0)
    for o in edge.overlaps:
        p, c = ptasks[o.src_task], ctasks[o.dst_task]
        buffer = c.inputs[edge.operand].buffer
        # The runtime's objects: the piece the consumer assembles (and the one the
        # producer's gradient sums); across devices, a Send, Recv and Wait each way.
        crossing = instruction if p.device != c.device else 0
        _add(held, c.device, piece + 2 * crossing)
        _add(held, p.device, crossing)
        if grad:
            _add(held, p.device, piece + 2 * crossing)
            _add(held, c.device, crossing)
        if p.device != c.device:
            # The receive buffer, in flight until the consumer's forward copies it into
            # its input buffer, or, its one piece and no padding around it, takes it as
            # that buffer (then counted as the consumer's input buffer).
            if o.rect == buffer and feeds[o.dst_task] == 1:
                in_place.add(o.dst_task)
                _add(recv_whole, c.device, o.volume * width)
            else:
                _add(recv_tiles, c.device, o.volume * width)
            source = edge.source(p)
            if not rect_contiguous(o.rect, source):  # staged; a view adds nothing
                _add(staged_tiles, p.device, o.volume * width)
            if grad:  # the gradient piece's receive buffer, in flight until gathered
                if o.rect == source and sole and sends[o.src_task] == 1:
                    _add(grad_out, p.device, -o.volume * itemsize)  # read in place
                    _add(recv_grad_out, p.device, o.volume * itemsize)
                else:
                    _add(recv_grads, p.device, o.volume * itemsize)
                if rect_contiguous(o.rect, buffer):
                    viewed.add(o.dst_task)
                else:  # staged before it is sent
                    _add(staged_grads, c.device, o.volume * itemsize)
            continue
        gathered.add(o.dst_task)
        whole = o.rect == buffer == edge.source(p)
        if grad and whole and sole and sends[o.src_task] == 1:
            _add(grad_alias, p.device, o.volume * itemsize)  # its one piece, whole
        if whole and feeds[o.dst_task] == 1:
            aliased = True
            in_place.add(o.dst_task)
            _add(inputs, c.device, -o.volume * width)
            if keeps:
                kept_by[p.device] = max(kept_by.get(p.device, 0), o.volume * width)
    # Consumer tasks on one device that assemble the same region read one buffer (the
    # first's: executor/layout.py's ``Assembled.share``); other readers' too, where the
    # tensor has them (``edge_totals``).
    first: dict[tuple[int, Region], int] = {}
    for index in feeds:
        if index in in_place:
            continue
        c = ctasks[index]
        region = c.inputs[edge.operand]
        n = rect_volume(region.buffer) * width
        if (c.device, region) in first:
            _add(inputs, c.device, -n)
        else:
            first[(c.device, region)] = n
    sent: dict[int, int] = {}
    for index in viewed:
        c = ctasks[index]
        _add(sent, c.device, rect_volume(c.inputs[edge.operand].buffer) * itemsize)
    unread: dict[int, int] = {}
    for index in set(feeds) - gathered - viewed if grad else ():
        c = ctasks[index]
        _add(unread, c.device, rect_volume(c.inputs[edge.operand].buffer) * itemsize)
    changed = tuple(inputs.items())
    return EdgeMemory(
        tuple(held.items()),
        tuple(grad_out.items()),
        tuple(sent.items()),
        changed if keeps else (),
        () if keeps else changed,
        tuple(kept_by.items()),
        aliased,
        tuple(recv_tiles.items()),
        tuple(recv_grads.items()),
        tuple(recv_grad_out.items()),
        tuple(recv_whole.items()),
        () if sole else tuple((d, region, n) for (d, region), n in first.items()),
        keeps,
        tuple(grad_alias.items()),
        tuple(staged_tiles.items()),
        tuple(staged_grads.items()),
        tuple(unread.items()),
        streamed,
    )


def _batch_bytes(pg: PartitionedGraph, device: int, itemsize: int) -> int:
    """The device's rows of every data input; the labels and the constants, whole."""
    return _rows_bytes(pg, pg.data_rows(device), _whole_bytes(pg.graph, itemsize), itemsize)


def batch_bytes(pg: PartitionedGraph, devices: int, itemsize: int) -> list[int]:
    """``_batch_bytes`` of every device, the graph's tasks and tensors walked once (a walk
    per device had been a quarter of simulating a LLaMA-3-8B shape on 64 devices)."""
    rows, whole = pg.all_data_rows(), _whole_bytes(pg.graph, itemsize)
    return [_rows_bytes(pg, rows.get(d, {}), whole, itemsize) for d in range(devices)]


def _whole_bytes(graph: Graph, itemsize: int) -> int:
    """What every device holds whole of the batch: the constants and the labels."""
    held = sum(t.held_numel * _width(t, itemsize) for t in graph.constants)
    if graph.labels:
        labels = graph.tensors[graph.labels]
        held += labels.numel * _width(labels, itemsize)
    return held


def _rows_bytes(pg: PartitionedGraph, rows: dict, whole: int, itemsize: int) -> int:
    graph, held = pg.graph, whole
    for name, (lo, hi) in rows.items():
        t = graph.tensors[name]
        if name != graph.labels:
            held += (hi - lo) * (t.numel // t.shape[0]) * _width(t, itemsize)
    return held


def add_edges(
    held: list[int],
    pg: PartitionedGraph,
    itemsize: int,
    objects: bool,
    recompute: frozenset[str] = frozenset(),
    stored: int = 0,
) -> EdgeTotals:
    """Add to ``held`` (per device) what every edge holds through the step: the
    runtime's objects of its pieces (``_edge_bytes``), found once
    per kind of edge and configs (``op_kinds_held``: the same edge of every layer); the
    rest of what they change, for ``total``. ``recompute``: the plan's recomputed ops,
    which keep every input; ``stored``: as ``_edge_bytes``."""
    count = readers(pg.edges)
    kinds = op_kinds_held(pg.graph, frozenset())
    index = {op.name: i for i, op in enumerate(pg.graph.ops)}
    found: dict[tuple, EdgeMemory] = {}
    pieces_of: list[tuple[int, int, int, EdgeMemory]] = []
    for edge in pg.edges:
        p, c = edge.producer, edge.consumer
        sole = count[edge.tensor] == 1
        consumer = pg.graph.ops[index[c]]
        redone = recomputes(consumer, pg.sums[c], recompute)
        keeps = edge.operand in kept_for_backward(pg.graph, consumer, redone)[0]
        configs = edge_configs(pg.strategy[p], pg.strategy[c], pg.sums[p])
        key = (kinds[p], kinds[c], edge.operand, sole, keeps, *configs)
        pieces = found.get(key)
        if pieces is None:
            ptasks, ctasks = pg.tasks[p], pg.tasks[c]
            streamed = streams_operand(consumer, ctasks, edge.operand)
            pieces = _edge_bytes(
                pg.graph, edge, ptasks, ctasks, itemsize, sole, objects, keeps, stored, streamed
            )
            found[key] = pieces
        for d, n in pieces.held:
            held[d] += n
        pieces_of.append((index[p], index[c], edge.operand, pieces))
    return edge_totals(pieces_of)


def _sum_into(into: dict[int, dict[int, int]], op: int, pieces: Pieces) -> None:
    if pieces:
        row = into.setdefault(op, {})
        for d, n in pieces:
            row[d] = row.get(d, 0) + n


def edge_totals(edges) -> EdgeTotals:
    """``EdgeTotals`` from (producer op, consumer op, operand, ``EdgeMemory``) per edge.
    A tile a reader keeps in place is held to the backward of the earliest reader (in
    graph order) keeping it."""
    grad_out: dict[int, dict[int, int]] = {}
    kept: dict[int, dict[int, int]] = {}
    read: dict[int, dict[int, int]] = {}
    sent: dict[tuple[int, int], Pieces] = {}
    unstaged: dict[int, dict[int, int]] = {}
    staged_grads: dict[tuple[int, int], Pieces] = {}
    unread_grads: dict[tuple[int, int], Pieces] = {}
    until: dict[int, dict[int, tuple[int, int]]] = {}
    aliased: set[tuple[int, int]] = set()
    posted: dict[int, dict[int, int]] = {}
    landed: dict[int, dict[int, int]] = {}
    landed_whole: dict[int, dict[int, int]] = {}
    landed_late: dict[int, dict[int, int]] = {}
    recv_grads: dict[tuple[int, int], Pieces] = {}
    recv_grad_out: dict[tuple[int, int], Pieces] = {}
    grad_alias: dict[int, dict[int, int]] = {}
    readers: dict[tuple[int, int, Region], list[tuple[int, int, bool]]] = {}
    for p, c, k, m in edges:
        if m.aliased:
            aliased.add((p, c))
        for d, region, n in m.assembled:
            readers.setdefault((p, d, region), []).append((c, n, m.keeps))
        _sum_into(posted, p, (*m.recv_tiles, *m.recv_whole, *m.staged_tiles))
        _sum_into(landed_late if m.streamed else landed, c, m.recv_tiles)
        _sum_into(landed_whole, c, m.recv_whole)
        _sum_into(unstaged, c, m.staged_tiles)
        if m.recv_grads:
            recv_grads[(c, k)] = m.recv_grads
        if m.sent_grads:
            sent[(c, k)] = m.sent_grads
        if m.staged_grads:
            staged_grads[(c, k)] = m.staged_grads
        if m.unread_grads:
            unread_grads[(c, k)] = m.unread_grads
        if m.recv_grad_out:
            recv_grad_out[(c, k)] = m.recv_grad_out
        _sum_into(grad_out, p, m.grad_out)
        _sum_into(grad_alias, p, m.grad_alias)
        _sum_into(kept, c, m.kept_inputs)
        _sum_into(read, c, m.read_inputs)
        for d, n in m.kept_by:
            row = until.setdefault(p, {})
            old_at, old_n = row.get(d, (c, n))
            row[d] = (min(c, old_at), max(n, old_n))
    to_backward, to_forward = _shared_buffers(readers, kept, read)
    return EdgeTotals(
        {p: tuple(x.items()) for p, x in grad_out.items()},
        sent,
        {c: tuple(x.items()) for c, x in kept.items()},
        {c: tuple(x.items()) for c, x in read.items()},
        until,
        frozenset(aliased),
        {p: tuple(x.items()) for p, x in posted.items()},
        {c: tuple(x.items()) for c, x in landed.items()},
        {c: tuple(x.items()) for c, x in landed_whole.items()},
        recv_grads,
        recv_grad_out,
        to_backward,
        to_forward,
        {p: tuple(x.items()) for p, x in grad_alias.items()},
        {c: tuple(x.items()) for c, x in unstaged.items()},
        staged_grads,
        unread_grads,
        {c: tuple(x.items()) for c, x in landed_late.items()},
    )


def _shared_buffers(readers, kept, read) -> tuple[dict, dict]:
    """Where readers of one tensor on one device assemble the same region, the first (in
    graph order) makes the buffer and the others read it (executor/layout.py's
    ``Assembled.share``): theirs are taken off ``kept``/``read`` (per op and device),
    and the first's lives until the earliest keeper's backward, or, where none keeps
    it, the last reader's forward (``EdgeTotals.shared_to_backward``, ``_forward``)."""
    to_backward: dict[int, list[tuple[int, int, int]]] = {}
    to_forward: dict[int, list[tuple[int, int, int]]] = {}
    for (_, d, _), entries in readers.items():
        if len(entries) < 2:
            continue
        entries.sort(key=lambda e: e[0])
        (first, n, keeps), rest = entries[0], entries[1:]
        for c, m, k in rest:
            _sum_into(kept if k else read, c, ((d, -m),))
        if keeps:
            continue  # its own backward, the last of theirs, ends it
        _sum_into(read, first, ((d, -n),))
        keepers = [c for c, _, k in rest if k]
        if keepers:
            to_backward.setdefault(first, []).append((min(keepers), d, n))
        else:
            to_forward.setdefault(first, []).append((max(c for c, _, _ in rest), d, n))
    return (
        {op: tuple(x) for op, x in to_backward.items()},
        {op: tuple(x) for op, x in to_forward.items()},
    )


def readers(edges) -> Counter:
    """How many edges read each tensor: a gradient buffer is read in place only where
    one does."""
    return Counter(e.tensor for e in edges)


def order_of(graph: Graph, bucket_mb: float = DEFAULT_BUCKET_MB) -> Order:
    """Per op (graph order), the ops that read its output (how long a recomputed tile
    lives), the op that made each operand (how long its gradient lives) and whether
    its gradient bucket's reduce-scatters start after it (how long ZeRO-2's full-size
    gradients live): ``total``."""
    producer = {op.output: i for i, op in enumerate(graph.ops)}
    readers: list[set[int]] = [set() for _ in graph.ops]
    for c, op in enumerate(graph.ops):
        for name in op.inputs:
            if name in producer:
                readers[producer[name]].add(c)
    made_by = tuple(tuple(producer.get(name) for name in op.inputs) for op in graph.ops)
    keepers: list[set[int]] = [set() for _ in graph.ops]
    for c, op in enumerate(graph.ops):
        for k in kept_for_backward(graph, op, False)[0]:
            p = made_by[c][k]
            if p is not None:
                keepers[p].add(c)
    own = tuple(kept_for_backward(graph, op, False)[1] for op in graph.ops)
    buckets = gradient_buckets(graph, bucket_mb)
    closing = {buckets.summed(b)[-1] for b in range(len(buckets.ops)) if buckets.summed(b)}
    return Order(
        tuple(tuple(sorted(r)) for r in readers),
        made_by,
        tuple(frozenset(r) for r in keepers),
        own,
        tuple(i in closing for i in range(len(graph.ops))),
    )


def rematerialized_at(
    ops: list[OpMemory],
    consumers: tuple[tuple[int, ...], ...],
    keepers: tuple[frozenset[int], ...] = (),
    own: tuple[bool, ...] = (),
    aliased: frozenset[tuple[int, int]] | None = None,
) -> list[int | None]:
    """Per op, the op before whose backward the executor makes its recomputed tile again
    (``executor/step.py``'s ``_rematerialize``): the first, in the backward's (reverse
    graph) order, of itself where its own backward reads it (``own``; without it,
    always), a kept reader whose backward reads it (``keepers``; without them, every
    reader with a backward) and a recomputed reader's own such op (the reader's
    rematerialization needs its inputs; a reader without a backward, ids' arithmetic,
    needs nothing), of those only readers that read it in place (``aliased``, where
    known: one that copied it keeps its own buffer); None where nothing needs it again.
    An op that is kept: itself."""
    at: list[int | None] = list(range(len(ops)))
    for i in reversed(range(len(ops))):
        if ops[i].redone and consumers:
            readers = _needing(ops, consumers, keepers, i, aliased)
            needs = [c if at[c] is None else at[c] for c in readers]
            if not own or own[i]:
                needs.append(i)
            at[i] = max((n for n in needs if n is not None), default=None)
    return at


def _needing(ops, consumers, keepers, i: int, aliased=None) -> list[int]:
    """The readers of a recomputed op's tile whose backward needs it made again."""
    reads = keepers[i] if keepers else {c for c in consumers[i] if ops[c].backward}
    return [
        c
        for c in consumers[i]
        if (c in reads or ops[c].redone) and (aliased is None or (i, c) in aliased)
    ]


def _redone_until(ops, consumers, keepers, own, at, aliased) -> dict[int, list[int]]:
    """Op -> the recomputed ops whose tile made again goes after its backward: the op's
    own where its backward reads it, else its last (in the backward's order) reader
    that needed it (``executor/recompute.py``'s ``release_after``)."""
    until: dict[int, list[int]] = {}
    for i, a in enumerate(at):
        if not ops[i].redone or a is None:
            continue
        readers = _needing(ops, consumers, keepers, i, aliased) if consumers else []
        last = i if (not own or own[i] or not readers) else min(readers)
        until.setdefault(last, []).append(i)
    return until


def total(
    held: list[int],
    ops: list[OpMemory],
    order: Order | None = None,
    edges: EdgeTotals | None = None,
    rings: list[int] | None = None,
) -> tuple[int, ...]:
    """The peak per device from what it holds through the step (``held``) and what each
    op's kernels and the lifetimes of its tiles, buffers and gradients add (in graph
    order): the larger of the forward's peak (``_forward_peaks``), the backward's
    (``_backward_peaks``) and the update's. ``held`` counts every weight gradient and
    every tile kept to the step's end (``OpMemory.outputs``); the forward has made none
    of the gradients and only the tiles of the ops before, the backward only the
    gradients of the ops after. The update runs once the step's tiles and input
    gradients are gone, its weight gradients still held (``held``): its peak is that and
    the optimizer's temporaries on the largest shard. Without ``order`` (hand-made tests),
    a recomputed tile lives in its kernels only, a read tile to the step's end and a
    gradient from its backward to the step's end. ``rings``: per device, what the gradient
    buckets' rings hold on CPU ranks as the rank waits for them after its backward,
    beside every gradient (``bucket_memory.py``)."""
    devices = len(held)
    edges = edges or EdgeTotals({})
    later, update = [0] * devices, [0] * devices
    for m in ops:
        for d, n in m.grads:
            later[d] += n
        for d, n in m.update:
            update[d] = max(update[d], n)
    made, forward, saved, free = _forward_peaks(devices, ops, order, edges)
    backward, flying = _backward_peaks(devices, ops, later, order, edges, saved, free)
    # after the backward: the rings' scratch, and ZeRO-2's last bucket's full-size
    # gradients, its reduce-scatter still running
    tail = [r + n for r, n in zip(rings or [0] * devices, flying, strict=True)]
    return tuple(
        h + max(b, f - o - g, u - o, t)
        for h, b, f, o, g, u, t in zip(
            held, backward, forward, made, later, update, tail, strict=True
        )
    )


def _plus(*parts: Pieces) -> dict[int, int]:
    out: dict[int, int] = {}
    for pieces in parts:
        for d, n in pieces:
            out[d] = out.get(d, 0) + n
    return out


def _forward_peaks(devices: int, ops: list[OpMemory], order: Order | None, edges: EdgeTotals):
    """(the tiles kept to the step's end made by the forward, its peak per device over
    them and what lives beside them, what still lives when it ends, and per op what
    its backward lets go of). Over an op's kernel live: the tiles of the ops before it
    still read or kept, the input buffers kept for their backwards, its own input
    buffers and its kernel's workspace, then its tile. A tile only readers' forwards
    read goes after its last reader's (``order.consumers``), or where a reader keeps it
    in place, after that reader's backward (``EdgeTotals.until``); a recomputed op's tiles
    (``redone``) live until its last reader's kernel."""
    consumers = order.consumers if order is not None else ()
    made, forward = [0] * devices, [0] * devices
    live = [0] * devices  # tiles and buffers of the forward, besides ``made``
    free: dict[int, dict[int, int]] = {}  # op -> what goes after its backward
    # op -> read tiles (and staged pieces sent to it) that go after its forward kernel
    gone: dict[int, list[Pieces]] = {c: [x] for c, x in edges.unstaged.items()}
    for i, m in enumerate(ops):
        kept_in = _plus(m.kept_inputs, edges.kept_inputs.get(i, ()))
        read_in = _plus(m.read_inputs, edges.read_inputs.get(i, ()))
        for d, n in edges.landed_whole.get(i, ()):  # now the input buffers counted below
            live[d] -= n
        # ZeRO-3: the next op's gathers, started as this one begins
        ahead = ops[i + 1].gathering if i + 1 < len(ops) else ()
        for d, n in ahead:
            live[d] += n
        for x in (kept_in, read_in):
            for d, n in x.items():
                live[d] += n
        for until, d, n in edges.shared_to_backward.get(i, ()):  # made here, read later
            live[d] += n
            free.setdefault(until, {})[d] = free.get(until, {}).get(d, 0) + n
        for until, d, n in edges.shared_to_forward.get(i, ()):
            live[d] += n
            gone.setdefault(until, []).append(((d, n),))
        for d, n in edges.landed.get(i, ()):  # copied into its input buffers: gone
            forward[d] = max(forward[d], made[d] + live[d])
            live[d] -= n
        late = edges.landed_late.get(i, ())
        for d, _ in late:  # ring attention's pieces: copied in as its kernel goes
            forward[d] = max(forward[d], made[d] + live[d])
        for d, n in m.forward:
            forward[d] = max(forward[d], made[d] + live[d] + n)
        for d, n in late:
            live[d] -= n
        for d, n in m.outputs:
            made[d] += n
        for d, n in (*m.kept_tiles, *m.read_tiles):
            live[d] += n
        for d, _ in (*m.outputs, *m.kept_tiles, *m.read_tiles, *m.redone):
            forward[d] = max(forward[d], made[d] + live[d])
        for d, n in read_in.items():
            live[d] -= n
        until = edges.until.get(i, {})
        after = free.setdefault(i, {})
        for d, n in kept_in.items():
            after[d] = after.get(d, 0) + n
        for d, n in m.kept_tiles:
            after[d] = after.get(d, 0) + n
        short = []
        for d, n in m.read_tiles:
            at = until.get(d, (None, 0))[0]
            if at is None:
                short.append((d, n))
            else:  # a reader keeps it in place until its backward
                free.setdefault(at, {})[d] = free.get(at, {}).get(d, 0) + n
        if order is not None and short:
            last = max(consumers[i], default=i)
            gone.setdefault(last, []).append(tuple(short))
        for d, n in m.redone:  # made by its kernel, read until its last reader's
            live[d] += n
        if m.redone:
            last = max(consumers[i], default=i) if consumers else i
            gone.setdefault(last, []).append(m.redone)
        for pieces in gone.pop(i, ()):
            for d, n in pieces:
                live[d] -= n
        for d, n in edges.posted.get(i, ()):  # its readers' receives, posted at its sends
            live[d] += n
        for d, n in ahead:  # narrowed by the next op as it begins (its own peak)
            live[d] -= n
    return made, forward, live, free


def _backward_peaks(
    devices: int,
    ops: list[OpMemory],
    later: list[int],
    order: Order | None,
    edges: EdgeTotals,
    saved: list[int],
    free: dict[int, dict[int, int]],
) -> tuple[list[int], list[int]]:
    """Per device, the most its backward kernels hold beyond what is held through the
    step, less the weight gradients not yet made: the kernel's own, what the forward
    left (``saved``: tiles and buffers kept for backwards, each gone after its op's,
    ``free``), the recomputed tiles made again, ZeRO-2's gradient in flight, the
    activation gradients whose producer's backward has yet to gather them (those the
    op gathers go before its kernel runs, but for the pieces of them sent, which the
    transport holds through it),
    and the op's gathered output gradients (``executor/lifetimes.py``); and per device
    ZeRO-2's full-size gradients still held when the backward ends."""
    consumers = order.consumers if order is not None else ()
    keepers = order.keepers if order is not None else ()
    own = order.own if order is not None else ()
    producers = order.producers if order is not None else ()
    at = rematerialized_at(ops, consumers, keepers, own, edges.aliased)
    made_again: dict[int, list[int]] = {}
    for i, a in enumerate(at):
        if ops[i].redone and a is not None:
            made_again.setdefault(a, []).append(i)
    redone_until = _redone_until(ops, consumers, keepers, own, at, edges.aliased)
    backward = [0] * devices
    live = list(saved)  # and recomputed tiles made again, their op's backward not done
    unmade = list(later)  # no gradient exists when the backward begins
    # ZeRO-2: the full-size gradients of the bucket being filled, and of the bucket
    # whose reduce-scatter is in flight; a rank completes that one as it starts the next
    filling, flying = [0] * devices, [0] * devices
    pending = [0] * devices  # their sum
    closes = order.closes if order is not None and order.closes else None
    grads = [0] * devices  # activation gradients not yet gathered, or with the transport
    gather: dict[int, list[tuple[int, int]]] = {}  # producer -> (consumer, operand)
    posts: dict[int, list[tuple[int, int]]] = {}  # consumer -> its gradients' receives
    for c, k in dict.fromkeys((*edges.recv_grads, *edges.recv_grad_out, *edges.staged_grads)):
        posts.setdefault(c, []).append((c, k))
    for i in reversed(range(len(ops))):
        m = ops[i]
        for j in made_again.get(i, ()):
            for d, n in ops[j].redone:
                live[d] += n
        for d, n in m.grads:  # its own, made by its kernel: part of the kernel's peak
            unmade[d] -= n
        ahead = ops[i - 1].regathering if i > 0 else ()  # ZeRO-3: the next op's gathers
        for d, n in ahead:
            live[d] += n
        gathered = _plus(m.grad_out, edges.grad_out.get(i, ()))
        aliases = dict(edges.grad_alias.get(i, ()))
        # the sum made, less a local reader's gradient read as it is (``GradAlias``)
        sums = {d: n - aliases.get(d, 0) for d, n in gathered.items() if n > aliases.get(d, 0)}
        _gathering(backward, sums, m, live, pending, unmade, grads)
        for d, n in m.shared_from:  # copied into the shared gradient, gone before its kernels
            gathered[d] -= n
        # received output gradients its kernel reads in place, and sent gradient pieces
        # the transport holds through it: both gone after it
        after_kernel: list[tuple[int, int]] = []
        for c, k in gather.pop(i, ()):  # gathered into its output gradient
            after_kernel += _gathered(grads, edges, ops[c], c, k)
        for _, d, n in m.act_grads:  # made by its kernel
            grads[d] += n
        for d, n in m.backward:
            extra = grads[d] + max(gathered.get(d, 0), 0)
            backward[d] = max(backward[d], n + live[d] + pending[d] - unmade[d] + extra)
        for d, n in after_kernel:
            grads[d] -= n
        for key in posts.get(i, ()):  # its gradients' pieces, on their way
            for d, n in (
                *edges.recv_grads.get(key, ()),
                *edges.recv_grad_out.get(key, ()),
                *edges.staged_grads.get(key, ()),
            ):
                grads[d] += n
        for k in {k for k, _, _ in m.act_grads} | {k for _, k in posts.get(i, ())}:
            p = producers[i][k] if producers else None
            if p is None or p >= i:  # no producer to gather it (or no order): kept
                if producers:
                    _release(grads, m, k)
                continue
            gather.setdefault(p, []).append((i, k))
            for d, n in edges.unread_grads.get((i, k), ()):  # sent whole: dropped now
                grads[d] -= n
        for j in redone_until.get(i, ()):  # made again for backwards now done
            for d, n in ops[j].redone:
                live[d] -= n
        for d, n in free.get(i, {}).items():  # kept for its backward, done now
            live[d] -= n
        for d, n in m.inflight:  # its full-size gradients wait for their bucket's
            filling[d] += n
        if closes is None or closes[i]:
            # the bucket's reduce-scatter starts on the ranks it has gradients of, and
            # completes the one in flight there
            for d in range(devices):
                if filling[d]:
                    flying[d], filling[d] = filling[d], 0
                pending[d] = filling[d] + flying[d]
        else:
            for d, n in m.inflight:
                pending[d] += n
        for d, n in ahead:
            live[d] -= n
    return backward, pending


def _gathering(backward, sums, m: OpMemory, live, pending, unmade, grads) -> None:
    """Raise ``backward`` to what a device holds as an op sums its output gradient from
    its readers' pieces (``executor/step.py``'s ``_gather_grad``): the pieces (readers'
    gradients, receive buffers) still alive beside the sum, its gathered weights
    (ZeRO-3) too, its weight gradients not yet made. ``sums``: per device, the sum's
    bytes, where one is made (not where one piece is the gradient whole, read as it is:
    received, or a local consumer's, ``GradAlias``); where the op's partial sums share
    it, with the ring's scratch on a CPU rank (``OpMemory.share_scratch``)."""
    own, weights, scratch = dict(m.grads), dict(m.regathering), dict(m.share_scratch)
    for d, n in sums.items():
        held = live[d] + pending[d] - unmade[d] - own.get(d, 0) + weights.get(d, 0)
        backward[d] = max(backward[d], held + grads[d] + n + scratch.get(d, 0))


def _release(grads: list[int], m: OpMemory, k: int) -> None:
    """The gradients of operand ``k`` of an op go."""
    for kk, d, n in m.act_grads:
        if kk == k:
            grads[d] -= n


def _gathered(grads: list[int], edges: EdgeTotals, m: OpMemory, c: int, k: int) -> Pieces:
    """The producer of operand ``k`` of op ``c`` (``m``) has gathered its gradients and
    their received pieces: they go, but for those sent whole, gone already
    (``unread_grads``), and the arrays the transport holds through the producer's
    kernel (``sent``); returns what goes after that kernel: those held, the staged
    copies sent, and the received pieces the kernel reads in place."""
    _release(grads, m, k)
    for d, n in (*edges.unread_grads.get((c, k), ()), *edges.sent.get((c, k), ())):
        grads[d] += n
    for d, n in edges.recv_grads.get((c, k), ()):
        grads[d] -= n
    return (
        *edges.recv_grad_out.get((c, k), ()),
        *edges.sent.get((c, k), ()),
        *edges.staged_grads.get((c, k), ()),
    )


def peak_memory(
    pg: PartitionedGraph,
    devices: int,
    itemsize: int = 4,
    memo: dict[tuple, OpMemory] | None = None,
    slots: int = 0,
    objects: bool = True,
    rounding: int = 0,
    zero: Zero | ZeroStage = ZeroStage.NONE,
    optimizer_slots: int = 0,
    recompute: frozenset[str] = frozenset(),
    stored: int = 0,
    bucket_mb: float | None = None,
) -> tuple[int, ...]:
    """``memo`` must belong to one (itemsize, slots, objects, rounding, zero,
    recompute, stored), as a Simulator's does; it holds each op's memory by ``memory_key`` and
    by its kind (``op_kinds_held``) in its stead. ``recompute``: the ops whose output tiles the
    backward recomputes. ``objects``: count the runtime's Python objects, which share the
    memory of CPU ranks (a GPU's memory holds arrays only). ``zero``, ``optimizer_slots``:
    the plan's ZeRO stage and the optimizer's arrays it shards (``_op_bytes``)."""
    memo = {} if memo is None else memo
    graph = pg.graph
    held = batch_bytes(pg, devices, itemsize)
    parts = []
    kinds = op_kinds_held(graph, recompute, Zero.of(zero))
    for op in graph.ops:
        key = memory_key(op.name, pg.strategy[op.name], pg.sums[op.name])
        # an op of a kind priced under these configs holds what it holds
        like = (kinds[op.name], *key[1:])
        if key not in memo and like in memo:
            memo[key] = memo[like]
        if key not in memo:
            memo[key] = memo[like] = _op_bytes(
                graph,
                op,
                pg.tasks[op.name],
                pg.groups[op.name],
                itemsize,
                slots,
                objects,
                rounding,
                zero,
                optimizer_slots,
                recomputes(op, pg.sums[op.name], recompute),
                pg.sums[op.name],
                stored,
            )
        for d, n in memo[key].held:
            held[d] += n
        parts.append(memo[key])
    edges = add_edges(held, pg, itemsize, objects, recompute, stored)
    # CPU ranks' rings hold a scratch each (``bucket_memory.py``); a GPU's none
    rings = None
    if objects and bucket_mb:
        rings = ring_scratch(ring_widest(pg, bucket_mb, itemsize, zero), devices)
    order = order_of(graph, bucket_mb or DEFAULT_BUCKET_MB)
    return total(held, parts, order, edges, rings)
