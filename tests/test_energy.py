"""Energy per inference: the readers on recorded counter and rail fixtures (sysfs trees, NVML answers), the
measurement windows against coarse counters, profiles with energy, and deadlines with an energy budget.

Nothing here reads this machine's counters (a virtual machine has none): every reader runs on files or answers
the test writes, and time is a fake clock, so the figures expected are known exactly.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import threading

import numpy as np
import pytest
import torch
from test_scheduler import FakeClock, TimedLadder, make_profile

from anytime import AnytimeRunner
from anytime.calibrate import ExitPolicy
from anytime.errors import AnytimeError
from anytime.profile import DeviceProfile, Instruments, StepTiming, profile_model
from anytime.profile import energy_readers as readers_module
from anytime.profile.energy import EnergySettings, idle_power, measure_energy
from anytime.profile.energy_readers import (
    EnergySource,
    NvmlReader,
    PowerIntegral,
    RaplReader,
    WrappingCounter,
    jetson_rails,
    open_energy_reader,
    open_jetson_reader,
)
from anytime.scheduler import DeadlineScheduler, Option
from anytime.scheduler.deadline import PrecisionScheduler

# ---------------------------------------------------------------- readers on recorded fixtures


def _rapl_tree(root, packages=((1_000_000, 262_143_328_850),)):
    for i, (energy, wrap) in enumerate(packages):
        d = root / f"intel-rapl:{i}"
        d.mkdir(parents=True)
        (d / "name").write_text(f"package-{i}\n")
        (d / "energy_uj").write_text(f"{energy}\n")
        (d / "max_energy_range_uj").write_text(f"{wrap}\n")
        (d / "constraint_0_power_limit_uw").write_text("65000000\n")
        core = root / f"intel-rapl:{i}:0"  # a subdomain (cores), inside the package's figure: not added again
        core.mkdir()
        (core / "name").write_text("core\n")
        (core / "energy_uj").write_text("5\n")
    return root


def test_rapl_sums_packages_and_undoes_the_wrap_around(tmp_path):
    root = _rapl_tree(tmp_path, ((1_000_000, 10_000_000), (2_000_000, 10_000_000)))
    reader = RaplReader(root)
    assert reader.source.reader == "rapl" and "package-0 + package-1" in reader.source.detail
    assert "package limit 65 W" in reader.source.power_mode and reader.read_j() == 0.0
    (root / "intel-rapl:0" / "energy_uj").write_text("3000000\n")  # +2 J
    (root / "intel-rapl:1" / "energy_uj").write_text("2500000\n")  # +0.5 J
    assert reader.read_j() == pytest.approx(2.5)
    # Package 0 wraps: 3,000,000 -> 9,999,999 -> 1,000,000 is +6,999,999 then +1,000,001 µJ.
    (root / "intel-rapl:0" / "energy_uj").write_text("9999999\n")
    assert reader.read_j() == pytest.approx(2.5 + 6.999999)
    (root / "intel-rapl:0" / "energy_uj").write_text("1000000\n")
    assert reader.read_j() == pytest.approx(2.5 + 8.0)


def test_a_counter_without_a_wrap_range_that_goes_backwards_is_an_error():
    counter = WrappingCounter(10, None)
    assert counter.update(15) == 5
    with pytest.raises(AnytimeError, match="backwards"):
        counter.update(3)


def test_unreadable_rapl_says_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(AnytimeError, match="no intel-rapl:N domain"):
        RaplReader(tmp_path)
    root = _rapl_tree(tmp_path / "locked")
    locked = root / "intel-rapl:0" / "energy_uj"
    real = type(locked).read_text

    def read_text(self, *args, **kwargs):  # what a non-root user meets on Linux 5.10 and later
        if self == locked:
            raise PermissionError(13, "Permission denied")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(locked), "read_text", read_text)
    with pytest.raises(AnytimeError, match="root only.*chmod a\\+r"):
        RaplReader(root)


def test_no_source_at_all_names_everything_tried(tmp_path, monkeypatch):
    monkeypatch.setattr(readers_module, "RAPL_ROOT", tmp_path / "powercap")
    monkeypatch.setattr(readers_module, "INA_ROOT", tmp_path / "i2c")
    with pytest.raises(AnytimeError) as caught:
        open_energy_reader("cpu")
    message = str(caught.value)
    assert "RAPL" in message and "Jetson INA3221" in message and "without --energy" in message
    assert "\n" not in message


class FakeNvml:
    """NVML's answers, recorded: a total-energy counter (mJ) or, on an older GPU, power (mW) only."""

    class NVMLError(Exception):
        pass

    def __init__(self, energy_mj=None, power_mw=None, present=True):
        self.energy_mj = list(energy_mj) if energy_mj is not None else None
        self.power_mw = list(power_mw or [])
        self.present = present
        self.shut = False

    def nvmlInit(self):
        if not self.present:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlDeviceGetName(self, handle):
        return b"Test GPU"

    def nvmlDeviceGetPowerManagementLimit(self, handle):
        return 300_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if self.energy_mj is None:
            raise self.NVMLError("Not Supported")
        return self.energy_mj.pop(0)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.power_mw.pop(0)

    def nvmlShutdown(self):
        self.shut = True


