"""Streams and events, with the only work the stand-in defers: NCCL's calls.

Kernels run on the host the moment they are launched, so a stream never holds one. NCCL
calls are queued on their stream as on a GPU and run in its order, each starting when the
one before it on the stream has finished, and only when the host has to wait: for an
event recorded after them, for the stream, for the device, or for a kernel launched on
that stream. That is a schedule a GPU may run too (the communication stream as slow as
it can be), so what depends on it shows: a tile read before its receive was waited for
holds stale values, an array written again before its send went sends the new values,
and a send freed before it went is refused. A host that waits moves every stream of its
process on, as a GPU would run them; when none can move for ``CUPY_STANDIN_STALL_S``
seconds (60 unless set) the ranks' streams wait on each other, which NCCL would hang on,
and the stand-in raises instead.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from cupy import _devices

STREAM_LEGACY, STREAM_PER_THREAD = 1, 2  # cudaStreamLegacy, cudaStreamPerThread
_handles = itertools.count(0x5000)  # fake driver handles: never 0, 1 or 2, never reused


def _stall_s() -> float:
    return float(os.environ.get("CUPY_STANDIN_STALL_S", "60"))


class DeferredOp(Protocol):
    """One queued call: started when it reaches the head of its stream."""

    def start(self) -> None: ...

    def test(self) -> bool: ...

    def describe(self) -> str: ...


class _Queue:
    """What one stream of one device still has to run."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: deque[DeferredOp] = deque()
        self.started = False  # the head's
        self.issued = 0
        self.finished = 0

    def push(self, op: DeferredOp) -> None:
        self.ops.append(op)
        self.issued += 1
        _pending.add(self)

    def progress(self) -> bool:
        """Run what can run; True when something moved."""
        moved = False
        while self.ops:
            head = self.ops[0]
            if not self.started:
                head.start()
                self.started, moved = True, True
            if not head.test():
                break
            self.ops.popleft()
            self.started = False
            self.finished += 1
            moved = True
        if not self.ops:
            _pending.discard(self)
        return moved


_pending: set[_Queue] = set()
_queues: dict[tuple[int, int], _Queue] = {}


def queue_of(ptr: int, device: int) -> _Queue:
    key = (ptr, device)
    if key not in _queues:
        _queues[key] = _Queue(f"stream {ptr:#x} of device {device}")
    return _queues[key]


def wait_until(done: Callable[[], bool], what: str) -> None:
    """Move every stream of this process on until ``done()``."""
    last, naps = time.monotonic(), 0
    while not done():
        moved = False
        for queue in list(_pending):
            moved = queue.progress() or moved
        if done():
            return
        now = time.monotonic()
        if moved:
            last, naps = now, 0
            continue
        if now - last > _stall_s():
            heads = "; ".join(f"{q.name}: {q.ops[0].describe()}" for q in _pending if q.ops)
            raise RuntimeError(
                f"cupy stand-in: waiting for {what}, no stream has moved for {_stall_s():g} s "
                f"(NCCL would hang here: the ranks' streams wait on each other). Heads: {heads}"
            )
        naps += 1
        time.sleep(5e-5 if naps < 200 else 1e-3)  # a quick peer, then a slow one


def progress_all() -> None:
    for queue in list(_pending):
        queue.progress()


class _Current(threading.local):
    def __init__(self) -> None:
        self.stacks: dict[int, list[Stream]] = {}


_current = _Current()


class Stream:
    """cupy.cuda.Stream: ``null`` is the device's default stream (``Stream.null``)."""

    null: Stream
    ptds: Stream

    def __init__(
        self,
        null: bool = False,
        non_blocking: bool = False,
        ptds: bool = False,
        priority: int | None = None,
    ) -> None:
        if null:
            self.ptr, self.device_id = 0, -1
        elif ptds:
            self.ptr, self.device_id = STREAM_PER_THREAD, -1
        else:
            self.ptr, self.device_id = next(_handles), _devices.get_device()

    def _queue(self) -> _Queue:
        device = _devices.get_device() if self.device_id == -1 else self.device_id
        return queue_of(self.ptr, device)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and self.ptr == other.ptr

    def __hash__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"<Stream {self.ptr} (device {self.device_id})>"

    def _check_device(self) -> int:
        current = _devices.get_device()
        if self.device_id not in (-1, current):
            raise RuntimeError(
                f"The device that the stream is created on ({self.device_id}) does not "
                f"match with the current device ({current})"
            )
        return current

    def __enter__(self) -> Stream:
        device = self._check_device()
        _current.stacks.setdefault(device, []).append(self)
        return self

    def __exit__(self, *args) -> None:
        _current.stacks[_devices.get_device()].pop()

    def use(self) -> Stream:
        device = self._check_device()
        stack = _current.stacks.setdefault(device, [])
        if stack:
            stack[-1] = self
        else:
            stack.append(self)
        return self

    @property
    def done(self) -> bool:
        queue = self._queue()
        queue.progress()
        return not queue.ops

    def synchronize(self) -> None:
        queue = self._queue()
        wait_until(lambda: not queue.ops, repr(self))

    def record(self, event: Event | None = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Work launched on this stream from now on runs after the event: kernels run
        on the host at launch, so the host waits for it here."""
        event.synchronize()


Stream.null = Stream(null=True)
Stream.ptds = Stream(ptds=True)


def get_current_stream(device_id: int = -1) -> Stream:
    device = _devices.get_device() if device_id == -1 else device_id
    stack = _current.stacks.get(device)
    return stack[-1] if stack else Stream.null


def before_kernel() -> None:
    """A kernel runs after the work queued before it on its stream."""
    queue = get_current_stream()._queue()
    if queue.ops:
        wait_until(lambda: not queue.ops, f"{queue.name} before a kernel launched on it")


class Event:
    """cupy.cuda.Event: marks a point of one stream's work."""

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ) -> None:
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")
        self.ptr = next(_handles)
        self.disable_timing = disable_timing
        self._queue: _Queue | None = None
        self._count = 0
        self._time: float | None = None

    def _complete(self) -> bool:
        return self._queue is None or self._queue.finished >= self._count

    @property
    def done(self) -> bool:
        progress_all()
        return self._complete()

    def record(self, stream: Stream | None = None) -> None:
        stream = get_current_stream() if stream is None else stream
        self._queue = stream._queue()
        self._count = self._queue.issued
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        wait_until(self._complete, f"an event of {self._queue.name if self._queue else '-'}")


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    if start_event.disable_timing or end_event.disable_timing:
        raise _devices.CUDARuntimeError(_devices.INVALID_HANDLE)
    for event in (start_event, end_event):
        event.synchronize()
    assert start_event._time is not None and end_event._time is not None
    return (end_event._time - start_event._time) * 1e3


def synchronize_device(device: int) -> None:
    queues = [q for (_, d), q in _queues.items() if d == device]
    wait_until(lambda: not any(q.ops for q in queues), f"device {device}")
