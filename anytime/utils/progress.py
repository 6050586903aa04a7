"""Progress bars on stderr for the commands that take more than a few seconds (tqdm, part of ``anytime[train]``).

Without tqdm, or when disabled, the bar is silent: a core install (torch, numpy, safetensors) still runs every
command, only without bars.
"""

from __future__ import annotations

from typing import Any, Protocol


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