def test_nvml_reads_the_total_energy_counter():
    nvml = FakeNvml(energy_mj=[5_000, 5_250, 9_000])
    reader = NvmlReader(0, nvml=nvml)
    assert reader.source.reader == "nvml" and not reader.source.sampled
    assert "Test GPU" in reader.source.detail and reader.source.power_mode == "power limit 300 W"
    assert reader.read_j() == pytest.approx(0.25) and reader.read_j() == pytest.approx(4.0)
    reader.close()
    assert nvml.shut


def test_nvml_without_an_energy_counter_integrates_sampled_power():
    clock = FakeClock()
    nvml = FakeNvml(power_mw=[100_000, 100_000, 200_000])
    reader = NvmlReader(0, nvml=nvml, clock=clock, background=False)
    assert reader.source.sampled and "power sampled" in reader.source.detail
    clock.advance(1000)
    assert reader.read_j() == pytest.approx(100.0)  # 100 W for 1 s
    clock.advance(500)
    assert reader.read_j() == pytest.approx(100.0 + 0.5 * (100 + 200) * 0.5)  # the trapezoid to 200 W
    reader.close()


def test_nvml_without_a_driver_is_unreadable():
    with pytest.raises(AnytimeError, match="NVML: no GPU 0"):
        NvmlReader(0, nvml=FakeNvml(present=False))


def _jetpack4(root, rails):
    d = root / "ina3221x" / "1-0040" / "iio:device0"
    d.mkdir(parents=True)
    for i, (name, mw) in enumerate(rails):
        (d / f"rail_name_{i}").write_text(name + "\n")
        (d / f"in_power{i}_input").write_text(f"{mw}\n")
    return d


def _jetpack5(root, rails):
    d = root / "ina3221" / "1-0040" / "hwmon" / "hwmon3"
    d.mkdir(parents=True)
    for i, (name, mv, ma) in enumerate(rails, start=1):
        (d / f"in{i}_label").write_text(name + "\n")
        (d / f"in{i}_input").write_text(f"{mv}\n")
        (d / f"curr{i}_input").write_text(f"{ma}\n")
    return d


def test_jetson_rails_in_both_sysfs_layouts(tmp_path):
    _jetpack4(tmp_path / "a", [("POM_5V_IN", 4000), ("POM_5V_GPU", 1500)])
    rails = jetson_rails(tmp_path / "a")
    assert [r.label for r in rails] == ["POM_5V_IN", "POM_5V_GPU"] and rails[0].watts() == pytest.approx(4.0)
    _jetpack5(tmp_path / "b", [("VDD_GPU_SOC", 5000, 400), ("VDD_CPU_CV", 5000, 200)])
    rails = jetson_rails(tmp_path / "b")
    assert [r.label for r in rails] == ["VDD_GPU_SOC", "VDD_CPU_CV"] and rails[0].watts() == pytest.approx(2.0)


