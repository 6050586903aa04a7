"""Resource checks before allocation: refuse a request that cannot fit in memory or on disk, in one line that
says how much it would need and what to try, instead of letting the kernel kill the process.

``available_memory`` and ``free_space`` are the two figures every check reads; tests replace them to
exercise the checks with small inputs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from anytime.errors import AnytimeError

# Above this many pixels per image the footprint is measured at a smaller size and scaled by area.


def available_memory() -> int:
    """Bytes this process can still allocate: the kernel's MemAvailable, capped by a cgroup's memory limit."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            available = 1 << 62
    try:
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text().strip())
            stat = dict(
                line.split() for line in (cgroup / "memory.stat").read_text().splitlines() if line.count(" ") == 1
            )
            used -= int(stat.get("file", 0))  # the page cache is given back on demand
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available


def free_space(path: str | os.PathLike[str]) -> int:
    """Free bytes on the file system holding ``path`` (its nearest existing ancestor)."""
    where = Path(path)
    while not where.exists() and where.parent != where:
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return 0


def format_bytes(count: float) -> str:
    """``1.5 GB``-style size (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(count) < 1024 or unit == "PB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} PB"


def check_memory(need: int, what: str, hint: str) -> None:
    """Refuse ``what`` if it needs more than the memory available now."""
    have = available_memory()
    if need > have:
        raise AnytimeError(
            f"{what} needs about {format_bytes(need)} of memory but {format_bytes(have)} are available; {hint}"
        )


def check_disk(path: str | os.PathLike[str], need: int, what: str, hint: str) -> None:
    """Refuse ``what`` if the file system of ``path`` has less than ``need`` bytes free."""
    have = free_space(path)
    if need > have:
        raise AnytimeError(
            f"{what} needs about {format_bytes(need)} free at {path} but {format_bytes(have)} are free; {hint}"
        )


def check_input_memory(input_shape: Sequence[int], batch_size: int, *, what: str, hint: str) -> None:
    """Refuse an input tensor (float32) that alone cannot fit in memory: a first, allocation-free check."""
    values = batch_size
    for v in input_shape:
        values *= int(v)
    check_memory(4 * values, what, hint)
