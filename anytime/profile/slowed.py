"""A slower board emulated on this machine: every segment and exit head of a model waits so that it takes
``factor`` times its own time (``anytime profile --emulate-slowdown``, split runs that simulate an edge device)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from anytime.errors import AnytimeError


def check_slowdown(factor: float) -> float:
    """Refuse an emulated slowdown that is not a number >= 1."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor < 1000:
        raise AnytimeError(f"--emulate-slowdown is a factor >= 1 (got {factor!r}); 1 runs at this machine's speed")
    return float(factor)


def _slowed(inner: Any, factor: float, clock: Callable[[], float], sleep: Callable[[float], None]) -> Any:
    import torch

    class Slow(torch.nn.Module):
        """``inner`` (kept out of the module tree: the model registers it once), then a wait of ``factor - 1``
        times its own time."""

        def __init__(self) -> None:
            super().__init__()
            object.__setattr__(self, "inner", inner)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            begin = clock()
            out = self.inner(h)
            sleep((factor - 1) * (clock() - begin))
            return out

    return Slow()


def slowed_model(model: Any, factor: float, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> Any:  # fmt: skip
    """``model`` (segments and heads) made ``factor`` times slower by waiting ``factor - 1`` times each segment's
    and head's own time after it: a slower board emulated on this machine. Profile it with ``anytime profile RUN
    --emulate-slowdown F`` and run it with ``anytime split-run ... --emulate-slowdown F``; a factor of 1 returns
    ``model`` itself."""
    import torch

    factor = check_slowdown(factor)
    if factor == 1:
        return model
    segments = getattr(model, "segments", None)
    if not isinstance(segments, (tuple, list)) or getattr(model, "heads", None) is None:
        raise AnytimeError("--emulate-slowdown slows a model's segments: it needs a run with exits or an ensemble")

    class SlowedModel(torch.nn.Module):
        """The run's model, every segment and head slowed (the step contract over the slowed parts)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.factor = factor
            self.exit_info = getattr(model, "exit_info", None)
            self.backbone_flops = getattr(model, "backbone_flops", None)
            object.__setattr__(self, "_segments", tuple(_slowed(s, factor, clock, sleep) for s in segments))
            object.__setattr__(self, "_heads", [_slowed(h, factor, clock, sleep) for h in model.heads])

        @property
        def segments(self) -> tuple[torch.nn.Module, ...]:
            return self._segments  # type: ignore[return-value]

        @property
        def heads(self) -> list[torch.nn.Module]:
            return self._heads  # type: ignore[return-value]

        @property
        def num_steps(self) -> int:
            return len(self._segments)

        def steps(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            last = len(self._segments) - 1
            for k, segment in enumerate(self._segments):
                x = segment(x)
                yield x if k == last else self._heads[k](x)

        def forward_until(self, x: torch.Tensor, k: int) -> torch.Tensor:
            for segment in self._segments[: k + 1]:
                x = segment(x)
            return x if k == len(self._segments) - 1 else self._heads[k](x)

        def forward_all(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack(list(self.steps(x)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.forward_all(x)

    return SlowedModel()