def test_a_jetson_reader_prefers_the_board_input_rail_else_sums_the_rails(tmp_path):
    clock = FakeClock()
    _jetpack5(tmp_path / "orin", [("VDD_IN", 5000, 1200), ("VDD_GPU_SOC", 5000, 400)])
    reader = open_jetson_reader(tmp_path / "orin", clock=clock, background=False, power_mode="15W")
    assert (
        reader.source.reader == "jetson-ina" and "VDD_IN," in reader.source.detail and reader.source.power_mode == "15W"
    )
    clock.advance(2000)
    assert reader.read_j() == pytest.approx(12.0)  # 6 W for 2 s: the input rail alone, not 6 + 2
    _jetpack5(tmp_path / "other", [("VDD_GPU_SOC", 5000, 400), ("VDD_CPU_CV", 5000, 200)])
    summed = open_jetson_reader(tmp_path / "other", clock=clock, background=False, power_mode="MAXN")
    clock.advance(1000)
    assert summed.read_j() == pytest.approx(3.0)


def test_power_integral_follows_a_recorded_trace_and_refuses_nonsense():
    integral = PowerIntegral()
    trace = [(0.0, 10.0), (0.1, 20.0), (0.3, 20.0), (0.35, 0.0), (0.2, 99.0)]  # the last one is out of order
    for t, w in trace:
        total = integral.add(t, w)
    assert total == pytest.approx(0.5 * 30 * 0.1 + 20 * 0.2 + 0.5 * 20 * 0.05)
    for bad in (float("nan"), -1.0):
        with pytest.raises(AnytimeError, match="power rail"):
            integral.add(1.0, bad)


def _samplers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "anytime-power"]


def test_the_sampling_thread_runs_only_inside_a_sampling_block():
    clock_values = iter(np.arange(0, 10_000, 0.001))
    reader = readers_module.SampledPower(
        EnergySource("test", "constant 5 W", 1e-3, 1e-3, True), lambda: 5.0, interval_s=0.001,
        clock=lambda: float(next(clock_values)),
    )  # fmt: skip
    assert not _samplers()  # never beside a latency timing
    with reader.sampling():
        assert len(_samplers()) == 1
        for _ in range(500):  # samples come from the thread, not from read_j
            if reader._integral.samples >= 5:
                break
            threading.Event().wait(0.01)
        assert reader._integral.samples >= 5
        assert reader.read_j() > 0
    assert not _samplers()
    reader.close()


# ---------------------------------------------------------------- measurement windows


class QuantisedCounter:
    """A reader whose true energy grows by ``per_call_j`` at every call of the work, read in whole quanta."""

    def __init__(self, quantum_j: float, per_call_j: float, call_ms: float, clock: FakeClock) -> None:
        self.source = EnergySource("test", "quantised counter", quantum_j, 1e-3, False)
        self.quantum_j, self.per_call_j, self.call_ms, self.clock = quantum_j, per_call_j, call_ms, clock
        self.true_j = 0.0

    def work(self) -> None:
        self.true_j += self.per_call_j
        self.clock.advance(self.call_ms)

    def read_j(self) -> float:
        return math.floor(self.true_j / self.quantum_j + 1e-9) * self.quantum_j

    def sampling(self):
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


def test_windows_grow_until_a_coarse_counter_resolves_the_step():
    clock = FakeClock()
    counter = QuantisedCounter(
        quantum_j=0.01, per_call_j=0.001, call_ms=0.1, clock=clock
    )  # 1 mJ per call, 10 mJ quanta
    settings = EnergySettings(windows=10, min_window_s=0.05, max_window_s=100.0, min_quanta=100, idle_s=0)
    windows = measure_energy(counter.work, counter, 2, settings, clock=clock)
    assert windows.calls >= 1000 and len(windows.joules) == 10  # >= 100 quanta = 1 J per window
    assert windows.mean_j == pytest.approx(0.0005, rel=0.01)  # per inference: 1 mJ per call of 2 inputs
    assert windows.power_w == pytest.approx(10.0, rel=0.01)  # 1 mJ per 0.1 ms
    assert windows.quantile_j(0.99) >= windows.quantile_j(0.5)


