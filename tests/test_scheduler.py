"""Device profiles, the deadline scheduler and the anytime runtime.

The frontier and selection are checked on hand-made profiles whose latencies are known exactly; the
runtime on a model whose stages take set times of a fake clock, so what it must do at each deadline is known.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from anytime import AnytimeRunner, DeadlineScheduler
from anytime.calibrate import ExitPolicy
from anytime.cli import main
from anytime.errors import AnytimeError
from anytime.profile import BatchLatency, DeviceProfile, Instruments, StepTiming, profile_model, quantile_of
from anytime.scheduler import DriftEstimator, Option
from anytime.scheduler.pricing import AnswerPricing, price_answers


def make_profile(step_ms: list[float], *, stage_ms: list[float] | None = None, n: int = 100, spread: float = 0.0,
                 batch_sizes: tuple[int, ...] = (1,), fingerprint: str = "abc") -> DeviceProfile:  # fmt: skip
    """Step k's samples are step_ms[k] * (1 + spread * i / (n - 1)), i = 0..n-1: its p99 is known exactly."""
    ramp = 1 + spread * np.arange(n) / (n - 1)
    latency = {}
    for b in batch_sizes:
        steps = tuple(b * v * ramp for v in step_ms)
        stages = None if stage_ms is None else tuple(b * v * ramp for v in stage_ms)
        latency[b] = BatchLatency(b, steps, stages)
    k = len(step_ms)
    return DeviceProfile(
        model_fingerprint=fingerprint, model="toy", input_shape=(4,), incremental=stage_ms is not None,
        step_names=tuple(f"exit{i}" for i in range(k)), step_flops=tuple(range(1, k + 1)), step_params=(1,) * k,
        model_bytes=4, latency=latency, device={"type": "cpu", "label": "test cpu"}, settings={"repeats": n},
        created="now",
    )  # fmt: skip


# ---------------------------------------------------------------- frontier and selection


def test_select_is_right_at_every_boundary():
    profile = make_profile([1.0, 2.0, 4.0])
    scheduler = DeadlineScheduler.from_accuracies(profile, [0.6, 0.7, 0.9])
    for deadline, expected in [(0.999, None), (1.0, "exit0"), (1.999, "exit0"), (2.0, "exit1"), (3.9, "exit1"),
                               (4.0, "exit2"), (1e6, "exit2"), (math.inf, "exit2")]:  # fmt: skip
        choice = scheduler.select(deadline)
        if expected is None:
            assert not choice.fits and choice.option == "exit0" and "likely miss" in choice.note
        else:
            assert choice.fits and choice.option == expected, (deadline, choice)
            assert choice.latency_ms <= deadline and choice.note is None


def test_the_frontier_drops_dominated_options_and_breaks_ties():
    profile = make_profile([1.0, 2.0, 2.0, 3.0, 5.0])
    # exit1 and exit2 tie on latency (the more accurate stays); exit3 is no better than exit2; exit4 is.
    scheduler = DeadlineScheduler.from_accuracies(profile, [0.5, 0.6, 0.7, 0.7, 0.8])
    assert [o.name for o, _ in scheduler.frontier()] == ["exit0", "exit2", "exit4"]
    assert scheduler.select(4.0).option == "exit2"
    # Equal accuracy at different costs: the cheaper one.
    same = DeadlineScheduler.from_accuracies(make_profile([1.0, 2.0]), [0.8, 0.8])
    assert [o.name for o, _ in same.frontier()] == ["exit0"]


def test_the_quantile_decides_what_fits():
    profile = make_profile([1.0, 2.0], spread=1.0)  # step k spans [t, 2t]; p99 = 1.99 t, p50 = 1.5 t
    scheduler = DeadlineScheduler.from_accuracies(profile, [0.6, 0.9])
    assert scheduler.latency("exit1", 0.5) == pytest.approx(2 * (1 + 49 / 99))
    assert scheduler.select(3.5, quantile=0.99).option == "exit0"
    assert scheduler.select(3.5, quantile=0.5).option == "exit1"


def test_batch_size_selects_its_own_latencies():
    profile = make_profile([1.0, 2.0], batch_sizes=(1, 8))  # batch 8 is 8 times slower
    scheduler = DeadlineScheduler.from_accuracies(profile, [0.6, 0.9])
    assert scheduler.select(3.0, batch_size=1).option == "exit1"
    assert scheduler.select(10.0, batch_size=8).option == "exit0"
    assert not scheduler.select(3.0, batch_size=8).fits


def test_observing_a_policy_needs_the_exit_it_reached():
    profile = make_profile([1.0, 2.0], stage_ms=[1.0, 1.0])
    option = Option("early-exit", 0.85, policy=ExitPolicy("confidence", (0.9,)), exit_share=(0.5, 0.5))
    scheduler = DeadlineScheduler.from_accuracies(profile, [0.6, 0.9], [option], min_observations=1)
    with pytest.raises(AnytimeError, match="step="):
        scheduler.observe("early-exit", 1e-3)
    for _ in range(2):
        scheduler.observe("early-exit", 2e-3, step=1)  # as profiled: reaching exit 1 takes 2 ms
    assert scheduler.drift.ready and scheduler.drift.level() == pytest.approx(1.0)
    with pytest.raises(AnytimeError, match="no option named"):
        scheduler.observe("nope", 1e-3)


def test_a_policy_costs_the_mixture_of_its_exit_paths():
    profile = make_profile(
        [1.0, 2.0, 3.0], stage_ms=[1.0, 1.0, 1.0], batch_sizes=(1, 2)
    )  # paths: 1, 2, 3 ms (x2 at batch 2)
    policy = ExitPolicy("confidence", (0.9, 0.9))
    option = Option("early-exit", 0.85, policy=policy, exit_share=(0.6, 0.3, 0.1))
    scheduler = DeadlineScheduler.from_accuracies(profile, [0.6, 0.8, 0.9], [option])
    assert scheduler.latency("early-exit", 0.5) == pytest.approx(1.0)
    assert scheduler.latency("early-exit", 0.85) == pytest.approx(2.0)
    assert scheduler.latency("early-exit", 0.95) == pytest.approx(3.0)
    # A batch of 2 runs until its deeper sample leaves: P(both leave at exit 0) = 0.36, P(both by exit 1) = 0.81.
    assert scheduler.latency("early-exit", 0.3, batch_size=2) == pytest.approx(2.0)
    assert scheduler.latency("early-exit", 0.4, batch_size=2) == pytest.approx(4.0)
    assert scheduler.latency("early-exit", 0.85, batch_size=2) == pytest.approx(6.0)
    at_median = scheduler.select(2.5, quantile=0.85)
    assert at_median.option == "early-exit" and at_median.kind == "policy"


