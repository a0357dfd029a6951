"""Python's cyclic garbage collector, paused while the simulator builds and times plans.

A simulation of a large plan allocates millions of small tuples (segments, their
predecessors, memoized pieces) that live for the whole search and hold no reference
cycles. The collector's full passes walk every one of them again, and their count grows
with the search: a LLaMA-3-8B shape's starts on 64 devices took 1.5-2x as long to
simulate with it running. Reference counting still frees every acyclic object at once;
cycles made meanwhile (none in the simulator) wait until the collector runs again.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block; nested blocks leave it to the outer."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