def test_a_counter_too_coarse_for_the_longest_window_is_an_error():
    clock = FakeClock()
    counter = QuantisedCounter(quantum_j=1000.0, per_call_j=0.001, call_ms=1.0, clock=clock)
    settings = EnergySettings(windows=5, min_window_s=0.01, max_window_s=2.0, idle_s=0)
    with pytest.raises(AnytimeError, match="too coarse"):
        measure_energy(counter.work, counter, 1, settings, clock=clock, what="step 0 at batch 1")


def test_idle_power_and_bad_settings():
    clock = FakeClock()
    counter = QuantisedCounter(quantum_j=1e-6, per_call_j=0.0, call_ms=0.0, clock=clock)

    def sleep(seconds: float) -> None:  # 3 W while idle
        counter.true_j += 3.0 * seconds
        clock.advance(1000 * seconds)

    assert idle_power(counter, 2.0, clock=clock, sleep=sleep) == pytest.approx(3.0)
    assert idle_power(counter, 0.0, clock=clock, sleep=sleep) is None
    for bad in ({"windows": 1}, {"min_window_s": 0.0}, {"min_window_s": 5.0, "max_window_s": 1.0}, {"idle_s": -1.0},
                {"max_window_s": float("nan")}):  # fmt: skip
        with pytest.raises(AnytimeError):
            EnergySettings(**bad)


# ---------------------------------------------------------------- profiles with energy


class LadderMeter:
    """Energy that follows the fake clock of a :class:`TimedLadder`: ``watts`` while it runs."""

    def __init__(self, clock: FakeClock, watts: float) -> None:
        self.source = EnergySource("test", f"{watts} W while the clock runs", 1e-6, 1e-3, False, "test mode")
        self.clock, self.watts = clock, watts

    def read_j(self) -> float:
        return self.clock() * self.watts

    def sampling(self):
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def energetic():
    model = TimedLadder([4.0, 8.0, 16.0]).eval()
    settings = EnergySettings(windows=4, min_window_s=0.05, idle_s=0.5)
    profile = profile_model(
        model,
        (3,),
        StepTiming(batch_sizes=(1, 2), repeats=20, warmup=1),
        instruments=Instruments(
            clock=model.clock,
            energy=LadderMeter(model.clock, 10.0),
            energy_settings=settings,
            sleep=lambda s: model.clock.advance(1000 * s),
        ),
    )
    return model, profile


def test_a_profile_measures_steps_and_exit_paths(energetic, tmp_path):
    _, profile = energetic
    assert profile.energy is not None and profile.energy.idle_w == pytest.approx(10.0)
    assert profile.energy.source.power_mode == "test mode" and profile.energy.settings.windows == 4
    # 10 W for 4, 12 and 28 ms (a step alone runs its backbone to k) and the same for paths, per input.
    for k, ms in enumerate([4.0, 12.0, 28.0]):
        assert profile.step_energy_j(k, 1) == pytest.approx(0.010 * ms)
        assert profile.path_energy_j(k, 1) == pytest.approx(0.010 * ms)
        assert profile.step_energy_j(k, 2) == pytest.approx(0.010 * ms / 2)
    assert profile.at(1).energy.steps[0].power_w == pytest.approx(10.0)
    loaded = DeviceProfile.load(profile.save(tmp_path / "p.json"))
    assert loaded.energy == profile.energy
    assert loaded.path_energy_j(2, 2) == pytest.approx(profile.path_energy_j(2, 2))
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["energy"]["reader"] == "test" and "mean_j" in doc["batches"][0]["energy"]["steps"][0]


def test_malformed_energy_in_a_profile_is_refused(energetic, tmp_path):
    _, profile = energetic
    doc = profile.to_dict()
    doc["batches"][0]["energy"]["steps"][1]["joules"][0] = float("nan")
    with pytest.raises(AnytimeError, match="NaN, infinite or negative energy"):
        DeviceProfile.from_dict(json.loads(json.dumps(doc)))
    doc = profile.to_dict()
    doc["energy"] = None  # figures without the meter that measured them
    with pytest.raises(AnytimeError, match="malformed"):
        DeviceProfile.from_dict(doc)
    plain = make_profile([1.0, 2.0])
    with pytest.raises(AnytimeError, match="no energy figures.*--energy"):
        plain.step_energy_j(0)


