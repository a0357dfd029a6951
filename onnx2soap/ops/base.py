"""What one op definition holds, and what its kernels receive.

An ``OpDef`` is the whole of an op: the ONNX op type and the schema versions it reads,
the converter (attributes as keyword arguments with the spec's defaults, so an unknown
attribute is refused by the signature), forward and backward kernels as pure functions
on an array module ``xp`` (numpy or cupy: no MPI, no globals), an optional cost hint and
the test cases one registry-driven test runs for every op. Definitions import nothing
from ``sim``, ``search`` or the executor's runtime.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from onnx2soap.ir import Op

Array = Any  # numpy.ndarray or cupy.ndarray
Interval = tuple[int, int]


@dataclass(frozen=True)
class RandomKey:
    """What a random op's bits depend on besides the global element index: never the
    plan, so N ranks draw exactly what one device draws."""

    seed: int
    step: int
    op: int  # the op's index in the graph


@dataclass(frozen=True)
class TaskArgs:
    """Per-task facts a kernel may need besides its buffers.

    out_shape:  the shape of the task's output tile (``()`` for a loss).
    valid:      per operand, where the tensor's data lies inside the buffer (buffer-local
                half-open intervals per axis); the rest of the buffer is padding.
    loss_scale: losses only: the divisor of a mean over the *whole* batch (the number of
                labels not equal to ignore_index, or the element count for MSE); 1 for sum.
    origin:     the global index of the output tile's first element, per axis; with
    full_shape: the whole output's shape, a random op numbers its elements globally.
    random:     the key of a random op's bits (None: not training, so no randomness).
    stats:      ops with statistics: the forward statistics summed over every task that
                splits the statistics' dims (see ``Statistics``); None otherwise.
    grad_stats: the same for the backward's statistics.
    float_dtype: the run's float dtype (float32 or float64): what a Cast of ids to float
                produces.
    box:        the task's global box, per iteration dim: where a partial op's share of a
                split reduction lies (an embedding's vocabulary rows).
    matmul_dtype: the dtype matrix products multiply in (``kernel_util.matmul``):
                float16 on a GPU in fp16 mixed precision (tensor cores, float32 sums);
                None: the operands' own.
    wanted:     per operand, whether the step uses its gradient (weights and float
                activations; not data, labels or constants): a backward whose
                ``Saved.only_for`` released an operand skips the gradients that read it.
    stash:      ops with ``OpDef.stashes``: a dict the executor keeps from the task's
                forward to its backward, for what the backward would otherwise remake
                (attention's log-sum-exp of each row); None where no one keeps one (the
                op tests, the ONNX backend): the backward remakes it.
    owned:      per operand, whether the buffer is a float32 copy the step made for this
                call alone (mixed precision's widened operands), which nothing reads
                after it: the kernels of an op with ``OpDef.overwrites`` may write over
                it; (): none is.
    """

    out_shape: tuple[int, ...]
    valid: tuple[tuple[Interval, ...], ...]
    loss_scale: float = 1.0
    origin: tuple[int, ...] = ()
    full_shape: tuple[int, ...] = ()
    random: RandomKey | None = None
    stats: Array | None = None
    grad_stats: Array | None = None
    float_dtype: Any = None
    box: tuple[Interval, ...] = ()  # the task's box of iteration dims (global)
    matmul_dtype: Any = None
    wanted: tuple[bool, ...] = ()  # per operand, whether its gradient is used; (): all
    stash: dict | None = None  # kept from the forward to the backward (``OpDef.stashes``)
    owned: tuple[bool, ...] = ()  # per operand, the call's own float32 copy


def wants(args: TaskArgs, k: int) -> bool:
    """Whether the step uses the gradient of operand ``k`` (``Saved.only_for``)."""
    return not args.wanted or args.wanted[k]


def owned(args: TaskArgs, k: int) -> bool:
    """Whether operand ``k`` is the call's own float32 copy (``TaskArgs.owned``)."""
    return bool(args.owned) and args.owned[k]


@dataclass(frozen=True)
class NoAttrs:
    """The attributes of an op that has none."""


Forward = Callable[[Any, Any, Sequence[Array], TaskArgs], Array]
"""(xp, attrs, input buffers, args) -> the task's output tile, a fresh array."""

Backward = Callable[[Any, Any, Sequence[Array], Array, Array, TaskArgs], tuple[Array | None, ...]]
"""(xp, attrs, inputs, output, grad_output, args) -> a gradient per input buffer (same
shape, padding included, fresh arrays) or None where none is needed (labels, constants)."""


@dataclass(frozen=True)
class Saved:
    """What an op's backward reads of its forward, as autograd's saved tensors: the
    input buffers it reads (``inputs``: their indices; None: every one) and whether it
    reads its output tile. The executor keeps exactly those from the forward to the
    op's backward and frees every other tile after its last forward reader; the memory
    model prices the same lifetimes. An input the backward does not read reaches it as
    a ``Released``: its shape and dtype, no values (a broadcast's gradient is summed to
    the input's shape). Weights, state and constants are held by the rank anyway.

    The default keeps everything: an op that declares nothing is priced and run as
    before. ``tests/ops/test_saved.py`` runs every case's backward with the buffers an
    op does not save released, so a declaration that says too little fails there."""

    inputs: tuple[int, ...] | None = None
    output: bool = True
    # (input, the operands whose gradients alone read it): kept only where one of those
    # takes a gradient, as autograd saves x of x * c only where c requires grad. The
    # backward then gets ``TaskArgs.wanted`` and makes no gradient the step does not use
    # (``wants``): an operand's gradient that reads a released buffer is never made.
    only_for: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def keeps_input(self, k: int, wanted: frozenset[int] | None = None) -> bool:
        """Whether the backward reads input ``k``, given the operands that take a
        gradient (None: every one)."""
        if self.inputs is not None and k not in self.inputs:
            return False
        readers = dict(self.only_for).get(k)
        return wanted is None or readers is None or any(r in wanted for r in readers)


SAVES_ALL = Saved()
SAVES_NOTHING = Saved(inputs=(), output=False)
SAVES_INPUTS = Saved(inputs=None, output=False)
SAVES_OUTPUT = Saved(inputs=(), output=True)


class Released:
    """Stands in for a buffer the backward does not read (``Saved``): its shape and
    dtype only. Anything that would read its values raises."""

    __slots__ = ("dtype", "shape")
    __array_ufunc__ = None  # numpy's ufuncs refuse it rather than make an object array

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape, self.dtype = tuple(shape), dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __array__(self, *args, **kwargs):
        raise TypeError("a released buffer has no values: the op's Saved must keep it")

    def __getitem__(self, index):
        raise TypeError("a released buffer has no values: the op's Saved must keep it")

    def __repr__(self) -> str:
        return f"Released({self.shape}, {self.dtype})"


def released(buffer: Array) -> Released:
    """The stand-in of ``buffer`` (or ``buffer`` itself where it is one already)."""
    if isinstance(buffer, Released):
        return buffer
    return Released(buffer.shape, buffer.dtype)


Workspace = Callable[[Any, Sequence[tuple[int, ...]], tuple[int, ...], int], tuple[int, int]]
"""(attrs, input buffer shapes, output tile shape, itemsize) -> (forward, backward) bytes
(``OpDef.workspace``)."""


def output_copies(forward: float, backward: float) -> Workspace:
    """A workspace of so many arrays the size of the output tile in each phase: what
    elementwise kernels' temporaries come to (measured under tracemalloc, rounded up)."""

    def workspace(attrs, shapes, out_shape, itemsize: int) -> tuple[int, int]:
        n = math.prod(out_shape) * itemsize
        return math.ceil(forward * n), math.ceil(backward * n)

    return workspace


StashBytes = Callable[[Any, tuple[int, ...], int], int]

# Key spans (half-open global intervals along the streamed dim), one tuple a block, in
# the order the blocks arrive.
KeyBlocks = Sequence[Sequence[tuple[int, int]]]


@dataclass(frozen=True)
class Streamed:
    """An op whose kernel reads some operands whole along a hidden dim (attention's
    keys) but can consume them block by block as they arrive, carrying its running
    state across blocks (the online softmax: the log-sum-exp combination of partial
    outputs, ring attention's). Where its ``rows`` dim is split over devices and the
    hidden dim ``keys`` is as long (self-attention), each task's operands come in one
    block a device, its own first (``soap/streamed.py``): the executor waits for a
    block's pieces only as the kernel reaches it, the simulator prices a chain of
    per-block tasks.

    ``forward(xp, attrs, inputs, args, blocks, arrive)``: the output, calling
    ``arrive(j)`` before it reads block ``j`` of the streamed operands; ``backward(xp,
    attrs, inputs, output, grad_output, args, blocks)``: the gradients, block by block."""

    operands: tuple[int, ...]  # the streamed operands (attention's K and V)
    axis: int  # their axis along the hidden dim
    rows: int  # the nest's dim whose split cuts the blocks (the queries)
    keys: int  # the nest's hidden dim (the keys)
    forward: Callable[..., Array]
    backward: Callable[..., tuple[Array | None, ...]]
    # (attrs, input buffer shapes, output tile shape, itemsize, the widest span of keys
    # a block has) -> what a streamed task's kernels hold, forward and backward, in
    # ``OpDef.workspace``'s stead (a span's temporaries, the running state beside them)
    workspace: Callable[[Any, Sequence[tuple[int, ...]], tuple[int, ...], int, int], tuple]


"""(attrs, output tile shape, itemsize) -> bytes of a task's stash (``OpDef.stash_bytes``)."""


LossScale = Callable[[Any, Any, tuple[int, ...]], float]
"""Losses: (attrs, the whole batch's labels (numpy), the prediction's shape) -> the divisor
of the whole batch's reduction; each task's kernel divides its partial sum by it, so the
partial losses of the tasks sum to the loss."""


@dataclass(frozen=True)
class Statistics:
    """How an op with ``LoopNest.sync_dims`` splits them: each task computes partial
    statistics, the executor sums them over the tasks that share the other dims, and the
    kernels read the sums from ``TaskArgs.stats`` / ``grad_stats``.

    forward(xp, attrs, inputs, args) -> the task's partial forward statistics;
    backward(xp, attrs, inputs, output, grad_output, args) -> its partial backward ones
        (``args.stats`` already holds the combined forward statistics);
    combine_forward / combine_backward(xp, partials) -> the combined statistics, from
        every task's partials stacked on a new axis 0 in the group's task order (the
        same order on every rank, so every rank gets the same bits);
    update(xp, attrs, inputs, args) -> ((operand index, new value of the task's region of
        that state operand), ...): the state the forward leaves behind, from the sums.
    """

    forward: Callable[..., Array]
    backward: Callable[..., Array]
    combine_forward: Callable[..., Array]
    combine_backward: Callable[..., Array]
    update: Callable[..., tuple[tuple[int, Array], ...]]


Converter = Callable[..., "Op | tuple[Op, ...]"]
"""(ctx, **attributes) -> the op, or several (an op with several outputs, e.g. Split)."""


# --- test cases: pure data, run by tests/ops for every definition ------------------------


class InputKind(Enum):
    DATA = "data"  # the graph's float data input "x"
    WEIGHT = "weight"  # a float initializer (trainable)
    CONSTANT = "constant"  # an initializer the importer folds into the op
    OMITTED = "omitted"  # an optional input left empty
    LABELS = "labels"  # a loss's targets: class ids below axis 1 of the data, or floats


@dataclass(frozen=True)
class CaseInput:
    kind: InputKind
    shape: tuple[int, ...] = ()
    values: tuple[float, ...] | None = None  # constants only, flattened
    dtype: str = "float32"  # constants only: numpy dtype name


def X(*shape: int) -> CaseInput:
    """The data input, of ``shape``."""
    return CaseInput(InputKind.DATA, tuple(shape))


def W(*shape: int) -> CaseInput:
    """A trainable weight, of ``shape``."""
    return CaseInput(InputKind.WEIGHT, tuple(shape))


def C(values: Sequence[float] | float, dtype: str = "int64", shape=None) -> CaseInput:
    """A constant input; a scalar stays 0-d unless ``shape`` says otherwise."""
    flat = tuple(values) if isinstance(values, Sequence) else (values,)
    if shape is None:
        shape = (len(flat),) if isinstance(values, Sequence) else ()
    return CaseInput(InputKind.CONSTANT, tuple(shape), flat, dtype)


NONE = CaseInput(InputKind.OMITTED)


def LABELS(*shape: int, dtype: str = "int64") -> CaseInput:
    """A loss's targets (a graph input): int64 class ids or float targets."""
    return CaseInput(InputKind.LABELS, tuple(shape), None, dtype)


class Sample(Enum):
    """How a case's float inputs are drawn, where plain normal data would make a test
    meaningless (ties in a max, a finite difference across a kink, a root of a negative)."""

    NORMAL = "normal"
    DISTINCT = "distinct"  # a permutation: no ties
    AWAY_FROM_ZERO = "away-from-zero"  # no value within 0.05 of 0
    POSITIVE = "positive"  # in [0.5, 2)


Attr = int | float | str | tuple[int, ...] | tuple[float, ...]


@dataclass(frozen=True)
class Case:
    """One ONNX node with its inputs, for the registry-driven op tests."""

    id: str
    op_type: str
    inputs: tuple[CaseInput, ...]
    attrs: tuple[tuple[str, Attr], ...] = ()
    opset: int = 17
    sample: Sample = Sample.NORMAL
    # False where the op draws random values: onnxruntime draws others, so its output is
    # not a reference (the bits are tested in tests/ops/test_random_bits.py).
    deterministic: bool = True
    # Outputs the node declares besides the first, unread (BatchNormalization in training
    # mode must declare its running statistics).
    extra_outputs: int = 0
    output: str = "float32"  # the ONNX element type of the output (a comparison's: bool)

    def __str__(self) -> str:
        return self.id


def case(
    id: str,
    op_type: str,
    *inputs: CaseInput,
    opset: int = 17,
    sample: Sample = Sample.NORMAL,
    deterministic: bool = True,
    extra_outputs: int = 0,
    output: str = "float32",
    **attrs: Attr | list[int] | list[float],
) -> Case:
    """A hashable ``Case``; ONNX attributes as keywords (lists become tuples)."""
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs.items()))
    return Case(
        id, op_type, tuple(inputs), frozen, opset, sample, deterministic, extra_outputs, output
    )


