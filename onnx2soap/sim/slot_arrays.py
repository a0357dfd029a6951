"""A task graph's slots as arrays: what ``taskgraph.flatten`` joins into one graph.

A full simulation builds most slots by moving the segment of another slot of the same
kind (``taskgraph.Moved``: the same op or edge of another layer): its tasks are the
source's, and its references to tasks point to the moved slots. Here a source's tasks,
resources, predecessors and feeds become arrays once, and a moved slot's references
are the source's with their slot numbers mapped by a lookup: no Python object per task.
LLaMA-3-8B's data parallelism on 128 GPUs has 4.5 M tasks, 4.2 M of them transfers of
the 128 edges that gather the rotary tables from every device; flattened from a tuple
of predecessors per task (made for every moved slot, then a list of numbers per task),
they took 4.4 s and held 1.7 GB at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import numpy as np

Ref = tuple[int, int]  # (slot, task index in the slot's segment), as taskgraph.Ref


class Built(Protocol):
    """A segment as built (``taskgraph.Segment``): its tasks, in program order."""

    @property
    def duration(self) -> Sequence[float]: ...
    @property
    def kind(self) -> Sequence[int]: ...
    @property
    def nbytes(self) -> Sequence[int]: ...
    @property
    def resources(self) -> Sequence[Sequence[int]]: ...
    @property
    def preds(self) -> Sequence[Sequence[Ref]]: ...
    @property
    def feeds(self) -> Sequence[tuple[int, Ref]]: ...


@dataclass(frozen=True)
class Refs:
    """References to tasks, task by task: ``counts[t]`` of them belong to the slot's
    task ``t``, in order; each is a slot and a task index in that slot's segment."""

    counts: np.ndarray
    slots: np.ndarray
    index: np.ndarray

    def moved(self, moves: Mapping[int, int]) -> Refs:
        return Refs(self.counts, moved_slots(self.slots, moves), self.index)

    def numbered(self, offsets: np.ndarray) -> np.ndarray:
        """Each reference's task number in a graph whose slot ``s`` begins at
        ``offsets[s]``."""
        return offsets[self.slots] + self.index


@dataclass(frozen=True)
class Feeds:
    """An edge slot's feeds (``taskgraph.Segment.feeds``): per feed, the task of the
    consumer's slot it feeds (``targets``) and the task that feeds it."""

    targets: np.ndarray
    slots: np.ndarray
    index: np.ndarray

    def moved(self, moves: Mapping[int, int]) -> Feeds:
        return Feeds(self.targets, moved_slots(self.slots, moves), self.index)


@dataclass(frozen=True)
class Tasks:
    """A segment's tasks: seconds, kinds, bytes, and per task its resources."""

    duration: np.ndarray
    kind: np.ndarray
    nbytes: np.ndarray
    res_counts: np.ndarray
    res_idx: np.ndarray


def _ints(values: Iterable[int], count: int) -> np.ndarray:
    return np.fromiter(values, np.int64, count)


def refs_of(preds: Sequence[Sequence[Ref]]) -> Refs:
    """``preds`` (per task, its predecessors) as arrays; iterated at C speed."""
    counts = _ints(map(len, preds), len(preds))
    total = int(counts.sum())
    pairs = _ints(chain.from_iterable(chain.from_iterable(preds)), 2 * total)
    return Refs(counts, pairs[0::2], pairs[1::2])


def feeds_of(feeds: Sequence[tuple[int, Ref]]) -> Feeds:
    flat = _ints(chain.from_iterable((t, s, k) for t, (s, k) in feeds), 3 * len(feeds))
    return Feeds(flat[0::3], flat[1::3], flat[2::3])


def tasks_of(
    duration: Sequence[float],
    kind: Sequence[int],
    nbytes: Sequence[int],
    resources: Sequence[Sequence[int]],
) -> Tasks:
    n = len(duration)
    res_counts = _ints(map(len, resources), n)
    res_idx = _ints(chain.from_iterable(resources), int(res_counts.sum()))
    return Tasks(
        np.fromiter(duration, np.float64, n),
        np.fromiter(kind, np.int8, n),
        _ints(nbytes, n),
        res_counts,
        res_idx,
    )


def moved_slots(slots: np.ndarray, moves: Mapping[int, int]) -> np.ndarray:
    """``slots`` mapped by ``moves``, which must hold each of them (as ``moves[s]``)."""
    if not len(slots):
        return slots
    if not moves:
        raise KeyError(f"slots {sorted(set(slots.tolist()))[:4]} are not moved")
    keys = _ints(moves, len(moves))
    order = np.argsort(keys)
    keys, values = keys[order], _ints(moves.values(), len(moves))[order]
    at = np.minimum(np.searchsorted(keys, slots), len(keys) - 1)
    if not np.array_equal(keys[at], slots):
        missing = sorted(set(slots[keys[at] != slots].tolist()))
        raise KeyError(f"slots {missing[:4]} are not moved")
    return values[at]


def merged(own: Refs, feeds: Sequence[Feeds]) -> Refs:
    """A compute slot's predecessors: per task its own, then those its edges' feeds
    bring, edge by edge in ``feeds``' order (``taskgraph.merged_preds``' order)."""
    fed = [f for f in feeds if len(f.targets)]
    if not fed:
        return own
    n = len(own.counts)
    tasks = np.concatenate([np.repeat(np.arange(n), own.counts), *(f.targets for f in fed)])
    order = np.argsort(tasks, kind="stable")  # own first, then the feeds as they come
    slots = np.concatenate([own.slots, *(f.slots for f in fed)])[order]
    index = np.concatenate([own.index, *(f.index for f in fed)])[order]
    return Refs(np.bincount(tasks, minlength=n), slots, index)


class Sources:
    """The arrays of each source segment, made once however many slots it is moved to.
    Keyed by identity: it keeps the segments it has seen, so an identity is not reused."""

    def __init__(self) -> None:
        self._tasks: dict[int, tuple[Built, Tasks]] = {}
        self._refs: dict[int, tuple[Built, Refs]] = {}
        self._feeds: dict[int, tuple[Built, Feeds]] = {}

    def tasks(self, segment: Built) -> Tasks:
        found = self._tasks.get(id(segment))
        if found is None:
            s = segment
            found = self._tasks[id(s)] = (s, tasks_of(s.duration, s.kind, s.nbytes, s.resources))
        return found[1]

    def refs(self, segment: Built, moves: Mapping[int, int] | None) -> Refs:
        """The source ``segment``'s predecessors, moved by ``moves`` where given."""
        found = self._refs.get(id(segment))
        if found is None:
            found = self._refs[id(segment)] = (segment, refs_of(segment.preds))
        return found[1] if moves is None else found[1].moved(moves)

    def feeds(self, segment: Built, moves: Mapping[int, int] | None) -> Feeds:
        found = self._feeds.get(id(segment))
        if found is None:
            found = self._feeds[id(segment)] = (segment, feeds_of(segment.feeds))
        return found[1] if moves is None else found[1].moved(moves)
