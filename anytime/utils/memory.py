"""How the C allocator hands freed memory back, which decides whether a CPU forward pays page faults.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves a large block (over a threshold that
starts at 128 KiB and moves with what the process frees) from fresh ``mmap`` pages, and hands the top of its heap
back to the system once enough of it is free. Either way the next forward touches new pages, and every page costs
a fault. How often that happens depends on the order of everything the process allocated before: a ResNet-32 at
batch 32 with two threads here took 28-32 ms per batch in a fresh process (6,000-13,000 page faults per forward)
and 15-19 ms in a process that had run batches of 1 first, the same code; 18 ms with freed memory held (about 50
faults). A profile taken in one of those states and a runtime serving in the other disagree by up to 2x.

:func:`hold_freed_memory` fixes both thresholds (glibc's ``mallopt``): blocks up to 32 MiB (glibc's largest
threshold on 64-bit systems) come from the heap and freed memory stays in the process for the next forward. The
cost is that the process keeps its peak memory. The profiler and the runtime both call it, so the latencies a
profile records are the ones the runtime meets; a C library other than glibc is left as it is, and said so.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum on 64-bit systems: larger values are refused
TRIM_THRESHOLD = 1024 * 1024 * 1024  # freed memory the heap keeps before handing any back

_applied: AllocatorSetting | None = None


@dataclass(frozen=True)
class AllocatorSetting:
    """Whether this process now keeps freed memory for reuse (``held``), and what was set or why not."""

    held: bool
    detail: str


def hold_freed_memory() -> AllocatorSetting:
    """Keep freed memory in this process for the next forward (see the module's docstring); idempotent. Returns
    what was set, or, where the C library is not glibc or refuses, why nothing was (the process runs as before)."""
    global _applied
    if _applied is not None and _applied.held:
        return _applied
    library, version = platform.libc_ver()
    if library != "glibc":
        _applied = AllocatorSetting(False, f"left as it is: the C library is {library or 'unknown'}, not glibc")
        return _applied
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        _applied = AllocatorSetting(False, "left as it is: glibc's mallopt could not be found")
        return _applied
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        _applied = AllocatorSetting(False, f"left as it is: glibc {version} refused the thresholds")
        return _applied
    _applied = AllocatorSetting(True, f"glibc {version}: freed memory held (mmap threshold {MMAP_THRESHOLD >> 20} MiB, "
                                      f"trim threshold {TRIM_THRESHOLD >> 20} MiB)")  # fmt: skip
    return _applied


def allocator_state() -> str:
    """What this process's allocator does with freed memory, as a profile records it."""
    return _applied.detail if _applied is not None else "as the C library chooses (not set by anytime)"