def test_bad_queries_are_refused():
    profile = make_profile([1.0, 2.0])
    scheduler = DeadlineScheduler.from_accuracies(profile, [0.6, 0.9])
    for deadline in (float("nan"), 0.0, -1.0, "5", True, None):
        with pytest.raises(AnytimeError, match="deadline"):
            scheduler.select(deadline)  # type: ignore[arg-type]
    for q in (0.0, 1.0, float("nan"), 1.5):
        with pytest.raises(AnytimeError, match="quantile"):
            scheduler.select(5.0, quantile=q)
    with pytest.raises(AnytimeError, match="needs at least 1000 samples"):
        scheduler.select(5.0, quantile=0.999)
    with pytest.raises(AnytimeError, match="no batch size 4"):
        scheduler.select(5.0, batch_size=4)
    with pytest.raises(AnytimeError, match="step accuracies"):
        DeadlineScheduler.from_accuracies(profile, [0.6])
    with pytest.raises(AnytimeError, match="incremental"):
        DeadlineScheduler(profile, [Option("p", 0.5, policy=ExitPolicy("entropy", (0.1,)), exit_share=(0.5, 0.5))])


# ---------------------------------------------------------------- online adaptation


def test_drift_follows_a_slower_and_then_a_faster_device():
    profile = make_profile([1.0, 2.0, 4.0], spread=0.1)
    scheduler = DeadlineScheduler.from_accuracies(profile, [0.6, 0.7, 0.9], window=50, min_observations=10)
    assert scheduler.select(4.5).option == "exit2"
    for _ in range(50):  # the device is 3x slower now
        scheduler.observe("exit0", 3 * 1.05e-3)
    slow = scheduler.select(4.5)
    # Every measured latency is 3.15 ms: a uniform slow-down by 3.15 over exit0's profiled median (1 + 0.1 * 49 / 99
    # ms). None of them reaches the profiled p99 scaled by it, so the p99 comes down to the measured one: 3.15 ms
    # over exit0's profiled p99 of 1 + 0.1 * 98 / 99 ms.
    assert slow.drift == pytest.approx(3.15 / (1 + 0.1 * 98 / 99), rel=1e-9) and slow.option == "exit0"
    static = DeadlineScheduler.from_accuracies(profile, [0.6, 0.7, 0.9], adapt=False)
    static.observe("exit0", 3e-3)
    assert static.select(4.5).option == "exit2"
    for _ in range(50):  # and back to its profiled speed: the window forgets the slow spell
        scheduler.observe("exit1", 2 * 1.05e-3)
    assert scheduler.select(4.5).option == "exit2"


def test_stalls_add_time_rather_than_scale_it():
    drift = DriftEstimator(window=100, min_observations=10)
    assert drift.estimate(1.2, 0.99) == 1.2  # nothing seen yet: the profile as measured
    for i in range(110):  # profiled: median 1 ms, p99 1.2 ms; 5% of the answers now stall to 5 ms
        drift.observe(5.0 if i % 20 == 0 else 1.0, 1.0, 1.2)
    assert drift.level() == pytest.approx(1.0)
    # The median is as profiled; the p99 now carries 3.8 ms beyond the profiled p99, for short and long alike.
    assert drift.estimate(1.2, 0.99) == pytest.approx(5.0)
    assert drift.estimate(12.0, 0.99) == pytest.approx(15.8)
    assert drift.estimate(1.1, 0.5) == pytest.approx(1.1)
    drift.observe(float("nan"), 1.0, 1.2)
    assert drift.observations == 100
    drift.reset()
    assert drift.estimate(1.2, 0.99) == 1.2 and not drift.ready


def test_a_rise_only_estimate_never_prices_below_the_profile_when_the_median_runs_fast():
    free = DriftEstimator(window=100, min_observations=10)
    rising = DriftEstimator(window=100, min_observations=10, rise_only=True)
    for _ in range(110):  # profiled: median 1 ms, p99 1.2 ms; now every answer takes 0.8 ms
        for d in (free, rising):
            d.observe(0.8, 1.0, 1.2)
    assert free.estimate(1.2, 0.99) == pytest.approx(0.96)  # the tail scaled down with the median
    assert rising.estimate(1.2, 0.99) == pytest.approx(1.2)  # the runtime's promise: never below the profile
    for _ in range(100):  # a slower device still raises it
        rising.observe(1.5, 1.0, 1.2)
    assert rising.estimate(1.2, 0.99) >= 1.8  # the level, 1.5, and the excess its rise left in the window


def test_a_pessimistic_profile_tail_comes_down_at_the_tracked_quantile_only():
    drift = DriftEstimator(window=100, min_observations=10, tracked_quantile=0.99)
    untracked = DriftEstimator(window=100, min_observations=10)
    for i in range(110):  # profiled: median 1 ms, p99 2 ms (a burst during profiling); now never above 1.5 ms
        for d in (drift, untracked):
            d.observe(1.0 + 0.5 * (i % 10 == 0), 1.0, 2.0)
    assert drift.level() == pytest.approx(1.0)
    assert drift.estimate(2.0, 0.99) == pytest.approx(1.5)  # the measured tail, 0.75 of the profiled one
    assert drift.estimate(4.0, 0.99) == pytest.approx(3.0)  # scaled: a burst inflates a tail with its work
    assert drift.estimate(1.0, 0.5) == pytest.approx(1.0)  # another quantile is left as profiled
    assert untracked.estimate(2.0, 0.99) == pytest.approx(2.0)  # without the tracked quantile, never below
    factor, add = drift.affine(0.99)  # one reading of the windows gives every latency's estimate
    assert (factor, add) == pytest.approx((0.75, 0.0)) and factor * 4.0 + add == drift.estimate(4.0, 0.99)
    for _ in range(10):  # then a stall: the excess turns positive and adds, as before
        drift.observe(6.0, 1.0, 2.0)
    assert drift.estimate(2.0, 0.99) == pytest.approx(6.0)
    assert drift.affine(0.99) == pytest.approx((1.0, 4.0))
    with pytest.raises(AnytimeError, match="between 0 and 1"):
        DriftEstimator(tracked_quantile=1.0)


