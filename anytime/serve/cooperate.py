"""Yield points: the serving worker lets the HTTP loop run between the model's blocks.

A server answers on one worker thread while its event loop, in the same process, reads the next requests; the two
share the interpreter lock. A PyTorch forward releases the lock inside every operator and takes it back as soon as
the operator returns, and a thread that wakes up wanting the lock (the loop, for a request that has just arrived,
or for an answer to send) often waits until the whole answer in progress is done (lowering the interpreter's switch
interval did not change that here). Measured on the 2-core test machine beside the fast CIFAR-10 card answering one
input every 2 ms: a thread sleeping 1 ms woke 1.99 ms late at p90 and 3.21 ms at p99 (a separate process, which has
its own lock, woke 0.11 and 0.27 ms late beside a process busy 3 ms in every 5). For a request, that wait lies
before its arrival stamp, outside the time the server counts. With yield points, the worker calls ``sched_yield``
(the lock released around it) before the model's next block once ``every_ms`` has passed since its last yield: a
waiting thread gets the lock and the core, and the answer resumes. The same thread then woke 0.69 ms late at p90
and 1.55 ms at p99 (every 0.5 ms), or 0.49 and 1.33 ms (every 0.25 ms). With nobody waiting the call returns at
once.

A block is the outermost module of what the runtime calls whose subtree holds at most :data:`BLOCK_WEIGHTS` leaves
with weights (a residual block, a transformer layer), so the hooks fire a few times per answer, not once per
operator. Compiled and TorchScript parts are opaque: no hook is put inside them (a hook there would break the
graph).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from anytime.utils.timer import Clock, monotonic

if TYPE_CHECKING:
    from torch import nn

BLOCK_WEIGHTS = 16  # leaves with weights in one block: a transformer layer (a MobileBERT bottleneck layer has 13)
DEFAULT_EVERY_MS = 0.5  # at most one yield per this much of the worker's time (ms); 0.25 bought little more


def _opaque(module: nn.Module) -> bool:
    import torch

    return isinstance(module, torch.jit.ScriptModule) or getattr(module, "_compiled_call_impl", None) is not None


def _weighted_leaves(module: nn.Module) -> int:
    return sum(1 for m in module.modules() if not any(True for _ in m.children()) and hasattr(m, "weight"))


def yield_blocks(model: nn.Module, block_weights: int = BLOCK_WEIGHTS) -> list[nn.Module]:
    """The modules a yield point goes before: the outermost ones with at most ``block_weights`` weighted leaves
    (``model`` itself when it is that small), never inside a compiled or TorchScript part. Containers that are
    never called (``ModuleList``, ``ModuleDict``) are looked into, and leaves without weights left out."""
    from torch import nn

    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if _opaque(module):
            return
        children = list(module.children())
        called = not isinstance(module, (nn.ModuleList, nn.ModuleDict))
        if called and (
            children and _weighted_leaves(module) <= block_weights or not children and hasattr(module, "weight")
        ):
            found.append(module)
            return
        for child in children:
            visit(child)

    visit(model)
    return found


def called_blocks(model: nn.Module) -> list[nn.Module]:
    """:func:`yield_blocks` of the modules the runtime calls: a multi-exit model's segments (the runtime runs
    them, not the backbone that holds them; its heads are too small to be worth a yield), else the model."""
    from anytime.precision.parts import layout_of

    parts = list(model.segments) if layout_of(model) == "exits" else [model]  # type: ignore[arg-type]
    return [block for part in parts for block in yield_blocks(part)]


class YieldPoints:
    """While entered, ``model``'s blocks (:func:`yield_blocks`) yield the CPU before they run, once ``every_ms``
    of the clock has passed since the last yield. ``yield_cpu`` and ``clock`` are injectable for tests; ``yields``
    counts the calls. ``every_ms`` of 0 or None installs nothing."""

    def __init__(self, model: nn.Module, every_ms: float | None = DEFAULT_EVERY_MS, *, clock: Clock = monotonic,
                 yield_cpu: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.model = model
        self.every_s = (every_ms or 0.0) / 1000.0
        self.clock = clock
        self.yield_cpu = yield_cpu or getattr(os, "sched_yield", None) or (lambda: time.sleep(0))
        self.yields = 0
        self._last = clock()
        self._handles: list[object] = []

    def _before(self, module: nn.Module, args: object) -> None:
        now = self.clock()
        if now - self._last >= self.every_s:
            self.yield_cpu()
            self.yields += 1
            self._last = self.clock()

    def __enter__(self) -> YieldPoints:
        if self.every_s > 0 and not self._handles:
            self._last = self.clock()
            self._handles = [m.register_forward_pre_hook(self._before) for m in called_blocks(self.model)]
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:  # fmt: skip
        for handle in self._handles:
            handle.remove()  # type: ignore[attr-defined]
        self._handles = []
