"""Energy per inference: readers of the machine's energy counters or power rails behind one interface, and the
measurement of a step's joules per inference over repeated windows.

A reader gives the energy consumed since it was opened, in joules, as a non-decreasing number:

- ``rapl``: x86 CPUs' RAPL package counters (``/sys/class/powercap/intel-rapl:N/energy_uj``), which Intel and
  AMD expose on bare metal; the counter wraps at ``max_energy_range_uj``, which the reader undoes.
- ``nvml``: an NVIDIA GPU through NVML (``pynvml``, from ``nvidia-ml-py``): its total-energy counter (mJ) where the
  GPU has one (Volta and later), else its power (mW) sampled in a background thread and integrated.
- ``jetson-ina``: a Jetson board's INA3221 power monitors, read from sysfs as ``tegrastats`` does (the board's
  input rail where one is labelled ``VDD_IN``, else the sum of the rails), sampled and integrated.

Nothing here makes a number up: :func:`open_energy_reader` raises one line naming every source it tried and what
would make one readable. A counter is only as fine as its quantum and its refresh period, so each window of a
measurement runs the step until the counter has moved by at least ``min_quanta`` quanta and for at least
``min_window_s`` seconds; one inference alone is never read off a coarse counter.

The readers are in :mod:`anytime.profile.energy_readers`; this module holds the measurement (:class:`EnergySettings`,
:func:`measure_energy`) and the figures a profile keeps (:class:`EnergyWindows`, :class:`EnergyMeter`,
:class:`BatchEnergy`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from anytime.errors import AnytimeError
from anytime.profile.energy_readers import EnergyReader, EnergySource
from anytime.utils.timer import Clock, monotonic


@dataclass(frozen=True)
class EnergyWindows:
    """One step (or one exit path) at one batch size: per measurement window, the joules and the seconds one
    inference (one input) took, each the window's total over its ``calls`` calls of ``batch_size`` inputs."""

    joules: np.ndarray
    seconds: np.ndarray
    calls: int

    @property
    def mean_j(self) -> float:
        """Mean joules per inference over the windows."""
        return float(np.mean(self.joules))

    def quantile_j(self, q: float) -> float:
        """A quantile of the windows' joules per inference."""
        return float(np.quantile(self.joules, q))

    @property
    def power_w(self) -> float:
        """The average power over all windows (W)."""
        return float(np.sum(self.joules) / np.sum(self.seconds))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: a summary beside the raw windows."""
        return {"mean_j": self.mean_j, "p50_j": self.quantile_j(0.5), "p99_j": self.quantile_j(0.99),
                "power_w": self.power_w, "calls": self.calls,
                "joules": [float(f"{v:.6g}") for v in self.joules], "seconds": [float(f"{v:.6g}") for v in self.seconds]}  # fmt: skip

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str) -> EnergyWindows:
        """Rebuild from :meth:`to_dict`; a NaN, negative or ragged window is an error naming ``where``."""
        joules = np.asarray(doc["joules"], dtype=np.float64)
        seconds = np.asarray(doc["seconds"], dtype=np.float64)
        calls = doc["calls"]
        if (
            joules.ndim != 1
            or joules.size == 0
            or joules.shape != seconds.shape
            or not isinstance(calls, int)
            or calls < 1
        ):
            raise ValueError("energy windows malformed")
        if not (np.isfinite(joules).all() and np.isfinite(seconds).all()) or (joules < 0).any() or (seconds <= 0).any():
            raise AnytimeError(f"{where} holds a NaN, infinite or negative energy; profile again with --energy")
        return cls(joules, seconds, calls)


@dataclass(frozen=True)
class EnergySettings:
    """How energy is measured: ``windows`` repeated windows, each at least ``min_window_s`` long and moving the
    counter by at least ``min_quanta`` quanta; a step that cannot do so within ``max_window_s`` is an error."""

    windows: int = 20
    min_window_s: float = 0.25
    max_window_s: float = 20.0
    min_quanta: int = 100
    idle_s: float = 1.0

    def __post_init__(self) -> None:
        if self.windows < 2 or self.min_quanta < 1:
            raise AnytimeError(f"energy needs at least 2 windows (got {self.windows})")
        if (
            not (0 < self.min_window_s <= self.max_window_s and math.isfinite(self.max_window_s))
            or not self.idle_s >= 0
        ):
            raise AnytimeError(f"energy windows: need 0 < min {self.min_window_s} s <= max {self.max_window_s} s")


def idle_power(reader: EnergyReader, seconds: float, *, clock: Clock = monotonic,
               sleep: Callable[[float], None] | None = None) -> float | None:  # fmt: skip
    """The machine's power (W) while this process sleeps ``seconds`` (None for 0): the baseline a step's
    energy sits on (RAPL's package counter and a board's input rail include everything the machine does)."""
    if seconds <= 0:
        return None
    with reader.sampling():
        e0, t0 = reader.read_j(), clock()
        (sleep or time.sleep)(seconds)
        e1, t1 = reader.read_j(), clock()
    return (e1 - e0) / (t1 - t0) if t1 > t0 else None


def measure_energy(
    call: Callable[[], None], reader: EnergyReader, batch_size: int, settings: EnergySettings = EnergySettings(),
    *, clock: Clock = monotonic, what: str = "the step",
) -> EnergyWindows:  # fmt: skip
    """Joules per inference of ``call`` (one batch of ``batch_size`` inputs; it must synchronise a GPU itself).

    A pilot doubles the calls per window until one window lasts ``min_window_s`` and moves the counter by
    ``min_quanta`` quanta (so one quantum is at most 1/``min_quanta`` of the figure); then ``windows`` windows of
    that many calls are measured."""
    with reader.sampling():
        return _measure(call, reader, batch_size, settings, clock, what)


def _measure(call: Callable[[], None], reader: EnergyReader, batch_size: int, settings: EnergySettings, clock: Clock,
             what: str) -> EnergyWindows:  # fmt: skip
    source = reader.source
    need_j = settings.min_quanta * source.quantum_j
    need_s = max(settings.min_window_s, 10 * source.refresh_s)
    calls = 1
    while True:
        joules, seconds = _window(call, reader, calls, clock)
        if joules >= need_j and seconds >= need_s:
            break
        if seconds >= settings.max_window_s:
            raise AnytimeError(
                f"{what}: {calls} calls in {seconds:.3g} s moved the {source.reader} counter by {joules:.3g} J, less than "
                f"{settings.min_quanta} quanta of {source.quantum_j:.3g} J: the counter is too coarse for it; "
                "raise --energy-max-window-s or profile a larger batch"
            )
        grow = max(need_j / joules if joules > 0 else 2.0, need_s / seconds if seconds > 0 else 2.0)
        calls = max(calls + 1, min(calls * 2, math.ceil(calls * grow * 1.1)))
    per_j, per_s = [], []
    for _ in range(settings.windows):
        joules, seconds = _window(call, reader, calls, clock)
        per_j.append(joules / (calls * batch_size))
        per_s.append(max(seconds, 1e-12) / (calls * batch_size))
    return EnergyWindows(np.asarray(per_j), np.asarray(per_s), calls)


def _window(call: Callable[[], None], reader: EnergyReader, calls: int, clock: Clock) -> tuple[float, float]:
    e0, t0 = reader.read_j(), clock()
    for _ in range(calls):
        call()
    e1, t1 = reader.read_j(), clock()
    return e1 - e0, t1 - t0


@dataclass(frozen=True)
class EnergyMeter:
    """What a profile's energy figures were measured with: the source, the window settings and the idle power."""

    source: EnergySource
    settings: EnergySettings
    idle_w: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        s = self.settings
        return {**self.source.to_dict(), "idle_w": self.idle_w, "windows": s.windows, "min_window_s": s.min_window_s,
                "max_window_s": s.max_window_s, "min_quanta": s.min_quanta, "idle_s": s.idle_s}  # fmt: skip

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> EnergyMeter:
        """Rebuild from :meth:`to_dict` (a ``KeyError``/``ValueError``/``AnytimeError`` for a malformed one)."""
        settings = EnergySettings(int(doc["windows"]), float(doc["min_window_s"]), float(doc["max_window_s"]),
                                  int(doc["min_quanta"]), float(doc["idle_s"]))  # fmt: skip
        idle = doc.get("idle_w")
        if idle is not None and not (math.isfinite(float(idle)) and float(idle) >= 0):
            raise ValueError("idle power")
        return cls(EnergySource.from_dict(doc), settings, None if idle is None else float(idle))


@dataclass(frozen=True)
class BatchEnergy:
    """Energy at one batch size: ``steps[k]``, step k answered alone; ``paths[k]`` (incremental models), one
    pass through exits 0..k, what an early exit at k costs."""

    steps: tuple[EnergyWindows, ...]
    paths: tuple[EnergyWindows, ...] | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {"steps": [w.to_dict() for w in self.steps],
                "paths": None if self.paths is None else [w.to_dict() for w in self.paths]}  # fmt: skip

    @classmethod
    def from_dict(cls, doc: dict[str, Any], num_steps: int, where: str) -> BatchEnergy:
        """Rebuild from :meth:`to_dict`, checked against the profile's step count."""
        steps = tuple(EnergyWindows.from_dict(w, where) for w in doc["steps"])
        paths = None if doc.get("paths") is None else tuple(EnergyWindows.from_dict(w, where) for w in doc["paths"])
        if len(steps) != num_steps or (paths is not None and len(paths) != num_steps):
            raise ValueError("energy steps do not match")
        return cls(steps, paths)