def test_a_tail_comes_down_only_by_what_was_measured_of_it():
    drift = DriftEstimator(window=100, min_observations=10, tracked_quantile=0.99)
    for i in range(110):  # stage 0: profiled median 1 ms, p99 2 ms; now never above 1.5 ms
        drift.observe(1.0 + 0.5 * (i % 10 == 0), 1.0, 2.0, key=0)
    assert drift.estimate(2.0, 0.99, 0) == pytest.approx(1.5)
    assert drift.estimate(2.0, 0.99) == pytest.approx(1.5)  # no key: everything measured, pooled
    assert drift.estimate(4.0, 0.99, "exit2") == pytest.approx(3.0)  # never measured: borrows the pooled tail
    assert drift.estimate(4.0, 0.99, "exit2", borrow=False) == pytest.approx(4.0)  # or keeps its profiled one
    for _ in range(9):  # exit 2's own tail, 0.95 of its profiled one, but not yet enough of it to go by
        drift.observe(3.8, 2.0, 4.0, key="exit2")
    assert drift.estimate(4.0, 0.99, "exit2", borrow=False) == pytest.approx(4.0)
    drift.observe(3.8, 2.0, 4.0, key="exit2")
    assert drift.estimate(4.0, 0.99, "exit2", borrow=False) == pytest.approx(3.8)
    assert drift.estimate(4.0, 0.99, "exit2") == pytest.approx(3.8)
    assert drift.estimate(2.0, 0.99, 0) == pytest.approx(1.5)
    drift.reset()
    for _ in range(30):
        drift.observe(1.0, 1.0, 2.0)
    assert drift.estimate(4.0, 0.99, "exit2", borrow=False) == pytest.approx(4.0)  # reset forgets every key's window


def test_a_stall_among_a_few_timings_of_one_key_does_not_raise_its_tail():
    drift = DriftEstimator(window=100, min_observations=10, tracked_quantile=0.99)
    for i in range(110):  # stage 0: profiled median 1 ms, p99 2 ms; now never above 1.5 ms
        drift.observe(1.0 + 0.5 * (i % 10 == 0), 1.0, 2.0, key=0)
    for i in range(20):  # stage 1, profiled the same, runs at its median but for one stall of 5 ms
        drift.observe(6.0 if i == 5 else 1.0, 1.0, 2.0, key=1)
    assert drift.affine(0.99)[1] == 0.0  # pooled, fewer than 1% of the timings overran their scaled tails
    # Stage 1's own 99th percentile ratio is the stall's, 3: its tail stays the profile's, not three times it.
    assert drift.estimate(2.0, 0.99, 1) == pytest.approx(2.0)
    assert drift.estimate(2.0, 0.99, 0) == pytest.approx(1.5)  # and still comes down where it was measured to


# ---------------------------------------------------------------- profile files


