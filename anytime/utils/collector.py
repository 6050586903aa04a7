"""Keeping Python's cyclic garbage collector out of timed requests.

A process that answers requests one at a time (the split device, the split server) allocates a few hundred objects
per request, so the collector runs every few requests, and now and then walks every object of the process: with a
model loaded, milliseconds inside whichever request it interrupts, which is the tail a deadline is judged on.
The profiler already times with the collector paused; a serving loop pauses it too, with the objects that exist at
start-up frozen (never walked again), and runs each collection Python would have run *between* requests.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def collect_due() -> int:
    """Run the collection that Python's thresholds say is due (the oldest generation over its threshold), now;
    the generation collected, or -1 if none was due. Call it between requests while the collector is paused."""
    counts, limits = gc.get_count(), gc.get_threshold()
    due = -1
    for generation in range(3):
        if limits[generation] and counts[generation] >= limits[generation]:
            due = generation
    if due >= 0:
        gc.collect(due)
    return due


@contextlib.contextmanager
def serving_gc() -> Iterator[None]:
    """Inside: the objects alive at entry frozen and the collector paused; call :func:`collect_due` between
    requests. Both are undone on exit."""
    enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()