# ---------------------------------------------------------------- deadlines with an energy budget


def _with_energy(profile: DeviceProfile, step_mj: list[float], path_mj: list[float] | None = None) -> DeviceProfile:
    from dataclasses import replace

    from anytime.profile.energy import BatchEnergy, EnergyMeter, EnergyWindows

    def windows(mj: float, b: int) -> EnergyWindows:
        return EnergyWindows(np.full(3, mj / 1000 / b), np.full(3, 0.001), 10)

    latency = {b: replace(at, energy=BatchEnergy(tuple(windows(v, b) for v in step_mj),
                                                 None if path_mj is None else tuple(windows(v, b) for v in path_mj)))
               for b, at in profile.latency.items()}  # fmt: skip
    meter = EnergyMeter(EnergySource("test", "fixture", 1e-6, 1e-3, False), EnergySettings(windows=3), None)
    return replace(profile, latency=latency, energy=meter)


def test_the_most_accurate_option_within_both_budgets():
    # Step 1 is fast but hungry (a wide layer), step 2 slow and frugal: the budgets pull apart.
    profile = _with_energy(make_profile([1.0, 2.0, 5.0]), [10.0, 80.0, 30.0])
    scheduler = DeadlineScheduler.from_accuracies(profile, [0.5, 0.8, 0.9], adapt=False)
    assert scheduler.select(10.0).option == "exit2"
    both = scheduler.select(10.0, energy_mj=50.0)
    assert both.option == "exit2" and both.fits and both.energy_mj == pytest.approx(30.0)
    assert scheduler.select(3.0, energy_mj=100.0).option == "exit1"
    assert scheduler.select(3.0, energy_mj=20.0).option == "exit0"
    # No option within 3 ms uses 5 mJ: the most frugal of those in time, with a note.
    short = scheduler.select(3.0, energy_mj=5.0)
    assert short.option == "exit0" and not short.fits and "energy budget 5 mJ" in short.note
    late = scheduler.select(0.5, energy_mj=100.0)
    assert late.option == "exit0" and not late.fits and "likely miss" in late.note
    assert late.to_dict()["energy_budget_mj"] == 100.0 and "energy_mj" not in scheduler.select(10.0).to_dict()
    # The 2-D frontier keeps the hungry fast step and the frugal slow one; the latency frontier keeps all three.
    names = [o.name for o, _, _ in scheduler.frontier_points(0.99, 1, energy=True)]
    assert names == ["exit0", "exit1", "exit2"]
    assert [e for _, _, e in scheduler.frontier_points(energy=True)] == pytest.approx([10.0, 80.0, 30.0])
    dominated = DeadlineScheduler.from_accuracies(_with_energy(make_profile([1.0, 2.0, 5.0]), [10.0, 80.0, 30.0]),
                                                  [0.5, 0.4, 0.9], adapt=False)  # fmt: skip
    assert [o.name for o, _, _ in dominated.frontier_points(energy=True)] == ["exit0", "exit2"]


def test_a_policy_costs_the_energy_of_the_paths_it_takes():
    profile = _with_energy(make_profile([1.0, 3.0], stage_ms=[1.0, 2.0]), [10.0, 40.0], [12.0, 44.0])
    policy = ExitPolicy("confidence", (0.9,))
    option = Option("early", 0.85, policy=policy, exit_share=(0.75, 0.25))
    scheduler = DeadlineScheduler.from_accuracies(profile, [0.7, 0.9], [option], adapt=False)
    assert scheduler.energy_mj("early") == pytest.approx(0.75 * 12 + 0.25 * 44)
    assert scheduler.select(10.0, energy_mj=25.0).option == "early"
    assert scheduler.select(10.0, energy_mj=60.0).option == "exit1"


