"""Which step or early-exit policy meets a deadline: the frontier of options and a binary search on it.

An option is a single step chosen up front, or a calibrated early-exit policy over an incremental model.
Its latency at quantile q comes from the device profile, priced as the anytime runtime pays for an answer where the
profile measured that (:func:`anytime.scheduler.pricing.price_answers`; else the model's own latencies): a step's
samples, or for a policy the mixture of the exit paths weighted by where its validation samples leave (for a batch, by where the deepest sample
of the batch leaves, since the batch runs until its last sample does). Options are sorted by latency and
only those more accurate than every cheaper one are kept: the frontier. ``select`` is then a bisection.

Where the profile measured energy, an option also has its mean joules per inference (a policy's: the exit paths'
energies weighted the same way), and ``select(..., energy_mj=E)`` answers the most accurate option that fits both
the deadline and the energy budget; the frontier is then two-dimensional (no option both faster and more frugal
is as accurate).
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from anytime.calibrate import ExitPolicy
from anytime.errors import AnytimeError
from anytime.profile.stats import quantile_of
from anytime.profile.store import DeviceProfile
from anytime.scheduler.online import DriftEstimator


@dataclass(frozen=True)
class Option:
    """One way to answer: a single ``step``, or an early-exit ``policy`` with its validation exit shares."""

    name: str
    accuracy: float
    step: int | None = None
    policy: ExitPolicy | None = None
    exit_share: tuple[float, ...] | None = None

    @property
    def kind(self) -> str:
        """``step`` or ``policy``."""
        return "step" if self.policy is None else "policy"


@dataclass(frozen=True)
class Selection:
    """The scheduler's answer: the option, its expected accuracy and its latency at the quantile asked.

    ``fits`` is False when even the cheapest option's latency exceeds the deadline; ``option`` is then the
    cheapest one and ``note`` says it will likely miss. ``drift`` is the online estimate over the profiled
    to the profiled latencies (1 for the profile as measured). With an energy budget, ``energy_mj`` is the option's
    mean millijoules per inference and ``fits`` means both fit (``note`` names the budget missed).
    """

    option: str
    kind: str
    step: int | None
    accuracy: float
    latency_ms: float
    deadline_ms: float
    quantile: float
    batch_size: int
    fits: bool
    drift: float
    note: str | None = None
    energy_mj: float | None = None
    energy_budget_mj: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (the energy fields only where an energy budget was asked)."""
        energy = (
            {}
            if self.energy_budget_mj is None
            else {"energy_mj": self.energy_mj, "energy_budget_mj": self.energy_budget_mj}
        )
        return {"option": self.option, "kind": self.kind, "step": self.step, "accuracy": self.accuracy,
                "latency_ms": self.latency_ms, "deadline_ms": self.deadline_ms, "quantile": self.quantile,
                "batch_size": self.batch_size, "fits": self.fits, "drift": self.drift, "note": self.note, **energy}  # fmt: skip


@dataclass(frozen=True)
class _Frontier:
    latency: list[float]  # ascending
    options: list[Option]
    profiled: list[float]  # each option's latency as profiled
    version: int = -1  # the drift estimate's version it was built at (-1: as profiled)


def check_deadline(deadline_ms: float) -> float:
    """Refuse a deadline that is not a positive number (NaN, zero, negative, not a number at all)."""
    if type(deadline_ms) in (float, int) and deadline_ms > 0:  # the common case, without the ABC check
        return float(deadline_ms)
    if isinstance(deadline_ms, bool) or not isinstance(deadline_ms, numbers.Real) or not deadline_ms > 0:
        raise AnytimeError(f"deadline {deadline_ms!r} ms is not a positive number of milliseconds")
    return float(deadline_ms)


def check_energy_budget(energy_mj: float) -> float:
    """Refuse an energy budget that is not a positive finite number of millijoules."""
    if isinstance(energy_mj, bool) or not isinstance(energy_mj, numbers.Real) or not 0 < energy_mj < math.inf:
        raise AnytimeError(f"energy budget {energy_mj!r} mJ is not a positive number of millijoules")
    return float(energy_mj)


