"""One price for an answer: time the anytime runtime itself, from the call to the answer, at every step.

A device profile times the model's steps. An answer costs more: the runtime's choice, its checks between exits,
the policy's score at every exit on the way, the tensors in and out, and thread pools waking after an idle gap.
:func:`price_answers` drives a runner pinned at each step (:meth:`AnytimeRunner.predict_at`), in turns, requests
spaced by random idle gaps as requests arrive at a lightly loaded service, and adds what it paid to the profile
(:attr:`~anytime.profile.store.BatchLatency.answers` and ``answer_paths``). The scheduler and the runtime then price
every option on those figures, so the scheduler's "fits" and the runtime's choice are one number.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor, nn

from anytime.backbones.base import example_input, takes_tokens
from anytime.calibrate import ExitPolicy
from anytime.errors import AnytimeError
from anytime.profile.latency import paused_gc
from anytime.profile.store import DeviceProfile
from anytime.scheduler.runtime import AnytimeRunner
from anytime.utils.timer import Clock, monotonic

#: The mean idle gap (ms) before each priced request: requests that arrive spaced, as at a service that is not
#: saturated, find caches and thread pools colder than requests timed back to back.
DEFAULT_GAP_MS = 5.0


def never_leaving(num_steps: int, criterion: str = "entropy") -> ExitPolicy:
    """A policy that scores every early exit with ``criterion`` and lets nobody leave: what a policy's checks cost,
    for pricing the way through the heads before a run is calibrated."""
    return ExitPolicy(criterion, (-1.0,) * (num_steps - 1))


@dataclass(frozen=True)
class AnswerPricing:
    """How :func:`price_answers` times the answers: ``repeats`` timed repetitions (None: the profile's) after
    ``warmup`` untimed ones, each request after an idle gap drawn from an exponential distribution of mean
    ``gap_ms`` (milliseconds, 0 to 60000; 0: back to back); ``seed`` draws the gaps and the random inputs."""

    repeats: int | None = None
    warmup: int = 5
    gap_ms: float = DEFAULT_GAP_MS
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.gap_ms < 60_000:
            raise AnytimeError(f"the gap between priced requests must be between 0 and 60000 ms (got {self.gap_ms})")


def price_answers(
    model: nn.Module, profile: DeviceProfile, *, pricing: AnswerPricing | None = None,
    policy: ExitPolicy | None = None, clock: Clock = monotonic, sleep: Callable[[float], None] | None = None,
    inputs: Tensor | None = None,
) -> DeviceProfile:  # fmt: skip
    """``profile`` with the runtime's answer prices added at every batch size it measured, timed as ``pricing``
    says (default :class:`AnswerPricing`).

    For each repetition and each step k, in an order that flips every other repetition: an idle gap, then one
    answer at step k chosen up front and, for an incremental model, one through every earlier head with ``policy``
    consulted at each (default: :func:`never_leaving` on entropy; give the run's calibrated policy where there is
    one), each timed by ``clock`` from the call to the answer. ``sleep`` waits out the gaps (tests inject one).
    Inputs are random, as the profile's are, unless ``inputs`` (``[N, *input_shape]``, for a model whose cost
    depends on them) are given.
    """
    pricing = pricing or AnswerPricing()
    repeats, warmup, gap_ms = pricing.repeats, pricing.warmup, pricing.gap_ms
    count = int(profile.settings.get("repeats", 200)) if repeats is None else repeats
    if count < 1 or warmup < 0:
        raise AnytimeError(f"repeats must be at least 1 and warmup at least 0 (got {count}, {warmup})")
    wait = sleep or time.sleep
    incremental = profile.incremental
    if incremental and policy is None:
        policy = never_leaving(profile.num_steps)
    runner = AnytimeRunner(model, profile, policy if incremental else None, quantile=0.5, adapt=False, clock=clock)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    rng = np.random.default_rng(pricing.seed)
    generator = torch.Generator().manual_seed(pricing.seed)
    was_training = model.training
    model.eval()
    latency = {}
    try:
        for b, at in profile.latency.items():
            if inputs is None:
                x = example_input(profile.input_shape, b, tokens=takes_tokens(model), generator=generator).to(device)
            else:
                x = inputs[torch.arange(b) % inputs.shape[0]].to(device)
            ways = (False, True) if incremental else (False,)
            for i in range(warmup):
                _one_round(runner, x, ways, i % 2 == 1, clock, None)
            gaps = rng.exponential(gap_ms / 1000.0, size=(count, profile.num_steps, len(ways))) if gap_ms else None
            timed = np.zeros((len(ways), profile.num_steps, count))
            with paused_gc():
                for i in range(count):
                    pause = None if gaps is None else (lambda k, w, i=i: wait(float(gaps[i, k, w])))
                    for (w, k), ms in _one_round(runner, x, ways, i % 2 == 1, clock, pause).items():
                        timed[w, k, i] = ms
            latency[b] = replace(at, answers=tuple(timed[0]), answer_paths=tuple(timed[1]) if incremental else None)
    finally:
        model.train(was_training)
    settings = {**profile.settings, "answers": {"repeats": count, "warmup": warmup, "gap_ms": gap_ms,
                                               "policy": None if policy is None else policy.criterion}}  # fmt: skip
    return replace(profile, latency=latency, settings=settings)


def _one_round(
    runner: AnytimeRunner, x: Tensor, ways: tuple[bool, ...], flip: bool, clock: Clock,
    pause: Callable[[int, int], None] | None,
) -> dict[tuple[int, int], float]:  # fmt: skip
    """Every step answered once each way (straight there, then through the heads), timed from call to answer."""
    steps = range(runner.profile.num_steps)
    out = {}
    for k in reversed(steps) if flip else steps:
        for w, through in enumerate(ways):
            if pause is not None:
                pause(k, w)
            start = clock()
            runner.predict_at(x, k, through=through)
            out[(w, k)] = 1000.0 * (clock() - start)
    return out
