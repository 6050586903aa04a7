"""Peak memory of the process (and of its DataLoader workers), and of the CUDA allocator."""

from __future__ import annotations

import os
import resource
import threading
from dataclasses import dataclass
from pathlib import Path

import torch


def peak_rss_bytes() -> int:
    """The peak resident set size of this process since it started (ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes(pid: int | None = None) -> int:
    """The current resident set size of a process (default: this one); 0 if it has gone."""
    try:
        text = Path(f"/proc/{pid or os.getpid()}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _pss_bytes(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return current_rss_bytes(pid)
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in children:
                found.append(int(child))
                stack.append(int(child))
    return found


@dataclass(frozen=True)
class TreeMemory:
    """Memory of a process and all its descendants at one instant."""

    rss_bytes: int  # sum of resident sets: counts shared (copy-on-write) pages once per process
    pss_bytes: int  # sum of proportional sets: shared pages split between sharers, the honest total
    processes: int


def tree_memory(pid: int | None = None) -> TreeMemory:
    """RSS and PSS summed over a process and its descendants (e.g. DataLoader workers)."""
    root = pid or os.getpid()
    pids = [root, *_descendants(root)]
    return TreeMemory(
        rss_bytes=sum(current_rss_bytes(p) for p in pids),
        pss_bytes=sum(_pss_bytes(p) for p in pids),
        processes=len(pids),
    )


class TreeMemorySampler:
    """Samples :func:`tree_memory` on a background thread and keeps the peaks.

    ``ru_maxrss`` misses worker processes that are still alive, so studies of DataLoader workers
    sample the whole process tree instead. Use as a context manager.
    """

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peak_rss_bytes_ = 0
        self.peak_pss_bytes_ = 0
        self.peak_processes_ = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        mem = tree_memory()
        self.peak_rss_bytes_ = max(self.peak_rss_bytes_, mem.rss_bytes)
        self.peak_pss_bytes_ = max(self.peak_pss_bytes_, mem.pss_bytes)
        self.peak_processes_ = max(self.peak_processes_, mem.processes)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> TreeMemorySampler:
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="tree-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()


def cuda_peak_bytes(device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` on a CUDA device, ``None`` elsewhere."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))
