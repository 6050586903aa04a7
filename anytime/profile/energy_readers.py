"""Energy readers: the machine's energy counters or power rails behind one interface (:class:`EnergyReader`), each
giving the energy consumed since it was opened, in joules, as a non-decreasing number: x86 CPUs' RAPL package
counters (:class:`RaplReader`, wrap-arounds undone), an NVIDIA GPU through NVML (:class:`NvmlReader`: its
total-energy counter, else its power sampled and integrated) and a Jetson board's INA3221 rails
(:func:`open_jetson_reader`, sampled and integrated), with :func:`open_energy_reader` picking the source a device
offers or raising one line naming every source it tried; :mod:`anytime.profile.energy` measures with them.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from anytime.errors import AnytimeError
from anytime.utils.timer import Clock, monotonic

RAPL_ROOT = Path("/sys/class/powercap")
INA_ROOT = Path("/sys/bus/i2c/drivers")
#: Intel's RAPL energy status unit is 2^-14 J on client parts and 2^-16 J on many servers; sysfs does not say
#: which, so the coarser one bounds the quantum.
RAPL_QUANTUM_J = 2.0**-14
#: How often RAPL refreshes its counters (about every millisecond).
RAPL_REFRESH_S = 1e-3
#: Jetson board rails that measure the whole board's input, preferred over summing the others.
BOARD_RAILS = ("VDD_IN", "POM_5V_IN", "VIN_SYS_5V0")


@dataclass(frozen=True)
class EnergySource:
    """What a reader reads: its kind, the counters or rails, its quantum (J), how often it refreshes (s), whether
    its energy is integrated from sampled power, and the power mode the machine ran in (where one is readable)."""

    reader: str
    detail: str
    quantum_j: float
    refresh_s: float
    sampled: bool
    power_mode: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {"reader": self.reader, "detail": self.detail, "quantum_j": self.quantum_j, "refresh_s": self.refresh_s,
                "sampled": self.sampled, "power_mode": self.power_mode}  # fmt: skip

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> EnergySource:
        """Rebuild from :meth:`to_dict` (a ``KeyError``/``ValueError`` for a malformed one)."""
        quantum, refresh = float(doc["quantum_j"]), float(doc["refresh_s"])
        if not (quantum > 0 and refresh > 0 and math.isfinite(quantum + refresh)):
            raise ValueError("quantum and refresh must be positive")
        mode = doc.get("power_mode")
        return cls(str(doc["reader"]), str(doc["detail"]), quantum, refresh, bool(doc["sampled"]),
                   None if mode is None else str(mode))  # fmt: skip


class EnergyReader(Protocol):
    """Energy consumed since the reader opened (J, non-decreasing), exact within a ``sampling()`` block (a reader
    of sampled power runs its sampling thread only there, so the thread never competes with latency timings);
    ``close`` releases what the reader holds."""

    source: EnergySource

    def read_j(self) -> float: ...

    def sampling(self) -> AbstractContextManager[None]: ...

    def close(self) -> None: ...


class WrappingCounter:
    """A hardware counter that wraps around at ``wrap`` (in its own units), accumulated into a non-decreasing total.

    A read that is lower than the one before means the counter wrapped once since (reads come far more often than
    a wrap: RAPL's package counter wraps after about 262 kJ, tens of minutes at full power)."""

    def __init__(self, first: float, wrap: float | None) -> None:
        self._last = float(first)
        self._wrap = wrap
        self.total = 0.0

    def update(self, value: float) -> float:
        """Add the change since the last read (undoing one wrap-around); returns the total."""
        delta = float(value) - self._last
        if delta < 0:
            if not self._wrap:
                raise AnytimeError(
                    f"an energy counter went backwards ({self._last:g} -> {value:g}) and names no wrap range"
                )
            delta += self._wrap
        self._last = float(value)
        self.total += delta
        return self.total


class PowerIntegral:
    """Energy from power samples (W at seconds): the trapezoid rule between consecutive samples. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: tuple[float, float] | None = None
        self.joules = 0.0
        self.samples = 0

    def add(self, t: float, watts: float) -> float:
        """Add a sample; returns the energy integrated so far (J). Samples out of time order are dropped."""
        if not math.isfinite(watts) or watts < 0:
            raise AnytimeError(f"a power rail read {watts!r} W; check the reader (a rail that is off reads 0)")
        with self._lock:
            if self._last is not None:
                t0, w0 = self._last
                if t < t0:
                    return self.joules
                self.joules += 0.5 * (w0 + watts) * (t - t0)
            self._last = (t, watts)
            self.samples += 1
            return self.joules


class SampledPower:
    """A reader from a power probe: ``power_w()`` is sampled at every :meth:`read_j` and, inside a :meth:`sampling`
    block (when ``background``), every ``interval_s`` by a daemon thread; the samples are integrated."""

    def __init__(self, source: EnergySource, power_w: Callable[[], float], *, interval_s: float,
                 clock: Clock = monotonic, background: bool = True) -> None:  # fmt: skip
        self.source = source
        self._power_w = power_w
        self._clock = clock
        self._interval_s = interval_s
        self._background = background
        self._integral = PowerIntegral()
        self._integral.add(clock(), power_w())

    def _sample(self, stop: threading.Event) -> None:
        while not stop.wait(self._interval_s):
            try:
                self._integral.add(self._clock(), self._power_w())
            except Exception:  # the next read_j (in the measuring thread) raises the reader's error
                return

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Sample in the background for the block's duration (nothing runs outside it)."""
        if not self._background:
            yield
            return
        stop = threading.Event()
        thread = threading.Thread(target=self._sample, args=(stop,), name="anytime-power", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=1.0)

    def read_j(self) -> float:
        """Energy since opening (J), including a sample taken now."""
        return self._integral.add(self._clock(), self._power_w())

    def close(self) -> None:
        """Nothing outlives a sampling block."""


class RaplReader:
    """The RAPL package domains' counters (µJ) under ``root``, summed over packages, wrap-arounds undone."""

    def __init__(self, root: str | Path | None = None) -> None:
        base = Path(root) if root is not None else RAPL_ROOT
        domains = sorted(p for p in base.glob("intel-rapl:*") if re.fullmatch(r"intel-rapl:\d+", p.name))
        if not domains:
            raise _Unreadable(f"RAPL: {base} has no intel-rapl:N domain (a virtual machine hides it; on bare metal "
                              "load the intel_rapl_common module)")  # fmt: skip
        self._files = [d / "energy_uj" for d in domains]
        counters = []
        for domain, path in zip(domains, self._files):
            try:
                first = float(path.read_text().strip())
            except PermissionError:
                raise _Unreadable(f"RAPL: {path} is readable by root only (Linux 5.10 on); run as root or "
                                  f"`sudo chmod a+r {base}/intel-rapl:*/energy_uj`") from None  # fmt: skip
            except (OSError, ValueError):
                raise _Unreadable(f"RAPL: {path} is missing or not a number") from None
            wrap = _read_number(domain / "max_energy_range_uj")
            counters.append(WrappingCounter(first, wrap))
        self._counters = counters
        names = [(_read_text(d / "name") or d.name) for d in domains]
        limit = _read_number(domains[0] / "constraint_0_power_limit_uw")
        from anytime.utils.machine import cpu_governor

        governor = cpu_governor()
        mode = ", ".join(part for part in (
            f"package limit {limit / 1e6:g} W" if limit else None, f"governor {governor}" if governor else None,
        ) if part) or None  # fmt: skip
        self.source = EnergySource("rapl", f"{' + '.join(names)} ({base})", RAPL_QUANTUM_J, RAPL_REFRESH_S, False, mode)

    def read_j(self) -> float:
        """Energy since opening (J), over every package."""
        total = 0.0
        for path, counter in zip(self._files, self._counters):
            try:
                value = float(path.read_text().strip())
            except (OSError, ValueError):
                raise AnytimeError(f"RAPL: {path} could not be read during the measurement") from None
            total += counter.update(value)
        return total * 1e-6

    def sampling(self) -> AbstractContextManager[None]:
        """A counter needs no sampling."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Nothing to release."""


class NvmlReader:
    """An NVIDIA GPU through NVML: its total-energy counter (mJ) where it has one, else its power (mW) sampled
    every ``interval_s`` and integrated. ``nvml`` is the ``pynvml`` module (tests pass a recorded stand-in)."""

    def __init__(self, index: int = 0, *, nvml: Any = None, interval_s: float = 0.01, clock: Clock = monotonic,
                 background: bool = True) -> None:  # fmt: skip
        if nvml is None:
            try:
                import pynvml as nvml  # type: ignore[import-not-found, no-redef]
            except ImportError:
                raise _Unreadable(
                    "NVML: pynvml is not installed (pip install 'anytime[energy]', i.e. nvidia-ml-py)"
                ) from None
        self._nvml = nvml
        try:
            nvml.nvmlInit()
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
        except nvml.NVMLError as exc:
            raise _Unreadable(f"NVML: no GPU {index} ({exc}); is the NVIDIA driver loaded?") from None
        self._handle = handle
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:
            mode: str | None = f"power limit {nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000:g} W"
        except nvml.NVMLError:
            mode = None
        self._sampled: SampledPower | None = None
        self._counter: WrappingCounter | None
        try:
            self._counter = WrappingCounter(float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle)), 2.0**64)
            self.source = EnergySource("nvml", f"GPU {index} {name}: total-energy counter", 1e-3, 0.1, False, mode)
        except nvml.NVMLError:
            self._counter = None
            source = EnergySource("nvml", f"GPU {index} {name}: power sampled every {interval_s * 1000:g} ms",
                                  1e-3, max(interval_s, 0.02), True, mode)  # fmt: skip
            self._sampled = SampledPower(
                source, self._power_w, interval_s=interval_s, clock=clock, background=background
            )
            self.source = source

    def _power_w(self) -> float:
        try:
            return float(self._nvml.nvmlDeviceGetPowerUsage(self._handle)) / 1000.0
        except self._nvml.NVMLError as exc:
            raise AnytimeError(f"NVML: the GPU's power could not be read during the measurement ({exc})") from None

    def read_j(self) -> float:
        """Energy since opening (J)."""
        if self._sampled is not None:
            return self._sampled.read_j()
        assert self._counter is not None
        try:
            value = float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except self._nvml.NVMLError as exc:
            raise AnytimeError(
                f"NVML: the GPU's energy counter could not be read during the measurement ({exc})"
            ) from None
        return self._counter.update(value) * 1e-3

    def sampling(self) -> AbstractContextManager[None]:
        """The power sampler's block, where power is sampled; nothing for the energy counter."""
        return self._sampled.sampling() if self._sampled is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Release NVML."""
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


@dataclass(frozen=True)
class _Rail:
    label: str
    power: Path | None  # mW (the ina3221x iio driver)
    voltage: Path | None  # mV and mA (the ina3221 hwmon driver)
    current: Path | None

    def watts(self) -> float:
        try:
            if self.power is not None:
                return float(self.power.read_text().strip()) / 1000.0
            assert self.voltage is not None and self.current is not None
            return float(self.voltage.read_text().strip()) * float(self.current.read_text().strip()) / 1e6
        except (OSError, ValueError):
            raise AnytimeError(f"Jetson INA3221: rail {self.label} could not be read during the measurement") from None


def jetson_rails(root: str | Path | None = None) -> list[_Rail]:
    """The INA3221 rails under ``root``: JetPack 4's ``ina3221x`` iio files (``in_power<i>_input`` in mW,
    ``rail_name_<i>``) and JetPack 5's ``ina3221`` hwmon files (``in<i>_label``, ``in<i>_input`` in mV,
    ``curr<i>_input`` in mA)."""
    base = Path(root) if root is not None else INA_ROOT
    rails: list[_Rail] = []
    for power in sorted(base.glob("ina3221x/*/iio:device*/in_power*_input")):
        i = power.name[len("in_power") : -len("_input")]
        rails.append(_Rail(_read_text(power.parent / f"rail_name_{i}") or f"rail{i}", power, None, None))
    for label in sorted(base.glob("ina3221/*/hwmon/hwmon*/in*_label")):
        i = label.name[2 : -len("_label")]
        voltage, current = label.parent / f"in{i}_input", label.parent / f"curr{i}_input"
        if voltage.exists() and current.exists():
            rails.append(_Rail(_read_text(label) or f"in{i}", None, voltage, current))
    return rails


def open_jetson_reader(root: str | Path | None = None, *, interval_s: float = 0.005, clock: Clock = monotonic,
                       background: bool = True, power_mode: str | None = None) -> SampledPower:  # fmt: skip
    """A Jetson board's energy from its INA3221 rails: the board input rail if one is labelled so, else every rail."""
    rails = jetson_rails(root)
    if not rails:
        base = root if root is not None else INA_ROOT
        raise _Unreadable(
            f"Jetson INA3221: no power rails under {base}/ina3221x or {base}/ina3221 (not a Jetson board)"
        )
    board = [r for r in rails if r.label in BOARD_RAILS]
    used = board[:1] or rails
    for rail in used:
        rail.watts()
    if power_mode is None:
        from anytime.utils.machine import jetson_power_mode

        power_mode = jetson_power_mode()
    source = EnergySource("jetson-ina", f"INA3221 rail{'s' if len(used) > 1 else ''} {' + '.join(r.label for r in used)}, "
                          f"sampled every {interval_s * 1000:g} ms", 1e-3, max(interval_s, 0.005), True, power_mode)  # fmt: skip
    return SampledPower(source, lambda: sum(r.watts() for r in used), interval_s=interval_s, clock=clock,
                        background=background)  # fmt: skip


class _Unreadable(AnytimeError):
    """One source that cannot be read here (collected into the one-line error of :func:`open_energy_reader`)."""


def open_energy_reader(device_type: str = "cpu", index: int | None = None) -> EnergyReader:
    """The energy source for a device: NVML for a CUDA GPU; a Jetson board's rails, else RAPL, for its CPU.

    Raises one :class:`AnytimeError` naming every source tried and why it cannot be read."""
    tried: list[str] = []
    openers: Sequence[Callable[[], EnergyReader]]
    if device_type == "cuda":
        openers = (lambda: NvmlReader(index or 0), open_jetson_reader)
    else:
        openers = (open_jetson_reader, RaplReader)
    for opener in openers:
        try:
            return opener()
        except _Unreadable as exc:
            tried.append(str(exc))
    raise AnytimeError("no readable energy source: " + "; ".join(tried) + ". Profile without --energy")


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_number(path: Path) -> float | None:
    text = _read_text(path)
    try:
        return float(text) if text else None
    except ValueError:
        return None
