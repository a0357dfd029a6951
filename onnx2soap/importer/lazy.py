"""Folded values too big to hold, kept as how to compute them, a block at a time.

A causal mask folds from positions: iotas of the sequence compared, combined with
scalars, turned into 0 / -big by a Where. At 32,768 tokens its distinct values are
[32768, 32768] (4 GiB of float32; evaluating it took 16 GB and 21 s), and the attention
fusion then finds it causal and drops it. An elementwise node (or an Expand) whose
distinct result would pass ``LAZY_ELEMENTS`` therefore folds into a ``LazyValue``: the
node, its inputs' distinct values (or their own ``LazyValue``), and the shapes. Any box
of it is computed on demand by running the node on its inputs' boxes (an elementwise
node's box depends on its inputs' same box only), so the fusion checks the mask a
block of rows at a time (``distinct_rows``), exactly as it would the whole, and a value
nothing consumes is materialized (``np.asarray``) where an op still reads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import onnx

# Past this many distinct elements an elementwise result is not computed when folding
# (a mask at 1,024 tokens is this size; LLaMA's at 8,192 is 64x it).
LAZY_ELEMENTS = 1 << 20
# The most elements a block of rows holds when a lazy value is read in blocks.
BLOCK_ELEMENTS = 1 << 22

Evaluate = Callable[[dict[str, np.ndarray]], list[np.ndarray]]
Box = tuple[slice, ...]  # one slice (start and stop given) per axis of the distinct values


@dataclass(frozen=True)
class LazyValue:
    """``node``'s output, broadcast to ``shape`` from values of ``distinct_shape`` (the
    same rank, 1 along the axes it repeats along), never computed whole unless asked."""

    node: onnx.NodeProto
    names: tuple[str, ...]  # the node's non-empty inputs, in order
    inputs: tuple[np.ndarray | LazyValue, ...]  # their distinct values, or lazy ones
    shape: tuple[int, ...]
    distinct_shape: tuple[int, ...]
    dtype: np.dtype
    evaluate: Evaluate = field(compare=False, repr=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def block(self, box: Box) -> np.ndarray:
        """The distinct values in ``box``, computed from the inputs' same box."""
        feeds = {name: _part(x, box) for name, x in zip(self.names, self.inputs, strict=True)}
        (out,) = self.evaluate(feeds)
        return np.broadcast_to(np.asarray(out, self.dtype), _box_shape(box))

    def distinct(self) -> np.ndarray:
        return self.block(tuple(slice(0, n) for n in self.distinct_shape))

    def expanded(self, shape: tuple[int, ...]) -> LazyValue:
        """Expand's result: the same distinct values broadcast to ``shape``."""
        pad = (1,) * (len(shape) - len(self.distinct_shape))
        return replace(self, shape=tuple(shape), distinct_shape=pad + self.distinct_shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole value, as folding used to hold it: a broadcast view of the distinct
        values (for an op that reads it, or a mask the fusion did not consume)."""
        value = np.broadcast_to(self.distinct(), self.shape)
        return value if dtype is None else value.astype(dtype)


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


def _part(x: np.ndarray | LazyValue, box: Box) -> np.ndarray:
    """``x``'s part of an output box: inputs align to the output's last axes, and an axis
    that ``x`` has once (size 1) is read whole."""
    shape = x.distinct_shape if isinstance(x, LazyValue) else x.shape
    if not shape:  # a scalar (indexing a 0-d array would give a numpy scalar)
        return x
    mine = box[len(box) - len(shape) :]
    slices = tuple(slice(0, 1) if n == 1 else s for n, s in zip(shape, mine, strict=True))
    return x.block(slices) if isinstance(x, LazyValue) else x[slices]


# ONNX ops numpy computes exactly as the spec says (the inputs of one type, as ONNX
# requires; a bool or the inputs' type out): run as they are on a lazy value's blocks,
# where the reference evaluator's kernels took half of a 32,768-token mask's check.
_EXACT_IN_NUMPY: dict[str, Callable[..., np.ndarray]] = {
    "And": np.logical_and,
    "Or": np.logical_or,
    "Xor": np.logical_xor,
    "Not": np.logical_not,
    "Equal": np.equal,
    "Less": np.less,
    "LessOrEqual": np.less_equal,
    "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal,
    "Where": np.where,
}


def block_evaluator(node: onnx.NodeProto, evaluate: Evaluate) -> Evaluate:
    """What runs ``node`` on a lazy value's blocks: numpy for the ops it computes
    exactly, else ``evaluate`` (the importer's folding)."""
    kernel = _EXACT_IN_NUMPY.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if kernel is None:
        return evaluate
    names = [n for n in node.input if n]
    return lambda feeds: [np.asarray(kernel(*(feeds[n] for n in names)))]


def distinct_shape_of(x: np.ndarray | LazyValue) -> tuple[int, ...]:
    """The shape of the values ``x`` holds: 1 along the axes it repeats along."""
    return x.distinct_shape if isinstance(x, LazyValue) else _unbroadcast(x).shape


def lazy_elementwise(
    node: onnx.NodeProto,
    distinct: dict[str, np.ndarray | LazyValue],
    shape: tuple[int, ...],
    evaluate: Evaluate,
) -> LazyValue | None:
    """``node`` (elementwise, one output) folded lazily where its distinct result, over
    its inputs' ``distinct`` values, would pass ``LAZY_ELEMENTS``; else None. ``shape`` is
    the whole result's; the element type is found by running the node on one element."""
    names = tuple(n for n in node.input if n)
    inputs = tuple(distinct[n] for n in names)
    rank = len(shape)
    inner = np.broadcast_shapes(*(distinct_shape_of(x) for x in inputs))
    if math.prod(inner) <= LAZY_ELEMENTS:
        return None
    padded = (1,) * (rank - len(inner)) + tuple(inner)
    first = (slice(0, 1),) * rank
    (one,) = evaluate({n: _part(x, first) for n, x in zip(names, inputs, strict=True)})
    return LazyValue(node, names, inputs, shape, padded, np.asarray(one).dtype, evaluate)


def distinct_rows(value: np.ndarray | LazyValue) -> Iterator[tuple[int, np.ndarray]]:
    """A value's distinct values (a broadcast view's: index 0 along its stride-0 axes)
    in blocks of rows along axis -2, every other axis whole: (the first row, the block).
    A lazy value is computed one block at a time, never whole."""
    if isinstance(value, LazyValue):
        shape, read = value.distinct_shape, value.block
    else:
        held = _unbroadcast(value)
        shape = held.shape

        def read(box: Box) -> np.ndarray:
            return held[box]

    if len(shape) < 2:
        yield 0, read(tuple(slice(0, n) for n in shape))
        return
    others = math.prod(shape) // max(shape[-2], 1)
    rows = max(1, BLOCK_ELEMENTS // max(others, 1))
    lead = tuple(slice(0, n) for n in shape[:-2])
    for lo in range(0, shape[-2], rows):
        hi = min(lo + rows, shape[-2])
        yield lo, read((*lead, slice(lo, hi), slice(0, shape[-1])))


def _unbroadcast(value: np.ndarray) -> np.ndarray:
    """Index 0 of every axis a broadcast view repeats along (the importer holds a mask
    expanded to the batch as such a view, ``prepare.compact``)."""
    repeated = tuple(
        slice(0, 1) if stride == 0 and size > 1 else slice(None)
        for stride, size in zip(value.strides, value.shape, strict=True)
    )
    return value[repeated]


def materialized(value: np.ndarray | LazyValue) -> np.ndarray:
    return np.asarray(value) if isinstance(value, LazyValue) else value