def test_profile_round_trip_and_refusals(tmp_path):
    profile = make_profile([1.0, 2.0], stage_ms=[1.0, 1.0], batch_sizes=(1, 8), spread=0.5)
    path = profile.save(tmp_path / "p.json")
    loaded = DeviceProfile.load(path, fingerprint="abc", num_steps=2)
    assert loaded.batch_sizes == (1, 8) and loaded.incremental
    for k in range(2):
        assert loaded.step_quantile(k, 0.99, 8) == pytest.approx(profile.step_quantile(k, 0.99, 8), abs=1e-5)
        assert loaded.stage_quantile(k, 0.5, 1) == pytest.approx(profile.stage_quantile(k, 0.5, 1), abs=1e-5)
    with pytest.raises(AnytimeError, match="another model"):
        DeviceProfile.load(path, fingerprint="other")
    with pytest.raises(AnytimeError, match="has 2 steps"):
        DeviceProfile.load(path, num_steps=3)
    doc = json.loads(path.read_text())
    doc["batches"][0]["steps"][0]["samples_ms"][3] = float("nan")
    (tmp_path / "nan.json").write_text(json.dumps(doc))
    with pytest.raises(AnytimeError, match="NaN"):
        DeviceProfile.load(tmp_path / "nan.json")
    doc = json.loads(path.read_text())
    del doc["batches"][1]["stages"]
    (tmp_path / "ragged.json").write_text(json.dumps(doc))
    with pytest.raises(AnytimeError, match="malformed"):
        DeviceProfile.load(tmp_path / "ragged.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(AnytimeError, match="not valid JSON"):
        DeviceProfile.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(AnytimeError, match="not an anytime profile"):
        DeviceProfile.load(tmp_path / "other.json")
    with pytest.raises(AnytimeError, match="no profile at"):
        DeviceProfile.load(tmp_path / "missing.json")


def test_quantile_never_interpolates_below_an_observation():
    samples = np.arange(1, 101, dtype=float)
    assert quantile_of(samples, 0.99) == 99.0
    assert quantile_of(samples, 0.5) == 50.0
    assert quantile_of(np.array([1.0, 10.0]), 0.5, weights=np.array([0.25, 0.75])) == 10.0


# ---------------------------------------------------------------- the runtime on a model with injected delays


class FakeClock:
    """Seconds that pass only when a model says so: the runtime and the profiler read it instead of the machine's."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1000


class TimedLadder(nn.Module):
    """An incremental model whose stage k takes ``delays_ms[k]`` (scaled by ``slowdown``) of its fake clock. Its
    exits are confident (one-hot logits) when the input's first feature is positive, uniform otherwise."""

    incremental = True

    def __init__(self, delays_ms: list[float], num_classes: int = 4) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.delays_ms = delays_ms
        self.slowdown = 1.0
        self.finish_ms = 0.0  # taken when the runtime closes the steps: its bookkeeping after the last stage
        self.num_classes = num_classes
        self.scale = nn.Parameter(torch.ones(1))

    @property
    def num_steps(self) -> int:
        return len(self.delays_ms)

    def _logits(self, x: Tensor, k: int) -> Tensor:
        confident = (x[:, 0] > 0).float().unsqueeze(1)
        one_hot = torch.nn.functional.one_hot(torch.full((x.shape[0],), k % self.num_classes), self.num_classes)
        return 20 * confident * one_hot.float() * self.scale

    def steps(self, x: Tensor) -> Iterator[Tensor]:
        try:
            for k, delay in enumerate(self.delays_ms):
                self.clock.advance(delay * self.slowdown)
                yield self._logits(x, k)
        finally:
            self.clock.advance(self.finish_ms)

    def forward_until(self, x: Tensor, k: int) -> Tensor:
        self.clock.advance(sum(self.delays_ms[: k + 1]) * self.slowdown)
        return self._logits(x, k)

    def forward_all(self, x: Tensor) -> Tensor:
        return torch.stack(list(self.steps(x)))

    forward = forward_all


@pytest.fixture(scope="module")
def sleepy() -> tuple[TimedLadder, DeviceProfile]:
    model = TimedLadder([4.0, 8.0, 16.0]).eval()
    profile = profile_model(
        model, (3,), StepTiming(batch_sizes=(1, 2), repeats=20, warmup=1), instruments=Instruments(clock=model.clock)
    )
    return model, profile


def test_the_profile_sees_the_injected_delays(sleepy):
    _, profile = sleepy
    assert profile.incremental and profile.num_steps == 3
    for k, expected in enumerate([4.0, 12.0, 28.0]):
        assert profile.step_quantile(k, 0.5) == pytest.approx(expected)
    for k, expected in enumerate([4.0, 8.0, 16.0]):
        assert profile.stage_quantile(k, 0.5) == pytest.approx(expected)


def slowed_checks(policy: ExitPolicy, clock: FakeClock, ms: float) -> ExitPolicy:
    """``policy`` whose every decision at an exit takes ``ms`` of ``clock``: the runner's own time between two
    stages, which a profile of the bare model never sees."""
    decide = policy.leaves

    def slow_leaves(k: int, logits: Tensor) -> bool:
        clock.advance(ms)
        return decide(k, logits)

    object.__setattr__(policy, "leaves", slow_leaves)
    return policy


def test_the_runtime_runs_the_option_the_scheduler_selects(sleepy):
    model, profile = sleepy
    runner = AnytimeRunner(model, profile, adapt=False, quantile=0.9, clock=model.clock)
    unsure = -torch.ones(1, 3)
    for deadline in (4.01, 5.0, 11.9, 12.01, 27.9, 28.01, 100.0):
        choice = runner.scheduler.select(deadline, 0.9)
        out = runner.predict(unsure, deadline)
        assert (out.option, out.step, out.reason, out.fits) == (choice.option, choice.step, "chosen", True)
        assert out.promised_ms == pytest.approx(choice.latency_ms) and not out.missed
    assert [runner.predict(unsure, d).step for d in (4.01, 12.01, 28.01)] == [0, 1, 2]


def test_nothing_fits_is_said_and_the_cheapest_step_answers(sleepy):
    model, profile = sleepy
    runner = AnytimeRunner(model, profile, adapt=False, quantile=0.9, clock=model.clock)
    out = runner.predict(-torch.ones(1, 3), 0.5)
    assert (out.step, out.fits, out.missed, out.option) == (0, False, True, "step0")
    assert out.predictions.shape == (1,)  # a prediction always comes back


def test_pricing_times_what_the_runtime_pays():
    model = HeadedLadder([4.0, 8.0, 16.0], head_ms=2.0).eval()
    bare = profile_model(
        model, (3,), StepTiming(batch_sizes=(1, 2), repeats=20, warmup=1), instruments=Instruments(clock=model.clock)
    )
    waited: list[float] = []
    policy = slowed_checks(ExitPolicy("confidence", (0.9, 0.9)), model.clock, 1.0)
    priced = price_answers(
        model, bare, pricing=AnswerPricing(gap_ms=5.0, warmup=1), policy=policy, clock=model.clock, sleep=waited.append
    )
    assert priced.priced and not bare.priced
    for b in (1, 2):
        # Straight there: the stages and exit k's own head. Through the heads: every check (1 ms) and earlier head.
        check = 1.0 if b == 1 else 0.0  # a batch's decisions go through ExitPolicy.confident, which is not slowed
        through_heads = [4.0, 4 + check + 2 + 8, 4 + 2 * (check + 2) + 8 + 16]
        for k, (alone, through) in enumerate(zip([6.0, 14.0, 28.0], through_heads)):
            assert priced.answer_samples(k, b) == pytest.approx(np.full(20, alone))
            assert priced.answer_path_samples(k, b) == pytest.approx(np.full(20, through))
        assert bare.answer_path_samples(2, b) == pytest.approx(np.full(20, 32.0))  # unpriced: the stages summed
    assert len(waited) == 2 * 20 * 3 * 2 and 2.5 < 1000 * float(np.mean(waited)) < 10  # one gap before each answer
    assert priced.settings["answers"] == {"repeats": 20, "warmup": 1, "gap_ms": 5.0, "policy": "confidence"}
    again = DeviceProfile.from_dict(json.loads(json.dumps(priced.to_dict())))
    assert again.answer_path_samples(2, 2) == pytest.approx(priced.answer_path_samples(2, 2))
    back_to_back: list[float] = []
    price_answers(
        model, bare, pricing=AnswerPricing(gap_ms=0.0, warmup=0), clock=model.clock, sleep=back_to_back.append
    )
    assert back_to_back == []


def test_the_runtime_and_the_scheduler_read_the_same_price():
    # The policy's checks take 1 ms each: a bare profile prices the whole way through the heads at 28 ms, the
    # runtime pays 30. Priced on what the runtime pays, the scheduler's choice and the runtime's are one, and
    # nothing it says fits is late.
    model = TimedLadder([4.0, 8.0, 16.0]).eval()
    bare = profile_model(
        model, (3,), StepTiming(batch_sizes=(1,), repeats=20, warmup=1), instruments=Instruments(clock=model.clock)
    )
    policy = slowed_checks(ExitPolicy("confidence", (0.9, 0.9)), model.clock, 1.0)
    priced = price_answers(
        model, bare, pricing=AnswerPricing(warmup=0), policy=policy, clock=model.clock, sleep=lambda s: None
    )
    unsure = -torch.ones(1, 3)
    naive = AnytimeRunner(model, bare, policy, adapt=False, quantile=0.9, clock=model.clock)
    out = naive.predict(unsure, 29.0)
    assert (out.option, out.fits, out.missed, out.elapsed_ms) == ("policy", True, True, pytest.approx(30.0))
    runner = AnytimeRunner(model, priced, policy, adapt=False, quantile=0.9, clock=model.clock)
    scheduler = DeadlineScheduler(priced, list(runner.scheduler.options.values()))
    for deadline in np.linspace(3.0, 40.0, 38):
        choice = scheduler.select(float(deadline), 0.9)
        out = runner.predict(unsure, float(deadline))
        assert (out.option, out.fits, out.promised_ms) == (choice.option, choice.fits, pytest.approx(choice.latency_ms))
        assert not (out.fits and out.missed), deadline
    out = runner.predict(unsure, 29.0)  # the policy does not fit: exit 2 alone (28 ms) does
    assert (out.option, out.step, out.missed) == ("step2", 2, False)


def test_the_runtime_leaves_early_on_confident_inputs(sleepy):
    model, profile = sleepy
    policy = ExitPolicy("confidence", (0.9, 0.9))
    runner = AnytimeRunner(model, profile, policy, adapt=False, quantile=0.9, clock=model.clock)
    sure = torch.ones(1, 3)
    out = runner.predict(sure, 1000.0)
    assert out.step == 0 and out.reason == "confident" and out.elapsed_ms == pytest.approx(4.0)  # not the whole 28 ms
    batch = torch.tensor([[1.0, 0, 0], [-1.0, 0, 0]])
    out = runner.predict(batch, 1000.0)  # one sample leaves at exit 0, the other runs to the end
    assert out.exits.tolist() == [0, 2] and out.predictions[0] == 0 and out.reason == "last"


def test_a_policy_request_stops_where_a_typical_continuation_would_miss(sleepy):
    model, profile = sleepy
    # Nineteen validation samples in twenty leave at exit 0: the policy's p90 is exit 0's 4 ms, so it fits a
    # 10 ms deadline and, as the most accurate option, is chosen; an unsure request then stops before a stage
    # that would answer late.
    runner = AnytimeRunner(model, profile, ExitPolicy("confidence", (0.9, 0.9)), adapt=False, quantile=0.9,
                           policy_accuracy=0.9, exit_share=(0.95, 0.05, 0.0), step_accuracy=(0.5, 0.6, 0.7),
                           clock=model.clock)  # fmt: skip
    out = runner.predict(-torch.ones(1, 3), 10.0)
    assert (out.option, out.step, out.reason, out.missed) == ("policy", 0, "deadline", False)
    out = runner.predict(-torch.ones(1, 3), 13.0)  # exit 1 typically answers at 12 ms: it goes on, then stops
    assert (out.option, out.step, out.reason, out.missed) == ("policy", 1, "deadline", False)
    out = runner.predict(torch.ones(1, 3), 10.0)  # the deadline decides first: exit 0 answers either way
    assert (out.step, out.reason) == (0, "deadline")
    out = runner.predict(torch.ones(1, 3), 100.0)
    assert (out.option, out.step, out.reason) == ("policy", 0, "confident")


class HeadedLadder(TimedLadder):
    """A TimedLadder whose early exits' heads take ``head_ms`` each: the way to exit k through every earlier head
    costs more than exit k alone (``forward_until``)."""

    def __init__(self, delays_ms: list[float], head_ms: float) -> None:
        super().__init__(delays_ms)
        self.head_ms = head_ms

    def steps(self, x: Tensor) -> Iterator[Tensor]:
        for k, logits in enumerate(super().steps(x)):
            yield logits
            if k < self.num_steps - 1:
                self.clock.advance(self.head_ms)  # charged when the runtime goes on past this exit's answer

    def forward_until(self, x: Tensor, k: int) -> Tensor:
        self.clock.advance(self.head_ms if k < self.num_steps - 1 else 0.0)
        return super().forward_until(x, k)


def test_the_runtime_answers_and_decides_on_combined_exits(sleepy):
    model, profile = sleepy
    # Exit 0 says class 0 and nobody may leave there, exit 1 alone says class 1; weighing exit 0 twice, the
    # combined exit 1 says class 0, confidently, and the sample leaves there with that answer.
    weights = ((1.0,), (2.0, 1.0), (2.0, 0.0, 1.0))
    runner = AnytimeRunner(model, profile, ExitPolicy("confidence", (None, 0.9), combine=weights), adapt=False,
                           quantile=0.9, clock=model.clock)  # fmt: skip
    plain = AnytimeRunner(model, profile, ExitPolicy("confidence", (None, 0.9)), adapt=False, quantile=0.9,
                          clock=model.clock)  # fmt: skip
    for x in (torch.ones(1, 3), torch.tensor([[1.0, 0, 0], [-1.0, 0, 0]])):
        out = runner.predict(x, 1000.0)
        assert out.exits[0] == 1 and out.predictions[0] == 0
        assert out.logits[0].argmax() == 0 and out.logits[0, 0] > out.logits[0, 1] + 10
        assert plain.predict(x, 1000.0).predictions[0] == 1
    assert runner.predict(torch.tensor([[1.0, 0, 0], [-1.0, 0, 0]]), 1000.0).exits.tolist() == [1, 2]


def test_adaptation_keeps_deadlines_when_the_device_slows_down(sleepy):
    model, profile = sleepy
    # Exit 2 fits as profiled (28 ms of 34); 2x slower it takes 56 ms. A static runner goes on choosing it and
    # misses; an adaptive one sees its answers take twice as long and chooses exit 1 (24 ms, slowed).
    deadline = 34.0
    static = AnytimeRunner(model, profile, adapt=False, quantile=0.9, clock=model.clock)
    adaptive = AnytimeRunner(model, profile, adapt=True, quantile=0.9, window=30, min_observations=4, clock=model.clock)
    x = -torch.ones(1, 3)
    model.slowdown = 2.0
    try:
        static_misses = sum(static.predict(x, deadline).missed for _ in range(4))
        for _ in range(8):  # a few answers teach the runner the new speed (8 make it ready)
            adaptive.predict(x, deadline)
        adapted = [adaptive.predict(x, deadline) for _ in range(4)]
    finally:
        model.slowdown = 1.0
    assert static_misses == 4
    assert not any(o.missed for o in adapted) and all(o.step == 1 and o.fits for o in adapted)
    assert adaptive.drift.level() == pytest.approx(2.0)


def test_the_runtime_answers_at_a_step_it_is_told_and_observes_it():
    model = HeadedLadder([4.0, 4.0, 4.0], head_ms=3.0).eval()
    profile = profile_model(
        model, (3,), StepTiming(batch_sizes=(1,), repeats=20, warmup=1), instruments=Instruments(clock=model.clock)
    )
    runner = AnytimeRunner(model, profile, ExitPolicy("confidence", (0.9, 0.9)), quantile=0.9, clock=model.clock)
    confident = torch.ones(1, 3)  # would leave at exit 0 on the way through the heads
    for k, (alone, through) in enumerate(zip([7.0, 11.0, 12.0], [4.0, 11.0, 18.0])):
        seen = runner.drift.observations
        out = runner.predict_at(confident, k)  # the stages up to k and exit k's own head, no earlier head
        assert (out.step, out.reason, out.exits.tolist(), out.missed) == (k, "pinned", [k], False)
        assert out.elapsed_ms == pytest.approx(alone) and out.deadline_ms == math.inf
        assert torch.equal(out.logits, model._logits(confident, k))
        assert runner.drift.observations == seen + 1
        out = runner.predict_at(confident, k, through=True)  # every earlier head, nobody leaving
        assert (out.step, out.reason, out.exits.tolist()) == (k, "pinned", [k])
        assert out.elapsed_ms == pytest.approx(through)
    for bad in (3, -1, True, 1.0):
        with pytest.raises(AnytimeError, match="does not exist"):
            runner.predict_at(confident, bad)  # type: ignore[arg-type]
    model.train()
    with pytest.raises(AnytimeError, match="eval mode"):
        runner.predict_at(confident, 0)
    model.eval()


def test_a_non_incremental_model_gets_one_step_chosen_up_front(sleepy):
    model, _ = sleepy

    class Separate(nn.Module):
        incremental = False
        num_steps = 3

        def forward_until(self, x: Tensor, k: int) -> Tensor:
            return model.forward_until(x, k)

        def steps(self, x: Tensor) -> Iterator[Tensor]:
            return (self.forward_until(x, k) for k in range(self.num_steps))

        def forward_all(self, x: Tensor) -> Tensor:
            return torch.stack(list(self.steps(x)))

    ladder = Separate().eval()
    profile = profile_model(
        ladder, (3,), StepTiming(batch_sizes=(1,), repeats=10, warmup=1), instruments=Instruments(clock=model.clock)
    )
    assert not profile.incremental
    runner = AnytimeRunner(ladder, profile, adapt=False, quantile=0.9, step_accuracy=[0.5, 0.6, 0.7], clock=model.clock)
    x = -torch.ones(1, 3)
    out = runner.predict(x, profile.step_quantile(1, 0.9) + 8)  # step 2 needs about 28 ms
    assert out.step == 1 and out.reason == "chosen" and not out.missed
    adaptive = AnytimeRunner(ladder, profile, quantile=0.9, step_accuracy=[0.5, 0.6, 0.7], clock=model.clock)
    out = adaptive.predict_at(x, 2)
    assert (out.step, out.reason, out.elapsed_ms) == (2, "pinned", pytest.approx(28.0))
    assert adaptive.drift.observations == 1  # told to the scheduler as its step-2 option's time
    with pytest.raises(AnytimeError, match="incremental"):
        AnytimeRunner(ladder, profile, ExitPolicy("confidence", (0.9, 0.9)), quantile=0.9)


def test_runtime_refusals(sleepy):
    model, profile = sleepy
    with pytest.raises(AnytimeError, match="has 3 steps but the model has 2"):
        AnytimeRunner(TimedLadder([1.0, 1.0]), profile)
    with pytest.raises(AnytimeError, match="policy is for 2 exits"):
        AnytimeRunner(model, profile, ExitPolicy("confidence", (0.9,)), quantile=0.9)
    with pytest.raises(AnytimeError, match="needs at least 100 samples"):
        AnytimeRunner(model, profile)
    runner = AnytimeRunner(model, profile, quantile=0.9)
    with pytest.raises(AnytimeError, match="deadline"):
        runner.predict(torch.ones(1, 3), float("nan"))
    with pytest.raises(AnytimeError, match="larger than any profiled batch size"):
        runner.predict(torch.ones(3, 3), 10.0)


# ---------------------------------------------------------------- real models and the command line


def test_profile_a_plain_model_with_training_figures():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5))
    profile = profile_model(
        model, (3, 2, 2), StepTiming(batch_sizes=(1, 4), repeats=5, warmup=1, train=True, train_repeats=2)
    )
    assert profile.num_steps == 1 and not profile.incremental and profile.at(4).stages is None
    assert profile.step_flops == (2 * 12 * 5,) and profile.model_bytes == (12 * 5 + 5) * 4
    assert profile.at(4).training["backward_p50_s"] > 0 and model.training