def test_bad_energy_budgets_and_profiles_without_energy_are_refused():
    scheduler = DeadlineScheduler.from_accuracies(_with_energy(make_profile([1.0]), [5.0]), [0.5])
    for bad in (float("nan"), -1.0, 0.0, math.inf, True, "5"):
        with pytest.raises(AnytimeError, match="energy budget"):
            scheduler.select(10.0, energy_mj=bad)
    plain = DeadlineScheduler.from_accuracies(make_profile([1.0]), [0.5])
    with pytest.raises(AnytimeError, match="no energy figures"):
        plain.select(10.0, energy_mj=5.0)


def test_precisions_share_one_frontier_with_energy():
    fp32 = DeadlineScheduler.from_accuracies(_with_energy(make_profile([2.0, 4.0]), [20.0, 40.0]), [0.8, 0.9])
    int8 = DeadlineScheduler.from_accuracies(_with_energy(make_profile([1.0, 2.0]), [5.0, 10.0]), [0.78, 0.88])
    both = PrecisionScheduler({"fp32": fp32, "int8": int8})
    assert both.select(10.0).option == "fp32 exit1"
    choice = both.select(10.0, energy_mj=15.0)
    assert choice.option == "int8 exit1" and both.variant_of(choice.option) == "int8"
    names = [o.name for o, _, _ in both.frontier_points(energy=True)]
    assert names == ["int8 exit0", "int8 exit1", "fp32 exit1"]


def test_the_runtime_stops_before_an_exit_over_the_energy_budget(energetic):
    model, profile = energetic
    runner = AnytimeRunner(model, profile, adapt=False, quantile=0.9, clock=model.clock)
    unsure = -torch.ones(1, 3)
    assert runner.predict(unsure, 1000.0).step == 2
    out = runner.predict(unsure, 1000.0, energy_mj=200.0)  # 10 W: exit 1's path costs 120 mJ, exit 2's 280 mJ
    assert out.step == 1 and out.reason == "chosen" and not out.missed
    # A policy whose mean energy fits (half the samples leave at exit 0): a request that would go past the budget
    # stops at the last exit within it.
    policy = AnytimeRunner(model, profile, ExitPolicy("confidence", (0.9, 0.9)), adapt=False, quantile=0.9,
                           exit_share=(0.5, 0.5, 0.0), clock=model.clock)  # fmt: skip
    out = policy.predict(unsure, 1000.0, energy_mj=200.0)
    assert (out.option, out.step, out.reason, out.fits) == ("policy", 1, "energy", True)
    assert runner.predict(unsure, 1000.0, energy_mj=1.0).step == 0  # the first exit always answers
    with pytest.raises(AnytimeError, match="energy budget"):
        runner.predict(unsure, 1000.0, energy_mj=-1.0)
    plain = AnytimeRunner(model, make_profile([4.0, 12.0, 28.0], stage_ms=[4.0, 8.0, 16.0]), clock=model.clock)
    with pytest.raises(AnytimeError, match="no energy figures"):
        plain.predict(unsure, 1000.0, energy_mj=1.0)


def test_a_chosen_step_fits_the_energy_budget(energetic):
    model, _ = energetic

    class Separate(torch.nn.Module):  # the same ladder, each step its own forward: one step chosen up front
        incremental = False
        num_steps = 3

        def forward_until(self, x, k):
            return model.forward_until(x, k)

        def steps(self, x):
            return (self.forward_until(x, k) for k in range(self.num_steps))

        def forward_all(self, x):
            return torch.stack(list(self.steps(x)))

    profile = _with_energy(make_profile([4.0, 12.0, 28.0]), [10.0, 30.0, 70.0])
    runner = AnytimeRunner(Separate().eval(), profile, adapt=False, quantile=0.9, clock=model.clock,
                           step_accuracy=[0.5, 0.7, 0.9])  # fmt: skip
    assert runner.predict(-torch.ones(1, 3), 1000.0).step == 2
    out = runner.predict(-torch.ones(1, 3), 1000.0, energy_mj=40.0)
    assert out.step == 1 and out.reason == "chosen"


