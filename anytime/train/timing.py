"""Where the time of a training iteration goes: data wait, forward, backward, optimizer step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from anytime.utils.timer import Clock as TimerClock
from anytime.utils.timer import monotonic

PHASES: tuple[str, ...] = ("data", "forward", "backward", "step")


class Clock:
    """The package's timer (or ``clock``) read after waiting for queued CUDA work, so a phase is charged its own
    kernels."""

    def __init__(self, device: torch.device, clock: TimerClock = monotonic) -> None:
        self._cuda = device if device.type == "cuda" else None
        self._clock = clock

    def now(self) -> float:
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
        return self._clock()


@dataclass
class PhaseLog:
    """Per-iteration phase durations in seconds, appended as training goes."""

    data: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)

    def add(self, data: float, forward: float, backward: float, step: float, batch: int) -> None:
        self.data.append(data)
        self.forward.append(forward)
        self.backward.append(backward)
        self.step.append(step)
        self.batch.append(batch)

    def __len__(self) -> int:
        return len(self.batch)

    def totals(self) -> dict[str, float]:
        """Seconds spent in each phase, summed over the logged iterations."""
        return {phase: float(sum(getattr(self, phase))) for phase in PHASES}

    def summary(self) -> dict[str, float]:
        """Mean and median seconds per iteration for each phase, and images per second."""
        out: dict[str, float] = {"iterations": float(len(self))}
        if not len(self):
            return out
        total = np.zeros(len(self))
        for phase in PHASES:
            values = np.asarray(getattr(self, phase))
            total += values
            out[f"{phase}_mean_s"] = float(values.mean())
            out[f"{phase}_p50_s"] = float(np.median(values))
        out["iteration_mean_s"] = float(total.mean())
        out["images_per_s"] = float(sum(self.batch) / total.sum()) if total.sum() > 0 else float("nan")
        return out
