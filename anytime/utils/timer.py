"""The package's one timer: every latency, deadline and phase time is read from :func:`monotonic` (or from a
clock passed in its place), so a test replaces time in one way and nothing measures it differently."""

from __future__ import annotations

import time
from collections.abc import Callable

#: A clock: monotonic seconds as a float.
Clock = Callable[[], float]


def monotonic() -> float:
    """Seconds from an arbitrary start, monotonic, at the best resolution the platform has (``perf_counter``)."""
    return time.perf_counter()
