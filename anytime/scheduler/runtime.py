"""The anytime runtime: answer a request within its deadline, as accurately as the time allows.

The runtime answers as the deadline scheduler prices. At every request the runner runs the calibrated early-exit
policy (over an incremental model) if its price at the runner's quantile fits the time left, as that trade of
accuracy for cost is what its user asked for; else it asks its
:class:`~anytime.scheduler.deadline.DeadlineScheduler` (built on the same profile) for the most accurate option
that fits, a step chosen up front and run alone. A price is what the profile measured the runtime pay for that answer,
from the call to the answer (:func:`anytime.scheduler.pricing.price_answers`), so that "fits" in ``anytime
schedule`` and the runtime's choice are one figure and cannot disagree. Where nothing fits, the cheapest option
answers and the prediction says so (``fits`` is False): a prediction always comes back.

Under a policy the steps run in order and a sample leaves at its first confident exit. Between two exits the runner
goes on unless even a typical (median) continuation to the next exit would answer after the deadline, which
happens only on a device running late: the policy's price already holds the tail of every exit path it takes. With
``adapt`` every answer's measured time feeds the scheduler's drift estimate (:class:`DriftEstimator`), so the
choices follow a device that slows down or stalls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from anytime.calibrate import ExitPolicy
from anytime.contract import is_incremental, run_step, step_count
from anytime.errors import AnytimeError
from anytime.profile.stats import quantile_of
from anytime.profile.store import DeviceProfile
from anytime.scheduler.deadline import DeadlineScheduler, Option, Selection, check_deadline, check_energy_budget
from anytime.scheduler.online import DriftEstimator
from anytime.utils.timer import Clock, monotonic

#: The name of the early-exit policy among a runner's options.
POLICY_OPTION = "policy"


@dataclass(frozen=True)
class AnytimePrediction:
    """One answered request.

    ``exits[i]`` is the step that answered sample i; ``step`` the deepest step that ran. ``reason``:
    ``confident`` (every sample passed its exit's threshold), ``deadline`` (under a policy, even a typical
    continuation to the next exit would have answered late, so this exit answered), ``energy`` (the next exit
    would exceed the energy budget), ``last`` (a policy ran to its last exit), ``chosen`` (a step picked up front
    by the scheduler) or ``pinned`` (the caller named the step: :meth:`AnytimeRunner.predict_at`). ``option`` is
    the scheduler's option that answered, ``promised_ms`` its price at the runner's quantile and ``fits`` whether
    that price fitted the time left (False: nothing fitted, and the cheapest option answered).
    """

    predictions: Tensor
    logits: Tensor
    exits: Tensor
    step: int
    reason: str
    elapsed_ms: float
    deadline_ms: float
    option: str = ""
    promised_ms: float = math.nan
    fits: bool = True

    @property
    def missed(self) -> bool:
        """Whether the answer came after the deadline."""
        return self.elapsed_ms > self.deadline_ms


def runner_options(
    profile: DeviceProfile, step_accuracy: Sequence[float] | None, policy: ExitPolicy | None,
    policy_accuracy: float | None = None, exit_share: Sequence[float] | None = None,
) -> list[Option]:  # fmt: skip
    """A runner's options: every step with its accuracy (default: rising with the step, as ladders gain accuracy
    with cost) and the policy, if any. A policy without its validation figures counts as the most accurate option
    and is priced as if every sample ran to its last exit (an upper bound of its cost)."""
    k = profile.num_steps
    accuracy = list(step_accuracy) if step_accuracy is not None else list(np.linspace(0, 1, k + 2)[1:-1])
    options = [Option(name, float(a), step=i) for i, (name, a) in enumerate(zip(profile.step_names, accuracy))]
    if policy is not None:
        share = tuple(float(v) for v in exit_share) if exit_share is not None else (0.0,) * (k - 1) + (1.0,)
        options.append(Option(POLICY_OPTION, 1.0 if policy_accuracy is None else float(policy_accuracy), policy=policy,
                              exit_share=share))  # fmt: skip
    return options


class AnytimeRunner:
    """Runs an anytime model against deadlines with a device profile and (optionally) an early-exit policy.

    ``quantile`` is the latency quantile an option's price must fit at. The options are every step, with
    ``step_accuracy`` (validation accuracy per step), and the ``policy`` with ``policy_accuracy`` and its validation
    ``exit_share`` (:func:`runner_options`); or ``scheduler``'s options where one is given. With ``adapt`` every
    answer's time is told to the scheduler, whose drift estimate then prices the options. ``margin_ms`` is kept free
    at the end of every deadline. The runner checks the profile's step count against the model; that the profile
    was measured on these weights is checked where both are loaded (``runner_for_run``). ``clock`` (seconds,
    monotonic; default :func:`anytime.utils.timer.monotonic`) is what every deadline is measured with: tests inject
    a fake one. ``length_profiles`` (a text model's profiles by sentence length in tokens) price each request by
    the shortest profiled length that holds it (``x.shape[1]``), its length bucket; ``profile`` is then the longest.
    """

    def __init__(
        self, model: nn.Module, profile: DeviceProfile, policy: ExitPolicy | None = None, *, quantile: float = 0.99,
        adapt: bool = True, margin_ms: float = 0.0, window: int = 200, min_observations: int = 20,
        scheduler: DeadlineScheduler | None = None, step_accuracy: Sequence[float] | None = None,
        policy_accuracy: float | None = None, exit_share: Sequence[float] | None = None,
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
            raise AnytimeError(
                "the model runs its steps incrementally but the profile has no stage latencies; profile it again"
            )
        self.policy = policy
        if policy is not None:
            if not self.incremental:
                raise AnytimeError(
                    "an early-exit policy needs an incremental model (one whose steps reuse each other's work)"
                )
            if policy.num_steps != num_steps:
                raise AnytimeError(f"the policy is for {policy.num_steps} exits but the model has {num_steps}")
        self._num_steps = num_steps
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._sync = (lambda: torch.cuda.synchronize(self._device)) if self._device.type == "cuda" else (lambda: None)
        if scheduler is None:
            options = runner_options(profile, step_accuracy, policy, policy_accuracy, exit_share)
            # A price never comes below the profile's tail by a tail learned from a few hundred answers: on the
            # fast CIFAR-10 card that come-down promised exit 0 at 1.0-1.7 ms where its priced p99 was 3.2 ms,
            # and 1.2-1.9% of those answers were late.
            kwargs = {"adapt": adapt, "window": window, "min_observations": min_observations,
                      "tracked_quantile": self.quantile, "come_down": False}  # fmt: skip
            scheduler = DeadlineScheduler(profile, options, **kwargs)  # type: ignore[arg-type]
            self._buckets = {t: DeadlineScheduler(p, options, **kwargs) for t, p in self.length_profiles.items()}  # type: ignore[arg-type]
        else:
            self._buckets = {}
        self.scheduler = scheduler
        self._policy_option = next((o for o in scheduler.options.values() if o.policy is not None), None)
        self._onward: dict[tuple[int, int | None], list[float]] = {}
        self._energies: dict[int, list[float]] = {}

    @property
    def drift(self) -> DriftEstimator:
        """The drift estimate the runner's choices are priced with (its scheduler's; the longest length's)."""
        return self.scheduler.drift

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

    def _scheduler_for(self, x: Tensor) -> tuple[DeadlineScheduler, int | None]:
        bucket = self.bucket_of(int(x.shape[1])) if self.length_profiles else None
        return (self.scheduler if bucket is None else self._buckets[bucket]), bucket

    def select(self, x: Tensor, left_ms: float, energy_mj: float | None = None) -> Selection:
        """What :meth:`predict` runs for the batch ``x`` with ``left_ms`` of its deadline left: the policy where its
        price fits (it is the trade of accuracy for cost that was asked for), else the scheduler's choice, the most
        accurate option that fits."""
        scheduler, _ = self._scheduler_for(x)
        left, batch = max(left_ms, 1e-6), self._profiled_batch(x.shape[0])
        if self._policy_option is not None:
            quote = scheduler.quote(self._policy_option, left, self.quantile, batch, energy_mj=energy_mj)
            if quote.fits:
                return quote
        return scheduler.select(left, self.quantile, batch, energy_mj=energy_mj)

    def _onward_ms(self, batch_size: int, bucket: int | None) -> list[float]:
        """Per exit k, the typical (median) time from exit k's answer to exit k+1's on the way through the heads."""
        key = (batch_size, bucket)
        found = self._onward.get(key)
        if found is None:
            profile = self.profile if bucket is None else self.length_profiles[bucket]
            medians = [quantile_of(profile.answer_path_samples(k, batch_size), 0.5) for k in range(self._num_steps)]
            found = self._onward[key] = [max(b - a, 0.0) for a, b in zip(medians, medians[1:])]
        return found

    def _path_energies(self, batch_size: int) -> list[float]:
        """Per exit, the mean millijoules per inference of one pass through exits 0..k (profiled batch at or above)."""
        found = self._energies.get(batch_size)
        if found is None:
            profiled = self._profiled_batch(batch_size)
            found = self._energies[batch_size] = [
                1000.0 * self.profile.path_energy_j(k, profiled) for k in range(self._num_steps)
            ]
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
        budget = deadline_ms - self.margin_ms
        choice = self.select(x, budget - 1000.0 * (self.clock() - start), energy_mj)
        with torch.inference_mode():
            if choice.step is not None:
                out = self._run_step(x, choice.step, start, float(deadline_ms), "chosen")
            else:
                out = self._run_policy(x, budget, start, float(deadline_ms), energy_mj=energy_mj)
        if self.adapt:
            self._observe(x, choice, out)
        return AnytimePrediction(out.predictions, out.logits, out.exits, out.step, out.reason, out.elapsed_ms,
                                 out.deadline_ms, choice.option, choice.latency_ms, choice.fits)  # fmt: skip

    def _observe(self, x: Tensor, choice: Selection, out: AnytimePrediction) -> None:
        scheduler, _ = self._scheduler_for(x)
        step = None if choice.step is not None else out.step
        scheduler.observe(choice.option, out.elapsed_ms / 1000.0, choice.batch_size, step=step)

    def predict_at(self, x: Tensor, k: int, *, through: bool = False) -> AnytimePrediction:
        """Answer the batch ``x`` at step ``k`` (no deadline): straight there, as a step chosen up front runs, or
        with ``through`` (an incremental model) through every earlier exit head, the policy consulted at each but
        nobody leaving, as a policy's request that answers at exit k runs. What the runtime pays to answer at a
        step it was told: the profile's answer prices are timed this way. With ``adapt`` a straight answer's time
        is observed as its step option's."""
        start = self.clock()
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < self._num_steps:
            raise AnytimeError(f"step {k!r} does not exist; this model has steps 0..{self._num_steps - 1}")
        if through and not self.incremental:
            raise AnytimeError("only an incremental model answers through its exit heads")
        if self.model.training:
            raise AnytimeError("the anytime runtime needs the model in eval mode (call model.eval())")
        with torch.inference_mode():
            if through:
                return self._run_policy(x, math.inf, start, math.inf, stop_at=k)
            out = self._run_step(x, k, start, math.inf, "pinned")
        if self.adapt:
            scheduler, _ = self._scheduler_for(x)
            option = next((o for o in scheduler.options.values() if o.policy is None and o.step == k), None)
            if option is not None:
                scheduler.observe(option, out.elapsed_ms / 1000.0, self._profiled_batch(x.shape[0]))
        return out

    def _run_step(self, x: Tensor, k: int, start: float, deadline_ms: float, reason: str) -> AnytimePrediction:
        logits = run_step(self.model, x, k)  # a combining policy's weights need earlier exits: step k answers alone
        self._sync()
        exits = torch.full((x.shape[0],), k, dtype=torch.long, device=logits.device)
        predictions = logits.argmax(dim=1)
        end = self.clock()
        return AnytimePrediction(predictions, logits, exits, k, reason, 1000.0 * (end - start), deadline_ms)

    def _run_policy(
        self, x: Tensor, budget: float, start: float, deadline_ms: float, *, energy_mj: float | None = None,
        stop_at: int | None = None,
    ) -> AnytimePrediction:  # fmt: skip
        """Through the exits in order: a sample leaves at its first confident exit (none leaves before
        ``stop_at``, which answers when given), the request stops where even a typical continuation would miss
        ``budget`` (ms from ``start``) or the next exit would exceed ``energy_mj``."""
        batch = x.shape[0]
        _, bucket = self._scheduler_for(x)
        onward = self._onward_ms(self._profiled_batch(batch), bucket)
        level = self.drift.level() if self.adapt else 1.0
        path_mj = None if energy_mj is None else self._path_energies(batch)
        last = self._num_steps - 1 if stop_at is None else stop_at
        policy = self.policy
        decided: Tensor | None = None  # which samples have already left at a confident exit
        exits: Tensor | None = None
        answer: Tensor | None = None
        steps = self.model.steps(x)  # type: ignore[operator]
        answers = None if policy is None or policy.combine is None else policy.answers()
        decisions = None if policy is None else policy.decisions()
        reason = "last" if stop_at is None else "pinned"
        k = -1
        logits = x
        try:
            for k, logits in enumerate(steps):
                self._sync()
                if answers is not None:  # every head runs here, so each exit's combined answer is at hand
                    logits = answers.answer(k, logits)
                if k == last:
                    break
                if stop_at is None:
                    # The budgets first: where they stop the request, this exit answers whatever the policy says.
                    if path_mj is not None and path_mj[k + 1] > energy_mj:  # type: ignore[operator]
                        reason = "energy"
                        break
                    if 1000.0 * (self.clock() - start) + level * onward[k] > budget:
                        reason = "deadline"
                        break
                if decisions is not None and batch == 1:
                    if decisions.leaves(k, logits) and stop_at is None:
                        reason = "confident"
                        break
                elif decisions is not None:
                    leave = decisions.confident(k, logits)
                    if leave is not None and stop_at is None:
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
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                close()
        if k < 0 or (k < last and reason in ("last", "pinned")):
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
        return AnytimePrediction(predictions, logits, exits, k, reason, 1000.0 * (end - start), deadline_ms)