class DeadlineScheduler:
    """Answers ``select(deadline_ms, quantile, batch_size)`` with the most accurate option that fits.

    ``observe(option, seconds)`` feeds measured latencies back; with ``adapt`` the profiled latencies are
    corrected by the drift they reveal (see :class:`DriftEstimator`; ``tracked_quantile`` is the level its
    stall excess is measured at), so choices follow a device that slows down, speeds up or stalls; with
    ``come_down`` a tail the measured latencies show to be pessimistic comes down to them too, and so do all prices
    when the median runs faster than profiled; without it no price ever goes below the profile's (the runtime's
    promise: a faster median does not shorten an idle core's wake-up, and a price scaled down by it was late). The scheduler checks that the profile has as many steps as the options name; that
    the profile was measured on these very weights is checked where both are loaded (``scheduler_for_run``).
    """

    def __init__(
        self, profile: DeviceProfile, options: Sequence[Option], *, adapt: bool = True, window: int = 200,
        min_observations: int = 20, tracked_quantile: float | None = None, come_down: bool = True,
    ) -> None:  # fmt: skip
        if not options:
            raise AnytimeError("the scheduler needs at least one option (a step or a policy)")
        names = [o.name for o in options]
        if len(set(names)) != len(names):
            raise AnytimeError(f"option names must be unique (got {names})")
        for o in options:
            _check_option(o, profile)
        self.profile = profile
        self.options = {o.name: o for o in options}
        self.adapt = adapt
        self._frontiers: dict[tuple[float, int], _Frontier] = {}
        self._adapted: dict[tuple[float, int], _Frontier] = {}
        self._costs: dict[tuple[float, int], dict[str, float]] = {}  # every option's profiled latency
        self._energy_cache: dict[int, dict[str, float]] = {}  # every option's mean mJ per batch size
        self._references: dict[tuple[str, int, int | None], tuple[float, float]] = {}
        # By default p99, or the highest quantile the profile's samples resolve if that is lower.
        self.tracked_quantile = profile.check_quantile(
            tracked_quantile if tracked_quantile is not None else profile.highest_quantile()
        )
        self.drift = DriftEstimator(window=window, min_observations=min_observations,
                                    tracked_quantile=self.tracked_quantile if come_down else None,
                                    rise_only=not come_down)  # fmt: skip

    @classmethod
    def from_accuracies(
        cls, profile: DeviceProfile, step_accuracy: Sequence[float], policies: Sequence[Option] = (), **kwargs: Any
    ) -> DeadlineScheduler:
        """Every step as an option (named after the profile's steps), plus the given policy options."""
        if len(step_accuracy) != profile.num_steps:
            raise AnytimeError(f"{len(step_accuracy)} step accuracies for a profile of {profile.num_steps} steps")
        steps = [Option(name, float(a), step=k) for k, (name, a) in enumerate(zip(profile.step_names, step_accuracy))]
        return cls(profile, steps + list(policies), **kwargs)

    def latency(self, option: str | Option, quantile: float = 0.99, batch_size: int = 1) -> float:
        """An option's profiled latency (ms) at a quantile and batch size, before any drift."""
        o = self._option(option)
        q = self.profile.check_quantile(quantile)
        if o.policy is None:
            assert o.step is not None
            return quantile_of(self.profile.answer_samples(o.step, batch_size), q)
        samples, weights = self._policy_mixture(o, batch_size)
        return quantile_of(samples, q, weights)

    def energy_mj(self, option: str | Option, batch_size: int = 1) -> float:
        """An option's mean millijoules per inference at a batch size (a profile measured with energy)."""
        o = self._option(option)
        if o.policy is None:
            assert o.step is not None
            return 1000.0 * self.profile.step_energy_j(o.step, batch_size)
        paths = [self.profile.path_energy_j(k, batch_size) for k in range(self.profile.num_steps)]
        return 1000.0 * float(np.dot(_deepest_share(o, batch_size), paths))

    def frontier(self, quantile: float = 0.99, batch_size: int = 1) -> list[tuple[Option, float]]:
        """The options worth choosing, cheapest first, each with its profiled latency (ms)."""
        f = self._frontier(quantile, batch_size)
        return list(zip(f.options, f.latency))

    def frontier_points(self, quantile: float = 0.99, batch_size: int = 1, *, energy: bool = False
                        ) -> list[tuple[Option, float, float | None]]:  # fmt: skip
        """(option, latency ms, mean mJ or None) of the options worth choosing, fastest first: the latency frontier,
        or with ``energy`` the two-dimensional one (no other option as accurate is both as fast and as frugal)."""
        if not energy:
            return [(o, latency, None) for o, latency in self.frontier(quantile, batch_size)]
        self._frontier(quantile, batch_size)
        costs = self._costs[(quantile, batch_size)]
        energies = self._energies(batch_size)
        return [*_pareto([(self.options[n], costs[n], energies[n]) for n in self.options])]

    def select(self, deadline_ms: float, quantile: float = 0.99, batch_size: int = 1, *,
               energy_mj: float | None = None) -> Selection:  # fmt: skip
        """The most accurate option whose latency at ``quantile`` fits in ``deadline_ms`` (and, given
        ``energy_mj``, whose mean energy per inference fits in it too).

        A deadline below every option gives the cheapest one with ``fits=False`` and a note, never a silent
        miss; an energy budget below every option that fits the deadline gives the most frugal of those, with a
        note. NaN, zero or negative deadlines or budgets and quantiles the profile cannot resolve are refused.
        """
        check_deadline(deadline_ms)
        key = (quantile, batch_size)
        if energy_mj is not None:
            check_energy_budget(energy_mj)
            self._frontier(quantile, batch_size)
            profiled = self._costs[key]
            now = profiled
            if self.adapt and self.drift.ready:
                now = {name: self.drift.estimate(cost, quantile, name) for name, cost in profiled.items()}
            return _pick_within(self.options, now, profiled, self._energies(batch_size), deadline_ms, energy_mj,
                                quantile, batch_size)  # fmt: skip
        f = self._frontiers.get(key) or self._frontier(quantile, batch_size)
        if self.adapt and self.drift.ready:
            adapted = self._adapted.get(key)
            f = adapted if adapted is not None and adapted.version == self.drift.version else self._adapt(key)
        return _pick(f, deadline_ms, quantile, batch_size)

    def quote(self, option: str | Option, deadline_ms: float, quantile: float = 0.99, batch_size: int = 1, *,
              energy_mj: float | None = None) -> Selection:  # fmt: skip
        """One option's price at ``quantile`` (as the drift estimate has it now) against ``deadline_ms`` (and, given
        ``energy_mj``, its mean energy against that budget): the selection of that option, ``fits`` saying whether
        it fits."""
        check_deadline(deadline_ms)
        o = self._option(option)
        self._frontier(quantile, batch_size)
        profiled = self._costs[(quantile, batch_size)][o.name]
        latency = self.drift.estimate(profiled, quantile, o.name) if self.adapt and self.drift.ready else profiled
        fits = latency <= deadline_ms
        energy = None
        if energy_mj is not None:
            check_energy_budget(energy_mj)
            energy = self._energies(batch_size)[o.name]
            fits = fits and energy <= energy_mj
        return Selection(o.name, o.kind, o.step, o.accuracy, latency, float(deadline_ms), quantile, batch_size, fits,
                         latency / profiled, None, energy, None if energy_mj is None else float(energy_mj))  # fmt: skip

    def observe(
        self,
        option: str | Option | Selection,
        seconds: float,
        batch_size: int | None = None,
        *,
        step: int | None = None,
    ) -> None:
        """Feed back the measured latency (seconds) of one answer given by ``option``.

        ``batch_size`` defaults to the selection's (or 1). A policy's latency depends on the exit its
        answer reached, so observing a policy needs ``step``, that exit (``AnytimePrediction.step``);
        the time is then compared with the profiled time to reach that exit.
        """
        if isinstance(option, Selection):
            name, batch = option.option, batch_size or option.batch_size
        else:
            name, batch = (option if isinstance(option, str) else option.name), batch_size or 1
        key = (name, batch, step)
        profiled = self._references.get(key)
        if profiled is None:
            o = self._option(name)
            q = self.tracked_quantile
            if o.policy is None:
                profiled = (self.latency(o, 0.5, batch), self.latency(o, q, batch))
            elif step is None or not 0 <= step < self.profile.num_steps:
                raise AnytimeError(
                    f"observing the policy option {name} needs step=the exit its answer reached (0..{self.profile.num_steps - 1})"
                )
            else:
                path = self.profile.answer_path_samples(step, batch)
                profiled = (quantile_of(path, 0.5), quantile_of(path, q))
            self._references[key] = profiled
        self.drift.observe(1000.0 * seconds, *profiled, name)
        if self.adapt and self.drift.ready:
            for used in list(self._adapted):  # rebuilt here, after the answer, so that select stays a bisection
                self._adapt(used)

    def _option(self, option: str | Option) -> Option:
        name = option if isinstance(option, str) else option.name
        try:
            return self.options[name]
        except KeyError:
            raise AnytimeError(f"no option named '{name}'; the options are {', '.join(self.options)}") from None

    def _energies(self, batch_size: int) -> dict[str, float]:
        found = self._energy_cache.get(batch_size)
        if found is None:
            self.profile.require_energy()
            self.profile.at(batch_size)
            found = self._energy_cache[batch_size] = {
                name: self.energy_mj(o, batch_size) for name, o in self.options.items()
            }
        return found

    def _policy_mixture(self, option: Option, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        deepest = _deepest_share(option, batch_size)
        paths = [self.profile.answer_path_samples(k, batch_size) for k in range(self.profile.num_steps)]
        weights = [np.full(p.size, w / p.size) for p, w in zip(paths, deepest)]
        return np.concatenate(paths), np.concatenate(weights)

    def _frontier(self, quantile: float, batch_size: int) -> _Frontier:
        """The frontier as profiled (cached per quantile and batch size)."""
        key = (quantile, batch_size)
        found = self._frontiers.get(key)
        if found is not None:
            return found
        self.profile.check_quantile(quantile)
        self.profile.at(batch_size)
        costs = self._costs[key] = {o.name: self.latency(o, quantile, batch_size) for o in self.options.values()}
        frontier = self._frontiers[key] = _build(costs, costs, self.options, -1)
        return frontier

    def _adapt(self, key: tuple[float, int]) -> _Frontier:
        """The frontier with every option's latency as the drift estimate has it now (built from all options:
        a stall adds the same time to every option, so the profile's dominated options are looked at again)."""
        quantile, batch_size = key
        self._frontier(quantile, batch_size)
        profiled = self._costs[key]
        now = {name: self.drift.estimate(cost, quantile, name) for name, cost in profiled.items()}
        frontier = self._adapted[key] = _build(now, profiled, self.options, self.drift.version)
        return frontier


def _deepest_share(option: Option, batch_size: int) -> np.ndarray:
    """Per exit, the share of batches whose deepest sample leaves there (a batch runs until its last one does)."""
    assert option.exit_share is not None
    reach = np.cumsum(np.asarray(option.exit_share, dtype=np.float64))
    reach = np.clip(reach / reach[-1], 0.0, 1.0)
    return np.diff(np.concatenate([[0.0], reach**batch_size]))


def _pareto(points: Sequence[tuple[Option, float, float]]) -> list[tuple[Option, float, float]]:
    """The points no other point dominates (as fast, as frugal, as accurate, one of them strictly), fastest first."""
    kept: list[tuple[Option, float, float]] = []
    for o, latency, energy in sorted(points, key=lambda p: (p[1], p[2], -p[0].accuracy)):
        if not any(e <= energy and k.accuracy >= o.accuracy for k, _, e in kept):
            kept.append((o, latency, energy))
    return kept


def _pick_within(
    options: dict[str, Option], costs: dict[str, float], profiled: dict[str, float], energies: dict[str, float],
    deadline_ms: float, energy_mj: float, quantile: float, batch_size: int,
) -> Selection:  # fmt: skip
    """The most accurate option within both budgets (ties: the faster, then the more frugal); else the most
    frugal one that meets the deadline, else the fastest, each with ``fits=False`` and a note."""
    names = list(options)
    both = [n for n in names if costs[n] <= deadline_ms and energies[n] <= energy_mj]
    note = None
    if both:
        name = max(both, key=lambda n: (options[n].accuracy, -costs[n], -energies[n]))
    else:
        in_time = [n for n in names if costs[n] <= deadline_ms]
        if in_time:
            name = min(in_time, key=lambda n: (energies[n], -options[n].accuracy))
            note = (f"energy budget {energy_mj:g} mJ is below every option that meets {deadline_ms:g} ms: {name}, the "
                    f"most frugal of them, takes {energies[name]:.4g} mJ per inference")  # fmt: skip
        else:
            name = min(names, key=lambda n: (costs[n], -options[n].accuracy))
            note = (f"deadline {deadline_ms:g} ms is below the cheapest option: {name} takes {costs[name]:.4g} ms at "
                    f"p{100 * quantile:g}, so it will likely miss")  # fmt: skip
    o = options[name]
    return Selection(o.name, o.kind, o.step, o.accuracy, costs[name], float(deadline_ms), quantile, batch_size,
                     note is None, costs[name] / profiled[name], note, energies[name], float(energy_mj))  # fmt: skip


def _pick(f: _Frontier, deadline_ms: float, quantile: float, batch_size: int) -> Selection:
    """The last option of the frontier that fits the deadline, or the cheapest with a note that it will miss."""
    i = bisect.bisect_right(f.latency, deadline_ms) - 1
    fits = i >= 0
    i = max(i, 0)
    o, latency = f.options[i], f.latency[i]
    note = None if fits else (f"deadline {deadline_ms:g} ms is below the cheapest option: {o.name} takes "
                              f"{latency:.4g} ms at p{100 * quantile:g}, so it will likely miss")  # fmt: skip
    return Selection(o.name, o.kind, o.step, o.accuracy, latency, float(deadline_ms), quantile, batch_size, fits,
                     latency / f.profiled[i], note)  # fmt: skip


def _build(costs: dict[str, float], profiled: dict[str, float], options: dict[str, Option], version: int) -> _Frontier:
    """Options sorted by cost; only those more accurate than every cheaper one kept (ties: the more accurate
    at equal cost, the cheaper at equal accuracy)."""
    latency: list[float] = []
    chosen: list[Option] = []
    for cost, negative_accuracy, name in sorted((c, -options[n].accuracy, n) for n, c in costs.items()):
        if not chosen or -negative_accuracy > chosen[-1].accuracy:
            latency.append(cost)
            chosen.append(options[name])
    return _Frontier(latency, chosen, [profiled[o.name] for o in chosen], version)


def _check_option(option: Option, profile: DeviceProfile) -> None:
    if not (0 <= option.accuracy <= 1) or math.isnan(option.accuracy):
        raise AnytimeError(f"option {option.name}: accuracy {option.accuracy} is not in [0, 1]")
    if option.policy is None:
        if option.step is None or not 0 <= option.step < profile.num_steps:
            raise AnytimeError(
                f"option {option.name}: step {option.step} is not one of the profile's 0..{profile.num_steps - 1}"
            )
        return
    if not profile.incremental:
        raise AnytimeError(
            f"option {option.name}: an early-exit policy needs an incremental model's profile (with stages)"
        )
    if option.policy.num_steps != profile.num_steps:
        raise AnytimeError(
            f"option {option.name}: its policy is for {option.policy.num_steps} exits, the profile has {profile.num_steps}"
        )
    share = option.exit_share
    if (
        share is None
        or len(share) != profile.num_steps
        or not all(s >= 0 and math.isfinite(s) for s in share)
        or sum(share) <= 0
    ):
        raise AnytimeError(f"option {option.name}: needs {profile.num_steps} non-negative exit shares")


class PrecisionScheduler:
    """One frontier over the options of several schedulers: the same model at several precisions (or any
    variants of it), each with its own profile, measured on the same device.

    ``select`` answers with the most accurate (variant, option) whose latency fits; its ``option`` reads
    ``"VARIANT OPTION"`` (``int8 exit1``) and :meth:`variant_of` says which variant's model serves it.
    """

    def __init__(self, schedulers: dict[str, DeadlineScheduler]) -> None:
        if not schedulers:
            raise AnytimeError("give at least one variant to schedule")
        devices = {name: _device_key(s.profile) for name, s in schedulers.items()}
        first = next(iter(devices.values()))
        other = next((name for name, d in devices.items() if d != first), None)
        if other is not None:
            raise AnytimeError(
                f"the profiles were measured on different devices ({first[1]} vs {devices[other][1]} for {other}); "
                "profile every variant on the device that will run it"
            )
        self.schedulers = dict(schedulers)
        self._options = {
            f"{variant} {o.name}": (variant, o) for variant, s in schedulers.items() for o in s.options.values()
        }
        self._frontiers: dict[tuple[float, int], _Frontier] = {}

    def variant_of(self, option: str) -> str:
        """The variant (a scheduler's name) whose model serves ``option``."""
        try:
            return self._options[option][0]
        except KeyError:
            raise AnytimeError(f"no option named '{option}'; the options are {', '.join(self._options)}") from None

    def frontier(self, quantile: float = 0.99, batch_size: int = 1) -> list[tuple[Option, float]]:
        """The (variant, option) pairs worth choosing, cheapest first, each with its profiled latency (ms);
        an option's name is prefixed with its variant's."""
        f = self._frontier(quantile, batch_size)
        return list(zip(f.options, f.latency))

    def frontier_points(self, quantile: float = 0.99, batch_size: int = 1, *, energy: bool = False
                        ) -> list[tuple[Option, float, float | None]]:  # fmt: skip
        """As :meth:`DeadlineScheduler.frontier_points`, over every variant's options."""
        if not energy:
            return [(o, latency, None) for o, latency in self.frontier(quantile, batch_size)]
        costs, options = self._costs(quantile, batch_size)
        energies = self._energies(batch_size)
        return [*_pareto([(options[n], costs[n], energies[n]) for n in options])]

    def select(self, deadline_ms: float, quantile: float = 0.99, batch_size: int = 1, *,
               energy_mj: float | None = None) -> Selection:  # fmt: skip
        """The most accurate (variant, option) whose latency at ``quantile`` fits in ``deadline_ms`` (and mean
        energy in ``energy_mj``, given one); below every option, the cheapest with ``fits=False`` and a note, as
        :meth:`DeadlineScheduler.select`."""
        check_deadline(deadline_ms)
        if energy_mj is not None:
            check_energy_budget(energy_mj)
            costs, options = self._costs(quantile, batch_size)
            return _pick_within(options, costs, costs, self._energies(batch_size), deadline_ms, energy_mj, quantile,
                                batch_size)  # fmt: skip
        return _pick(self._frontier(quantile, batch_size), deadline_ms, quantile, batch_size)

    def _energies(self, batch_size: int) -> dict[str, float]:
        return {name: self.schedulers[variant].energy_mj(o, batch_size) for name, (variant, o) in self._options.items()}

    def _costs(self, quantile: float, batch_size: int) -> tuple[dict[str, float], dict[str, Option]]:
        costs: dict[str, float] = {}
        options: dict[str, Option] = {}
        for name, (variant, o) in self._options.items():
            costs[name] = self.schedulers[variant].latency(o, quantile, batch_size)
            options[name] = Option(name, o.accuracy, o.step, o.policy, o.exit_share)
        return costs, options

    def _frontier(self, quantile: float, batch_size: int) -> _Frontier:
        key = (quantile, batch_size)
        if key not in self._frontiers:
            costs, options = self._costs(quantile, batch_size)
            self._frontiers[key] = _build(costs, costs, options, -1)
        return self._frontiers[key]


def _device_key(profile: DeviceProfile) -> tuple[str, str]:
    device = profile.device
    return str(device.get("type")), str(device.get("label"))
