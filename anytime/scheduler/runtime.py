"""The anytime runtime: answer a request within its deadline, as accurately as the time allows.

For an incremental model the steps run in order. After each one the runner returns if the next stage's latency at
the quantile, scaled by the device's current drift, and the runner's own time (to finish its check and start the
stage, and to return an answer after its last stage) no longer fit in the time left (or, given an energy budget, if
reaching the next exit would cost more energy per inference than the budget, by the profile's exit-path energies),
or else if the exit is confident (the calibrated policy); otherwise it goes on. The first step always runs, so a
prediction always comes back. A non-incremental model (each step a separate forward) gets one step chosen up front
by the scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from anytime.calibrate import ExitPolicy
from anytime.calibrate.criteria import get_criterion
from anytime.contract import is_incremental, run_step, step_count
from anytime.errors import AnytimeError
from anytime.profile.stats import quantile_of
from anytime.profile.store import DeviceProfile
from anytime.scheduler.deadline import DeadlineScheduler, check_deadline, check_energy_budget
from anytime.scheduler.online import DriftEstimator, SortedWindow
from anytime.utils.timer import Clock, monotonic


# The way through the heads counts as reaching an exit when 9 requests in 10 would: foretold at its median pace,
# the runtime's deadline checks stopped 8-11% more of the fast CIFAR-10 card's requests at exit 0, 1.4-1.7 points
# below going straight to exit 1, which fitted.
REACH_PACE = 0.9


@dataclass(frozen=True)
class _Estimates:
    """A profile's latencies (ms) at the runtime's quantile and median: per stage, per step run alone, and per way
    through the heads to an exit (``way_pace[k]``: the :data:`REACH_PACE` quantile of stages 0..k summed repetition
    by repetition)."""

    tail: list[float]
    median: list[float]
    step_tail: list[float]
    step_median: list[float]
    way_pace: list[float]


@dataclass(frozen=True)
class AnytimePrediction:
    """One answered request.

    ``exits[i]`` is the step that answered sample i; ``step`` the deepest step that ran. ``reason``:
    ``confident`` (every sample passed its exit's threshold, with time and energy left for the next stage),
    ``deadline`` (the next stage would not fit: the policy is not consulted then, since this exit answers either
    way), ``energy`` (the next exit would exceed the energy budget), ``last`` (the last step ran), ``direct`` (the
    deadline let one exit fit alone but not the way to it through every earlier head, so the runtime went
    straight to it, no earlier head run), ``chosen`` (a non-incremental step picked up front) or ``pinned`` (the
    caller named the step: :meth:`AnytimeRunner.predict_at`).
    """

    predictions: Tensor
    logits: Tensor
    exits: Tensor
    step: int
    reason: str
    elapsed_ms: float
    deadline_ms: float

    @property
    def missed(self) -> bool:
        """Whether the answer came after the deadline."""
        return self.elapsed_ms > self.deadline_ms


class AnytimeRunner:
    """Runs an anytime model against deadlines with a device profile and (optionally) an early-exit policy.

    ``quantile`` is the latency quantile a stage must fit at before it starts. With ``adapt`` every stage's
    measured time feeds a :class:`DriftEstimator`, so the runner slows its ambitions when the device slows down,
    and the runner times what it does itself, which the profile does not time: its checks between two stages and
    the answer's bookkeeping after its last one. Each is added at its own quantile: a request that goes on with a
    few microseconds to spare would otherwise miss by them. They are kept apart from the stages, so that the drift
    estimate scales the model's latencies only (a direct jump to an exit has no checks to pay). ``margin_ms`` is
    kept free at the end as well, for returning the answer. A non-incremental model's step is chosen by
    ``scheduler``, else by one built from ``step_accuracy``, else the deepest step that fits (ladders gain accuracy
    with cost). The runner checks the profile's step count against the model; that the profile was measured on
    these weights is checked where both are loaded (``runner_for_run``). ``clock`` (seconds, monotonic; default
    :func:`anytime.utils.timer.monotonic`) is what every deadline is measured with: tests inject a fake one.
    ``length_profiles`` (a text model's profiles by sentence length in tokens) price each request by the shortest
    profiled length that holds it (``x.shape[1]``), its length bucket; ``profile`` is then the longest.
    """

    def __init__(
        self, model: nn.Module, profile: DeviceProfile, policy: ExitPolicy | None = None, *, quantile: float = 0.99,
        adapt: bool = True, margin_ms: float = 0.0, window: int = 200, min_observations: int = 20,
        scheduler: DeadlineScheduler | None = None, step_accuracy: Sequence[float] | None = None,
        clock: Clock = monotonic, length_profiles: Mapping[int, DeviceProfile] | None = None,
    ) -> None:  # fmt: skip
        num_steps = step_count(model)
        self.length_profiles = dict(sorted((length_profiles or {}).items()))
        if self.length_profiles:
            profile = self.length_profiles[max(self.length_profiles)]
            for length, bucket in self.length_profiles.items():
                bucket.check_model(None, num_steps, where=f"the profile of {length} tokens")
                bucket.check_quantile(quantile)
        profile.check_model(None, num_steps, where="the profile")
        if not (margin_ms >= 0 and math.isfinite(margin_ms)):
            raise AnytimeError(f"margin_ms must be a finite number >= 0 (got {margin_ms})")
        self.model = model
        self.profile = profile
        self.clock = clock
        self.quantile = profile.check_quantile(quantile)
        self.adapt = adapt
        self.margin_ms = float(margin_ms)
        self.incremental = is_incremental(model) and num_steps > 1
        if self.incremental and not profile.incremental:
            raise AnytimeError("the model runs its steps incrementally but the profile has no stage latencies; profile it again")
        self.policy = policy
        if policy is not None:
            if not self.incremental:
                raise AnytimeError("an early-exit policy needs an incremental model (one whose steps reuse each other's work)")
            if policy.num_steps != num_steps:
                raise AnytimeError(f"the policy is for {policy.num_steps} exits but the model has {num_steps}")
            if get_criterion(policy.criterion).stateful:
                raise AnytimeError(f"the runtime decides exit by exit from each exit's own logits; a {policy.criterion} "
                                   "calibration compares exits with each other: calibrate with --criterion entropy "
                                   "(or confidence, margin) for the runtime")  # fmt: skip
        self._num_steps = num_steps
        # What the drift estimate is told it measured: a stage by its index, a step run alone by this key.
        self._step_keys = [("step", k) for k in range(num_steps)]
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._sync = (lambda: torch.cuda.synchronize(self._device)) if self._device.type == "cuda" else (lambda: None)
        self._estimates: dict[tuple[int, int | None], tuple[list[float], list[float]]] = {}
        self._energies: dict[int, list[float]] = {}
        if self.incremental:
            self.drift = DriftEstimator(window=window, min_observations=min_observations, tracked_quantile=self.quantile)
            self._finish = SortedWindow(window)
            self._checks = SortedWindow(window)
            self.scheduler = None
        else:
            accuracy = step_accuracy if step_accuracy is not None else np.linspace(0, 1, num_steps + 2)[1:-1]
            self.scheduler = scheduler or DeadlineScheduler.from_accuracies(
                profile, list(accuracy), adapt=adapt, window=window, min_observations=min_observations,
                tracked_quantile=self.quantile,
            )  # fmt: skip
            self.drift = self.scheduler.drift

    def _profiled_batch(self, batch_size: int) -> int:
        """The smallest profiled batch size that holds ``batch_size`` samples (a conservative estimate)."""
        sizes = [b for b in self.profile.batch_sizes if b >= batch_size]
        if not sizes:
            raise AnytimeError(
                f"batch of {batch_size} is larger than any profiled batch size ({max(self.profile.batch_sizes)}); "
                f"profile with --batch-sizes up to {batch_size}"
            )
        return sizes[0]

    def bucket_of(self, length: int) -> int | None:
        """The profiled sentence length that prices a request of ``length`` tokens (None without length profiles)."""
        if not self.length_profiles:
            return None
        holding = [t for t in self.length_profiles if t >= length]
        if not holding:
            raise AnytimeError(f"a request of {length} tokens is longer than every profiled length "
                               f"({max(self.length_profiles)}); cut it, or profile that length")  # fmt: skip
        return holding[0]

    def _stage_estimates(self, batch_size: int, length: int | None = None) -> _Estimates:
        """Per stage and per step alone: latency at the quantile and median (ms), at the nearest profiled batch
        size at or above ``batch_size`` (and, with length profiles, the length bucket of ``length`` tokens)."""
        bucket = None if length is None else self.bucket_of(length)
        key = (batch_size, bucket)
        found = self._estimates.get(key)
        if found is not None:
            return found
        profile = self.profile if bucket is None else self.length_profiles[bucket]
        latency = profile.at(self._profiled_batch(batch_size))
        stages = latency.stages or ()
        median = [max(quantile_of(s, 0.5), 1e-9) for s in stages]
        if stages and len({s.size for s in stages}) == 1:
            ways = [quantile_of(w, REACH_PACE) for w in np.cumsum(np.stack(stages), axis=0)]
        else:  # stages not timed in the same repetitions: the sum of their quantiles bounds the way's
            ways = np.cumsum([quantile_of(s, REACH_PACE) for s in stages]).tolist()
        found = self._estimates[key] = _Estimates(
            [quantile_of(s, self.quantile) for s in stages], median,
            [quantile_of(s, self.quantile) for s in latency.steps], [max(quantile_of(s, 0.5), 1e-9) for s in latency.steps],
            ways,
        )  # fmt: skip
        return found

    def _direct_step(self, estimates: _Estimates, budget: float) -> int | None:
        """The exit to go straight to, skipping the heads on the way, when the deadline lets that exit alone fit
        but not the path through every earlier head to it; None when the path through the heads reaches as far."""
        # How far the way through the heads gets is foretold by the request's own rule at a pace most requests
        # keep: stage k starts if the time spent so far (the way to exit k-1 at its REACH_PACE quantile) and stage
        # k at the runtime's quantile fit.
        # Priced instead by the sum of its stages' quantiles, or by its own quantile, the way's tail stood on a
        # different footing from the tail of the exit alone it was weighed against: on a shared machine a
        # profile's bursts span several stages, and in one run the way's p99 came out 5% under the sum of its
        # stages' p99s with one thread and 15% over it with two.
        # A stall's excess is added once, as the request's own checks add it to the stage that would follow.
        # The runner's checks between the stages are timed apart from them, and are added here the same way.
        reach = 0
        level = self.drift.level() if self.adapt else 1.0
        check = self._check_ms() if self.adapt else 0.0
        paced_check = self._checks.quantile(REACH_PACE) if check else 0.0
        for k in range(1, len(estimates.tail)):
            factor, add = self.drift.affine(self.quantile, k) if self.adapt else (1.0, 0.0)
            way = level * estimates.way_pace[k - 1] + (k - 1) * paced_check
            if way + factor * estimates.tail[k] + add + check > budget:
                break
            reach = k
        direct, add = -1, 0.0
        for k, tail in enumerate(estimates.step_tail):
            if self.adapt:
                factor, add = self.drift.affine(self.quantile, self._step_keys[k], borrow=False)
                tail *= factor
            if tail + add <= budget:
                direct = k
        return direct if direct > max(reach, 0) else None

    def _check_ms(self) -> float:
        """The runner's own time between a stage's answer and the next stage's start (its drift update, estimates
        and policy) at the quantile, as timed lately; 0 until enough checks have been timed."""
        return self._checks.quantile(self.quantile) if len(self._checks) >= self.drift.min_observations else 0.0

    def _path_energies(self, batch_size: int) -> list[float]:
        """Per exit, the mean millijoules per inference of one pass through exits 0..k (profiled batch at or above)."""
        found = self._energies.get(batch_size)
        if found is None:
            profiled = self._profiled_batch(batch_size)
            found = self._energies[batch_size] = [1000.0 * self.profile.path_energy_j(k, profiled) for k in range(self._num_steps)]
        return found

    def predict(self, x: Tensor, deadline_ms: float, energy_mj: float | None = None) -> AnytimePrediction:
        """Answer the batch ``x`` within ``deadline_ms`` (measured from this call), always with a prediction; with
        ``energy_mj``, also within that mean energy per inference (a profile measured with ``--energy``)."""
        start = self.clock()
        check_deadline(deadline_ms)
        if energy_mj is not None:
            check_energy_budget(energy_mj)
            self.profile.require_energy()
        if self.model.training:
            raise AnytimeError("the anytime runtime needs the model in eval mode (call model.eval())")
        with torch.inference_mode():
            if not self.incremental:
                return self._predict_chosen(x, deadline_ms, start, energy_mj)
            return self._predict_incremental(x, deadline_ms, start, energy_mj)

    def predict_at(self, x: Tensor, k: int) -> AnytimePrediction:
        """Answer the batch ``x`` at step ``k``, straight there (no earlier exit head runs, no deadline): what the
        runtime pays to answer at a step it was told, e.g. to time the best any choice of step could do in
        hindsight, or to pin a step while debugging. With ``adapt`` the time is observed as a straight jump's."""
        start = self.clock()
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < self._num_steps:
            raise AnytimeError(f"step {k!r} does not exist; this model has steps 0..{self._num_steps - 1}")
        if self.model.training:
            raise AnytimeError("the anytime runtime needs the model in eval mode (call model.eval())")
        with torch.inference_mode():
            if self.incremental:
                estimates = self._stage_estimates(x.shape[0], int(x.shape[1]) if self.length_profiles else None)
                return self._predict_direct(x, k, estimates, math.inf, start, reason="pinned")
            begun = self.clock()
            logits = run_step(self.model, x, k)
            self._sync()
            now = self.clock()
            assert self.scheduler is not None
            option = next((o for o in self.scheduler.options.values() if o.policy is None and o.step == k), None)
            if self.adapt and option is not None:
                self.scheduler.observe(option, now - begun, self._profiled_batch(x.shape[0]))
            exits = torch.full((x.shape[0],), k, dtype=torch.long, device=logits.device)
            return AnytimePrediction(logits.argmax(dim=1), logits, exits, k, "pinned", 1000.0 * (now - start), math.inf)

    def _predict_incremental(self, x: Tensor, deadline_ms: float, start: float, energy_mj: float | None) -> AnytimePrediction:
        estimates = self._stage_estimates(x.shape[0], int(x.shape[1]) if self.length_profiles else None)
        tail, median = estimates.tail, estimates.median
        path_mj = None if energy_mj is None else self._path_energies(x.shape[0])
        last = self._num_steps - 1
        policy = self.policy
        budget = deadline_ms - self.margin_ms
        if self.adapt and len(self._finish) >= self.drift.min_observations:
            budget -= self._finish.quantile(self.quantile)
        direct = None if energy_mj is not None else self._direct_step(estimates, budget - 1000.0 * (self.clock() - start))
        if direct is not None:
            return self._predict_direct(x, direct, estimates, deadline_ms, start)
        batch = x.shape[0]
        decided: Tensor | None = None  # which samples have already left at a confident exit
        exits: Tensor | None = None
        answer: Tensor | None = None
        steps = self.model.steps(x)  # type: ignore[operator]
        answers = None if policy is None or policy.combine is None else policy.answers()
        reason = "last"
        k = -1
        logits = x
        now = before = self.clock()  # the stage's start
        try:
            for k, logits in enumerate(steps):
                self._sync()
                now = self.clock()
                if self.adapt:
                    self.drift.observe(1000.0 * (now - before), median[k], tail[k], k)
                if answers is not None:  # every head runs here, so each exit's combined answer is at hand
                    logits = answers.answer(k, logits)
                if k == last:
                    break
                # The budgets first: where they stop the request, this exit answers whatever the policy says.
                if path_mj is not None and path_mj[k + 1] > energy_mj:  # type: ignore[operator]
                    reason = "energy"
                    break
                following = tail[k + 1]
                if self.adapt:
                    following = self.drift.estimate(following, self.quantile, k + 1) + self._check_ms()
                elapsed = 1000.0 * (self.clock() - start)
                if elapsed + following > budget:
                    reason = "deadline"
                    break
                if policy is not None and batch == 1:
                    if policy.leaves(k, logits):
                        reason = "confident"
                        break
                elif policy is not None:
                    leave = policy.confident(k, logits)
                    if leave is not None:
                        if decided is None:
                            decided = torch.zeros(batch, dtype=torch.bool, device=logits.device)
                            answer = torch.empty_like(logits)
                            exits = torch.full((batch,), last, dtype=torch.long, device=logits.device)
                        new = leave & ~decided
                        if bool(new.any()):
                            answer[new] = logits[new]  # type: ignore[index]
                            exits[new] = k  # type: ignore[index]
                            decided |= new
                        if bool(decided.all()):
                            reason = "confident"
                            break
                before = self.clock()
                if self.adapt:
                    self._checks.add(1000.0 * (before - now))
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                close()
        if k < 0 or (k < last and reason == "last"):
            raise AnytimeError(f"the model's steps() yielded {k + 1} answers but it has {self._num_steps} steps")
        if decided is not None and answer is not None and exits is not None:
            pending = ~decided
            answer[pending] = logits[pending]
            exits[pending] = k
            logits = answer
        else:
            exits = torch.full((batch,), k, dtype=torch.long, device=logits.device)
        predictions = logits.argmax(dim=1)
        end = self.clock()
        if self.adapt:
            self._finish.add(1000.0 * (end - now))
        return AnytimePrediction(predictions, logits, exits, k, reason, 1000.0 * (end - start), float(deadline_ms))

    def _predict_direct(
        self, x: Tensor, k: int, estimates: _Estimates, deadline_ms: float, start: float, reason: str = "direct"
    ) -> AnytimePrediction:
        begun = self.clock()
        logits = run_step(self.model, x, k)  # a combining policy's weights need earlier exits: exit k answers alone
        self._sync()
        end = self.clock()
        if self.adapt:
            self.drift.observe(1000.0 * (end - begun), estimates.step_median[k], estimates.step_tail[k], self._step_keys[k])
        exits = torch.full((x.shape[0],), k, dtype=torch.long, device=logits.device)
        return AnytimePrediction(logits.argmax(dim=1), logits, exits, k, reason, 1000.0 * (end - start), float(deadline_ms))

    def _predict_chosen(self, x: Tensor, deadline_ms: float, start: float, energy_mj: float | None) -> AnytimePrediction:
        assert self.scheduler is not None
        batch = x.shape[0]
        profiled = self._profiled_batch(batch)
        left = deadline_ms - self.margin_ms - 1000.0 * (self.clock() - start)
        choice = self.scheduler.select(max(left, 1e-6), self.quantile, profiled, energy_mj=energy_mj)
        k = choice.step if choice.step is not None else self._num_steps - 1
        begun = self.clock()
        logits = run_step(self.model, x, k)
        self._sync()
        now = self.clock()
        if self.adapt:
            self.scheduler.observe(choice, now - begun, profiled)
        exits = torch.full((batch,), k, dtype=torch.long, device=logits.device)
        return AnytimePrediction(logits.argmax(dim=1), logits, exits, k, "chosen", 1000.0 * (now - start), float(deadline_ms))