# --- the definition ------------------------------------------------------------------------


@dataclass(frozen=True)
class OpDef:
    """One op, whole. ``name`` is ``Op.type``: the ONNX op type, or onnx2soap's own name
    for an op it attaches itself (``onnx=False``: never matched against a node).

    ``versions`` are the schema versions (``since_version``) whose semantics the
    converter and kernels implement: a node is read only if the schema in force at the
    model's opset is one of them. A loss (``loss_scale`` given) is a scalar whose sample
    dim is split and whose partial losses are summed.
    """

    name: str
    convert: Converter
    forward: Forward
    backward: Backward
    cases: tuple[Case, ...]
    versions: tuple[int, ...] = ()
    domain: str = ""
    onnx: bool = True
    loss_scale: LossScale | None = None  # losses only
    statistics: Statistics | None = None  # ops whose nests have sync_dims
    # Integer operands: (op, operand index, tensors) -> the exclusive bound of valid ids
    # (an embedding's row count), so synthetic data draws ids the op can read.
    id_bound: Callable[..., int | None] | None = None
    # The output holds input values, only moved (reshapes, slices, transposes, a scatter's
    # data and updates): ids read through it keep the bounds of whoever reads the output,
    # at the operands ``id_bound`` states no bound of their own for (a scatter's indices).
    moves_values: bool = False
    # Kernels that hold large temporaries (Conv's columns, MaxPool's tap copies):
    # (attrs, input buffer shapes, output tile shape, itemsize) -> the bytes a task's
    # forward and backward kernels hold at once beyond its buffers, its output and the
    # gradients they return. The memory model adds them where they run.
    workspace: Workspace | None = None
    # What the backward reads of the forward (``Saved``): the rest is freed after its
    # last forward reader. Everything unless declared.
    saves: Saved = SAVES_ALL
    # attrs -> whether the output is input 0 itself wherever their dtypes agree (Identity,
    # a Cast of floats to the run's float dtype): the importer reads an activation's
    # input in such an op's stead, as torch's ``.to`` of the same dtype returns self,
    # so no step makes or keeps a copy.
    passes_input: Callable[[Any], bool] | None = None
    # Draws random values in training where no case shows it: an op whose random draws
    # only the importer's own attributes ask for (attention's fused dropout).
    random: bool = False
    # Its forward leaves in ``TaskArgs.stash`` a small statistic its backward reads
    # rather than remakes (FlashAttention's log-sum-exp: a row's worth, not priced;
    # RMSNormalization's inverse rms).
    stashes: bool = False
    # (attrs, output tile shape, itemsize) -> the bytes a task's stash holds from its
    # forward to its backward, which the memory model counts with the input buffers
    # the backward reads; None: not priced.
    stash_bytes: StashBytes | None = None
    # Operands whose float32 copy its kernels write over where ``TaskArgs.owned`` says
    # the step made it for the call (mixed precision's widened operands): the forward
    # works in it instead of a scratch of its size (which ``workspace`` counts), the
    # backward returns the operand's gradient in it, as Megatron-LM's cross-entropy
    # works in place in its float32 logits. The memory model counts neither then.
    overwrites: frozenset[int] = frozenset()
    # Operands consumed block by block along a hidden dim as they arrive (``Streamed``:
    # attention's keys and values, ring attention's overlap); None: read whole.
    streams: Streamed | None = None

    @property
    def is_loss(self) -> bool:
        return self.loss_scale is not None

    @property
    def draws_random(self) -> bool:
        """Whether the op may draw random values in training (a microbatch then numbers
        its elements in the whole batch)."""
        return self.random or any(not c.deterministic for c in self.cases)
