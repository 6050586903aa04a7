"""How many torch threads to run with, from the cores this process may use and how busy they are.

On a shared machine, torch's default (one thread per core) is the worst choice under load: at batch 1 the
threads of one operator wait for each other's time slices, and a ResNet-20 that takes 23 ms on one thread
took 1.2 s on two with both cores busy. :func:`choose_threads` counts the cores the process may run on,
subtracts the cores other processes keep busy (measured from ``/proc/stat`` over a short window, or the
1-minute load average where there is no ``/proc``), and keeps at least one.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from anytime.errors import AnytimeError

_STAT = "/proc/stat"
WINDOW_S = 0.25  # long enough for a few scheduler ticks per core, short enough to start a server quickly


@dataclass(frozen=True)
class ThreadChoice:
    """The threads chosen, and what they were chosen from (recorded beside a profile)."""

    threads: int
    cores: int
    busy_cores: float
    source: str  # "/proc/stat", "load average" or "none"

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready record."""
        return {
            "threads": self.threads,
            "cores": self.cores,
            "busy_cores": round(self.busy_cores, 3),
            "source": self.source,
        }


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_times(path: str = _STAT) -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores together, or None where there is no such file."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def busy_cores(
    window_s: float = WINDOW_S, *, read: Callable[[], tuple[int, int] | None] = _cpu_times,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[float, str]:  # fmt: skip
    """Cores kept busy by the whole machine over ``window_s`` (call it while this process idles), and the source."""
    first = read()
    if first is not None:
        sleep(window_s)
        second = read()
        if second is not None and second[1] > first[1]:
            share = (second[0] - first[0]) / (second[1] - first[1])
            return max(0.0, share) * (os.cpu_count() or 1), _STAT
    try:
        return max(0.0, os.getloadavg()[0]), "load average"
    except (AttributeError, OSError):
        return 0.0, "none"


def choose_threads(
    *, cores: int | None = None, busy: tuple[float, str] | None = None, window_s: float = WINDOW_S
) -> ThreadChoice:
    """Threads = usable cores minus the busy ones (a core counts as busy from 0.5 of it), at least 1."""
    n = usable_cores() if cores is None else cores
    load, source = busy if busy is not None else busy_cores(window_s)
    free = n - math.floor(min(load, n) + 0.5)
    return ThreadChoice(threads=max(1, free), cores=n, busy_cores=load, source=source)


def set_threads(threads: int | str | None) -> ThreadChoice | None:
    """Set torch's CPU threads: a number, ``auto`` (:func:`choose_threads`; the choice is returned) or None (left
    as they are)."""
    import torch

    if threads is None:
        return None
    if threads == "auto":
        choice = choose_threads()
        torch.set_num_threads(choice.threads)
        return choice
    if not isinstance(threads, int) or threads < 1:
        raise AnytimeError(f"threads must be a positive number or 'auto' (got {threads!r})")
    torch.set_num_threads(threads)
    return None