def _halves(first_ms: float, second_ms: float, n: int = 200) -> DeviceProfile:
    """A two-step profile whose step 1 takes ``first_ms`` in the first half of the repetitions, ``second_ms`` after."""
    profile = make_profile([1.0, 2.0], stage_ms=[1.0, 1.0], n=n)
    step = np.concatenate([np.full(n // 2, first_ms), np.full(n - n // 2, second_ms)])
    at = profile.at(1)
    return replace(profile, latency={1: BatchLatency(1, (at.steps[0], step), at.stages)})


def test_steadiness_compares_the_halves_of_the_repetitions():
    steady = make_profile([1.0, 2.0], stage_ms=[1.0, 1.0], n=200, spread=0.1).steadiness()
    assert steady.spread < 0.1
    burst = _halves(2.0, 3.0).steadiness()
    assert burst.spread == pytest.approx(0.5) and "step exit1 at batch 1" in burst.where
    assert "2.000 ms in the first half" in burst.where and "3.000 ms in the second" in burst.where
    assert make_profile([1.0], n=30).steadiness().spread == 0.0  # halves too small to compare: not judged


MEMORY = {"peak_mb": 1.0, "activations_mb": 0.5}  # measured with the first profile only


def test_an_unsteady_profile_is_taken_again_and_the_steadiest_kept(profiled, monkeypatch, tmp_path, capsys):
    import anytime.profile
    from anytime.tasks.profiling import ProfileSettings, profile_run

    spreads = iter([(2.0, 3.0), (2.0, 2.8), (2.0, 2.1), (2.0, 2.0)])
    calls = []

    def fake(model, *args, instruments, **kwargs):
        memory = instruments.memory
        calls.append(memory is not None)
        first, second = next(spreads)
        taken = _halves(first, second)
        return replace(taken, latency={1: replace(taken.at(1), memory=MEMORY if memory else None)})

    monkeypatch.setattr(anytime.profile, "profile_model", fake, raising=False)
    monkeypatch.setattr(
        "anytime.tasks.profiling._pricing_policy", lambda *args: None
    )  # the fake has 2 steps, the run 3
    monkeypatch.setattr("anytime.tasks.profiling.price_answers", lambda model, profile, **kwargs: profile)
    profile, _ = profile_run(profiled, ProfileSettings(batch_sizes=(1,), memory=False), out=tmp_path / "a.json")
    assert calls == [False, False, False] and profile.settings["steadiness"]["attempts"] == 3
    assert profile.settings["steadiness"]["spread"] == pytest.approx(0.05)  # the third, within 0.25
    spreads = iter([(2.0, 3.0), (2.0, 2.8), (2.0, 3.1)])  # none within 0.25: the second is kept
    calls.clear()
    assert main(["profile", str(profiled), "--out", str(tmp_path / "b.json")]) == 0
    out, err = capsys.readouterr()
    assert calls == [True, False, False] and "halves within 40% (3 profiles taken)" in out
    assert "note: the machine was not steady while profiling (step exit1 at batch 1" in err and "2.800 ms" in err
    kept = DeviceProfile.load(tmp_path / "b.json")
    assert kept.settings["steadiness"]["spread"] == pytest.approx(0.4) and kept.at(1).memory == MEMORY
    spreads = iter([(2.0, 3.0)])
    calls.clear()
    assert main(["profile", str(profiled), "--steady-within", "off", "--out", str(tmp_path / "c.json")]) == 0
    assert calls == [True] and "note:" not in capsys.readouterr().err


@pytest.fixture(scope="module")
def profiled(exit_run, tmp_path_factory):
    from anytime.tasks.calibration import CalibrationSettings, calibrate_run
    from anytime.tasks.collect import collect_run
    from anytime.tasks.profiling import ProfileSettings, profile_run

    run = tmp_path_factory.mktemp("profiled") / "run"
    shutil.copytree(exit_run, run)
    collect_run(run, "val")
    calibrate_run(run, CalibrationSettings(max_drop=1.0, criterion="confidence"))
    profile_run(run, ProfileSettings(batch_sizes=(1, 4), repeats=30, warmup=2, memory=False))
    return run


def test_the_runtime_on_a_trained_run(profiled):
    from anytime.scheduler.runs import runner_for_run

    runner, run = runner_for_run(profiled, quantile=0.9)
    assert runner.policy is not None and runner.incremental
    x = torch.randn(4, 1, 8, 8)
    whole = runner.predict(x, 1e4)
    assert whole.predictions.shape == (4,) and whole.exits.max() <= run.num_steps - 1
    # With time to spare the runtime answers as the calibrated policy's real early exit does.
    plain = runner.policy.run(run.model, x)
    assert torch.equal(whole.predictions, plain.predictions) and torch.equal(whole.exits, plain.exits)


def test_profile_and_schedule_commands(profiled, capsys, tmp_path):
    assert (
        main(["profile", str(profiled), "--batch-sizes", "1,2", "--repeats", "20", "--out", str(tmp_path / "p.json")])
        == 0
    )
    out = capsys.readouterr().out
    assert "exit0" in out and "p99 ms" in out and "peak memory" in out
    assert main(["schedule", str(profiled), "--deadline-ms", "1000", "--quantile", "0.9"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["fits"] and answer["option"] in {f["option"] for f in answer["frontier"]}
    assert answer["latency_ms"] <= 1000
    assert main(["schedule", str(profiled), "--deadline-ms", "1e-6", "--quantile", "0.9"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert (
        not answer["fits"] and answer["option"] == answer["frontier"][0]["option"] and "likely miss" in answer["note"]
    )
    only = next(profiled.glob("profile-*.json"))
    assert main(["profile", "--compare", str(only), str(tmp_path / "p.json")]) == 0
    assert "B/A p99" in capsys.readouterr().out


def test_schedule_refuses_bad_input_in_one_line(profiled, cli_error, tmp_path):
    run = str(profiled)
    cli_error(["schedule", run, "--deadline-ms", "nan"], "deadline")
    cli_error(["schedule", run, "--deadline-ms", "-3"], "deadline")
    cli_error(["schedule", run, "--deadline-ms", "5", "--quantile", "0.9999"], "samples")
    cli_error(["schedule", run, "--deadline-ms", "5", "--quantile", "2"], "quantile")
    cli_error(["schedule", run, "--deadline-ms", "5", "--quantile", "0.9", "--batch-size", "3"], "batch size 3")
    doc = json.loads(next(profiled.glob("profile-*.json")).read_text())
    doc["model_fingerprint"] = "0123456789abcdef"
    (tmp_path / "other.json").write_text(json.dumps(doc))
    cli_error(["schedule", run, "--deadline-ms", "5", "--quantile", "0.9", "--profile", str(tmp_path / "other.json")],
                    "another model")  # fmt: skip
    cli_error(["schedule", str(tmp_path), "--deadline-ms", "5"], "not a run")
    cli_error(["schedule", run], "give --deadline-ms")
    cli_error(["schedule", run, "--check", "--deadline-ms", "5"], "drop --deadline-ms")
    cli_error(["schedule", run, "--check", "--deadlines", "1,x"], "comma-separated")
    cli_error(["schedule", run, "--check", "--deadlines", "1,nan"], "deadline")
    cli_error(["schedule", run, "--check", "--quantile", "0.9", "--gap-ms", "-1"], "gap")
    cli_error(["profile"], "run directory")
    cli_error(["profile", run, "--batch-sizes", "1,x"], "batch-sizes")
    cli_error(["profile", "--compare", str(tmp_path / "nope.json"), str(tmp_path / "other.json")], "no profile")


def test_the_promise_check_sets_delivery_beside_the_promise(profiled, capsys):
    args = ["schedule", str(profiled), "--check", "--deadlines", "0.0001,10000", "--requests", "12", "--gap-ms", "0",
            "--quantile", "0.9", "--split", "val"]  # fmt: skip
    code = main(args)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "promise (p90" in lines[0] and "nothing fits" in lines[1] and lines[1].endswith("infeasible")
    assert lines[2].split()[-1] in ("kept", "BROKEN") and code == (1 if "BROKEN" in out else 0)
    assert main([*args, "--json"]) == code
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert (rows[0]["promised"], rows[0]["kept"], rows[0]["requests"]) == (0, None, 12)
    assert (rows[1]["promised"], rows[1]["late"], rows[1]["late_rate"]) == (12, 0, 0.0)  # 10 s: nothing is late


def test_the_default_deadlines_run_from_below_every_promise_to_above_every_one(profiled):
    # Spanning every option the runtime may answer with (a calibrated policy can be priced below the first exit
    # alone), the lowest deadline promises nothing and the highest promises every request.
    from anytime.tasks.promises import PromiseSettings, check_promises

    check = check_promises(profiled, PromiseSettings(deadline_count=3, count=12, split="val", quantile=0.9, gap_ms=0))
    assert [r.promised for r in (check.rows[0], check.rows[-1])] == [0, 12] and len(check.rows) == 3


def test_a_promise_is_broken_only_beyond_what_chance_explains():
    from anytime.tasks.promises import judge, late_p_value

    assert late_p_value(0, 300, 0.01) == 1.0 and late_p_value(1, 1, 0.01) == pytest.approx(0.01)
    assert late_p_value(1, 17, 0.01) == pytest.approx(1 - 0.99**17)
    assert late_p_value(60, 10_000, 0.01) > 0.5  # large counts stay finite
    assert judge(3, 300, 290, 0.95, 0.99, 0.01) is True  # 1% late, as promised
    assert judge(8, 300, 290, 0.95, 0.99, 0.01) is False  # 2.7% late: p = 0.011
    assert judge(0, 300, 250, 0.95, 0.99, 0.01) is False  # 83% delivered where 95% was promised
    assert judge(0, 0, 0, math.nan, 0.99, 0.01) is None  # nothing promised: infeasible, not broken


def test_every_calibration_in_the_run_is_an_option(profiled, tmp_path):
    from anytime.scheduler.query import scheduler_for_run
    from anytime.tasks.calibration import CalibrationSettings, calibrate_run

    run = tmp_path / "run"
    shutil.copytree(profiled, run)
    calibrate_run(run, CalibrationSettings(max_drop=2.0, criterion="entropy"), out=run / "calibration-entropy.json")
    scheduler, _ = scheduler_for_run(run)
    steps = [f"exit{k}" for k in range(scheduler.profile.num_steps)]
    assert set(scheduler.options) == {*steps, "calibration (confidence)", "calibration-entropy (entropy)"}
    stale = json.loads((run / "calibration.json").read_text())
    stale["model_fingerprint"] = "0123456789abcdef"
    (run / "calibration-stale.json").write_text(json.dumps(stale))
    with pytest.raises(AnytimeError, match="calibration-stale.json was fit on another model"):
        scheduler_for_run(run)


def test_deadline_plots(profiled):
    from anytime.tasks.plots import plot_run

    names = {p.name for p in plot_run(profiled).paths}
    assert {"deadline_accuracy.png", "latency.png"} <= names


# ---------------------------------------------------------------- one frontier over precisions


def test_one_frontier_over_two_precisions():
    from anytime.scheduler import PrecisionScheduler

    fp32 = DeadlineScheduler.from_accuracies(make_profile([2.0, 4.0, 8.0]), [0.60, 0.80, 0.90])
    int8 = DeadlineScheduler.from_accuracies(make_profile([1.0, 2.0, 3.0], fingerprint="int8"), [0.58, 0.79, 0.88])
    both = PrecisionScheduler({"fp32": fp32, "int8": int8})
    names = [o.name for o, _ in both.frontier()]
    assert names == ["int8 exit0", "int8 exit1", "int8 exit2", "fp32 exit2"]  # fp32 exit0/exit1 are dominated
    for deadline in (1.0, 2.0, 3.0, 5.0, 8.0, 100.0):  # never less accurate than fp32 alone where fp32 has an option
        chosen, alone = both.select(deadline), fp32.select(deadline)
        assert chosen.fits and (not alone.fits or chosen.accuracy >= alone.accuracy), deadline
    assert both.select(1.5).option == "int8 exit0" and not fp32.select(1.5).fits  # int8 makes an option fit
    assert both.select(8.0).option == "fp32 exit2" and both.variant_of("fp32 exit2") == "fp32"
    low = both.select(0.5)
    assert not low.fits and low.option == "int8 exit0" and "likely miss" in low.note


def test_precisions_measured_on_different_devices_are_refused():
    from anytime.scheduler import PrecisionScheduler

    other = make_profile([1.0])
    other = DeviceProfile(**{**other.__dict__, "device": {"type": "cuda", "label": "a gpu"}})
    with pytest.raises(AnytimeError, match="different devices"):
        PrecisionScheduler({"fp32": DeadlineScheduler.from_accuracies(make_profile([1.0]), [0.5]),
                            "int8": DeadlineScheduler.from_accuracies(other, [0.5])})  # fmt: skip