# ---------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def energy_run(exit_run, tmp_path_factory):
    from anytime.tasks.calibration import CalibrationSettings, calibrate_run
    from anytime.tasks.collect import collect_run

    run = tmp_path_factory.mktemp("energy") / "run"
    shutil.copytree(exit_run, run)
    collect_run(run, "val")
    calibrate_run(run, CalibrationSettings(max_drop=1.0, criterion="confidence"))
    return run


class WallMeter:
    """A stand-in for a real counter: 25 W of the machine's own clock (no assertion reads the figures' size)."""

    def __init__(self) -> None:
        from anytime.utils.timer import monotonic

        self.source = EnergySource("test", "25 W of wall time", 1e-6, 1e-3, False)
        self._clock, self._start = monotonic, monotonic()

    def read_j(self) -> float:
        return 25.0 * (self._clock() - self._start)

    def sampling(self):
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


def test_profile_with_energy_schedule_and_plot_commands(energy_run, capsys, monkeypatch):
    from anytime.cli import main

    monkeypatch.setattr("anytime.tasks.profiling.open_energy_reader", lambda kind, index: WallMeter())
    argv = ["profile", str(energy_run), "--batch-sizes", "1,2", "--repeats", "20", "--no-memory", "--energy",
            "--energy-windows", "3", "--energy-window-s", "0.01", "--idle-s", "0.01"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mJ mean" in out and "path mJ" in out and "energy: test" in out
    # Budgets no load can break: a day and a megajoule (the meter's figures follow the machine's speed).
    assert (
        main(["schedule", str(energy_run), "--deadline-ms", "8.64e7", "--quantile", "0.9", "--energy-mj", "1e9"]) == 0
    )
    answer = json.loads(capsys.readouterr().out)
    assert answer["fits"] and answer["energy_budget_mj"] == 1e9 and answer["energy_mj"] <= 1e9
    assert all("energy_mj" in point for point in answer["frontier"])
    assert (
        main(["schedule", str(energy_run), "--deadline-ms", "8.64e7", "--quantile", "0.9", "--energy-mj", "1e-9"]) == 0
    )
    answer = json.loads(capsys.readouterr().out)
    assert not answer["fits"] and "energy budget" in answer["note"]
    assert main(["plot", str(energy_run), "--json"]) == 0
    drawn = json.loads(capsys.readouterr().out)
    assert any(path.endswith("energy.png") for path in drawn["paths"])
    assert main(["report", str(energy_run)]) == 0
    page = (energy_run / "report.html").read_text()
    assert "mJ / inference" in page and "accuracy vs latency and vs energy" in page
    profile = str(next(energy_run.glob("profile-*.json")))
    assert main(["profile", "--compare", profile, profile]) == 0
    assert "B/A mJ" in capsys.readouterr().out


def test_energy_refusals_are_one_line(energy_run, exit_run, cli_error, tmp_path, monkeypatch):
    monkeypatch.setattr(readers_module, "RAPL_ROOT", tmp_path / "powercap")
    monkeypatch.setattr(readers_module, "INA_ROOT", tmp_path / "i2c")
    cli_error(
        ["profile", str(exit_run), "--energy", "--out", str(tmp_path / "p.json")], "no readable energy source", "RAPL"
    )
    assert not (tmp_path / "p.json").exists()
    cli_error(
        ["profile", str(exit_run), "--energy", "--energy-window-s", "-1", "--out", str(tmp_path / "p.json")], "window"
    )
    cli_error(["profile", str(exit_run), "--energy", "--trtexec-times", str(tmp_path)], "--energy", "board")
    for bad in ("nan", "-5", "0", "inf"):
        cli_error(["schedule", str(energy_run), "--deadline-ms", "10", "--energy-mj", bad], "energy budget")
    plain = tmp_path / "plain"
    shutil.copytree(exit_run, plain)
    from anytime.tasks.profiling import ProfileSettings, profile_run

    profile_run(plain, ProfileSettings(batch_sizes=(1,), repeats=5, warmup=1, memory=False))
    cli_error(
        ["schedule", str(plain), "--deadline-ms", "10", "--quantile", "0.5", "--energy-mj", "5"],
        "no energy figures",
        "--energy",
    )
