"""Progress bars on stderr for the commands that take more than a few seconds (tqdm, part of ``anytime[train]``).

Without tqdm, or when disabled, the bar is silent: a core install (torch, numpy, safetensors) still runs every
command, only without bars.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, Protocol, TextIO


class Bar(Protocol):
    """What the library calls on a bar."""

    def update(self, n: int = 1) -> Any: ...

    def set_postfix_str(self, text: str) -> Any: ...

    def close(self) -> Any: ...


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int | None, desc: str, *, enabled: bool, unit: str = "it") -> Bar:
    """A bar of ``total`` units (tqdm on stderr, removed when it closes), or a silent one when ``enabled`` is
    false or tqdm is not installed."""
    if not enabled:
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Silent()
    bar: Bar = tqdm(total=total, desc=desc, leave=False, unit=unit, dynamic_ncols=True)
    return bar


def write_line(text: str, *, file: TextIO | None = None) -> None:
    """Write one line of a command's or a study's own output (never the library's) on ``file`` (default
    stdout) without breaking a live bar: through tqdm when it is installed, plainly otherwise."""
    stream = file if file is not None else sys.stdout
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print(text, file=stream, flush=True)
        return
    tqdm.write(text, file=stream)
    stream.flush()


class StudyProgress:
    """A study's progress: a bar of its configurations on stderr while stderr is a terminal, and its result
    lines on stdout above the bar. Use as a context manager; :meth:`done` after each configuration."""

    def __init__(self, total: int, name: str, *, unit: str = "config") -> None:
        self._bar = progress_bar(total, name, enabled=sys.stderr.isatty(), unit=unit)

    def say(self, text: str) -> None:
        """A line of the study's output."""
        write_line(text)

    def done(self, text: str | None = None, count: int = 1) -> None:
        """``count`` configurations finished, with their line (if any)."""
        if text is not None:
            write_line(text)
        self._bar.update(count)

    def __enter__(self) -> StudyProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._bar.close()
