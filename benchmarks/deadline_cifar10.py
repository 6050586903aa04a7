"""Benchmark: the anytime runtime against deadlines on the CIFAR-10 test images, quiet and under load.

The model is the multi-exit ResNet-32 of models/cifar10-resnet32-exits.toml (trained, cached and
calibrated as in early_exit_cifar10.py, but for at most half a point below the last exit on validation
(``--max-drop``, default 0.5): the accuracy target's 1 point is shared by the policy, which gives up accuracy
for time by design, and the scheduler; at early_exit_cifar10's 1 point the policy alone cost 0.8-0.9 points on
test, leaving the scheduler 0.1-0.2). It is profiled on this machine while the machine is quiet. Then, for
each load (quiet, and a process spinning on one of the two cores, started by this benchmark):
  1. hindsight: every exit alone, and the runtime's own answer at every exit (at exit 0 a request the deadline
     stops there; at a deeper exit a request told to go straight there, ``predict_at``), are timed on the first
     of the test images (a seeded random sample of the test split) under that load. This sets the deadlines and
     where the first exit fits. Reported beside the verdict's oracle: the load's oracle, the most accurate exit
     at which the runtime's answer, timed here, has its p99 within the deadline (the verdict's on 2026-11-29);
     the oracle of the exits timed alone (the verdict's until then; at a deadline between an exit's own p99 and
     the runtime's answer there it credits an exit no runtime can answer at in time), and the sure oracle, the
     most accurate exit whose own p99 surely fits (its distribution-free 95% upper confidence bound, the 21st
     largest of 3,000 times);
  2. a sweep of deadlines from below the first exit's p99 to above the last exit's;
  3. at each deadline, every test image is answered one at a time by the runtime with the static profile
     and by the runtime with online adaptation, in turn (so both meet the machine in the same state); a
     miss is an answer later than the deadline, timed around the call. In the deployed conditions (quiet, and
     under load with the threads chosen from it), the runtime's answer at every exit is timed in the same turns,
     on the same images: the verdict's oracle at a deadline is the most accurate exit at which that answer has
     its p99 within the deadline, the best any choice of exit, made in hindsight, got through the runtime in the
     minutes the runtimes were served (exit 0 where none did). A shared machine's moods change from minute to
     minute (one exit's p99 moved by 40% between two profiles minutes apart), and an oracle timed before the
     sweep credited exits that did not fit while the runtimes ran: in the runs of 2026-11-29 the static runtime
     missed 3.1% at a deadline where that oracle put exit 1 within reach. Under load with both torch threads
     the turns cost 30-90 ms each, so that condition keeps the load's oracle.
Targets, wherever the first exit fits: miss rate at most 1% and accuracy within 1 point of the oracle, for
the runtime as deployed (adaptive; under load with the threads it chooses from the load and the profile taken
at that count), quiet and with one core busy. The static runtime is reported beside it: it shows where
adaptation is needed, and is not part of the verdict. The gap to the sure oracle is reported beside the
verdict's, to show how much of a gap lies within the p99's own uncertainty: a deadline a few microseconds above
an exit's measured p99 credits the oracle with an exit that a second timing might put over it; the verdict
against the exits-alone oracle is printed and recorded too (``passed_exit_oracle``). Ratio: the
worst miss rate (%) of the deployed runtime over those deadlines. The first exit fits where the runtime's own
answer at it (the request stopped there by the deadline: stage, head and the runtime's checks), timed in
hindsight beside the exits, surely has its p99 within the deadline (the 95% upper bound, as for the sure
oracle): at a deadline equal to that p99, 1% late is the expected rate and chance decides the target. The worst
miss rate where the measured p99 fits is reported beside it; where only the exit alone fits, no runtime can keep
1%, and the worst miss rate over the deadlines where the exit alone fits is reported too.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import add_exit_run_options, exit_run_dir, parser, prepare_exit_run, report, run

from anytime.data import make_loader
from anytime.plotting import plot_deadline_runs
from anytime.scheduler import AnytimeRunner
from anytime.tasks.profiling import ProfileSettings, profile_run
from anytime.train import load_splits
from anytime.train.runs import load_run
from anytime.utils.io import write_csv
from anytime.utils.stats import quantile_upper_bound
from anytime.utils.threads import choose_threads

# Hyper-parameters
QUANTILE = 0.99  # the latency quantile a stage must fit at before the runtime starts it
MAX_DROP = 0.5  # calibration: accuracy points below the last exit (validation); the other half of the target's point is the scheduler's
PROFILE_REPEATS = 1000  # profile samples per step (a p99 from 1000, not from the 2nd largest of 200)
DEADLINES = 10  # deadlines per load, geometric from 0.8x the first exit's p99 to 1.3x the last exit's
MISS_TARGET = 0.01  # at most 1% of answers late
ACCURACY_TARGET = 0.01  # within 1 point of the hindsight oracle
HOG_CORE = 1  # the core the competing process spins on
WARMUP_REQUESTS = 50  # unscored requests before the sweep of each load
NOTHING_FITS_MS = 1e-6  # a deadline that stops every request at the first exit
EXACT = 1e-9  # a gap of exactly 1 point (e.g. 0.879 - 0.869 in floats: 0.01000000000000001) is within 1 point


def _spin(core: int, ready: Any) -> None:
    try:
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError):
        pass
    ready.set()
    while True:
        pass


def _test_images(run_dir: Path, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    config = load_run(run_dir).config
    splits = load_splits(config)
    # A random sample: the test split is stored class by class, so its first 1,000 images are all airplanes.
    loader = make_loader(splits.test.sample(count, seed=0), splits.info, batch_size=500, train=False, seed=0)
    images, labels = zip(*loader)
    return torch.cat(images), torch.cat(labels)


def _answers_at(runner: AnytimeRunner, steps: int) -> list[Callable[[torch.Tensor], Any]]:
    """The runtime's answer at each exit: at exit 0 a request that a deadline nothing fits stops there, at exits
    1..K-1 a request told to go straight there (``predict_at``)."""
    return [lambda x: runner.predict(x, NOTHING_FITS_MS)] + [
        lambda x, k=k: runner.predict_at(x, k) for k in range(1, steps)
    ]


def _hindsight(model: torch.nn.Module, runner: AnytimeRunner, images: torch.Tensor, count: int) -> np.ndarray:
    """Latencies (ms) on ``count`` images one at a time, all in alternating order: rows 0..K-1 every exit alone,
    row K the runtime's answer at the first exit (a deadline nothing fits stops the request there), rows K+1..2K-1
    the runtime's answer at exits 1..K-1 when told to go straight there (``predict_at``). An exit alone is timed
    inside inference mode, as the profile times it; the runtime is called from outside it, as a server calls it
    (inside, it would pay for entering inference mode again: about 30 us here)."""
    steps = model.num_steps  # type: ignore[union-attr]
    calls = _answers_at(runner, steps)
    times = np.zeros((steps + len(calls), count))
    for i in range(count):
        x = images[i : i + 1]
        for j in range(len(times)) if i % 2 == 0 else range(len(times) - 1, -1, -1):
            if j < steps:
                with torch.inference_mode():
                    start = time.perf_counter()
                    model.forward_until(x, j)  # type: ignore[operator]
                    times[j, i] = 1000 * (time.perf_counter() - start)
            else:
                start = time.perf_counter()
                calls[j - steps](x)
                times[j, i] = 1000 * (time.perf_counter() - start)
    return times


def _serve(runners: dict[str, AnytimeRunner], images: torch.Tensor, labels: torch.Tensor, deadline: float,
           answers: list[Callable[[torch.Tensor], Any]] | None = None) -> tuple[dict[str, dict[str, Any]], np.ndarray | None]:  # fmt: skip
    """Every image answered by every runner in turn (the order alternating), so that they share the machine's
    moods; per runner: miss rate, accuracy, exit shares, stop reasons, mean and p99 time per answer. With
    ``answers`` (the runtime's answer at each exit), each is timed in the same turns too: their latencies (ms),
    a row per exit."""
    names = list(runners)
    answers = answers or []
    turns: list[str | int] = [*names, *range(len(answers))]
    times = np.zeros((len(answers), len(images)))
    steps = next(iter(runners.values())).profile.num_steps
    late = dict.fromkeys(names, 0)
    correct = dict.fromkeys(names, 0)
    exits = {name: np.zeros(steps) for name in names}
    reasons: dict[str, dict[str, int]] = {name: {} for name in names}
    elapsed = {name: np.zeros(len(images)) for name in names}
    for i in range(len(images)):
        x = images[i : i + 1]
        for name in turns if i % 2 == 0 else turns[::-1]:
            if isinstance(name, int):
                start = time.perf_counter()
                answers[name](x)
                times[name, i] = 1000 * (time.perf_counter() - start)
                continue
            start = time.perf_counter()
            out = runners[name].predict(x, deadline)
            elapsed[name][i] = 1000 * (time.perf_counter() - start)
            late[name] += elapsed[name][i] > deadline
            correct[name] += int(out.predictions[0] == labels[i])
            exits[name][out.step] += 1
            reasons[name][out.reason] = reasons[name].get(out.reason, 0) + 1
    n = len(images)
    served = {name: {"miss_rate": late[name] / n, "accuracy": correct[name] / n, "exit_share": (exits[name] / n).tolist(),
                   "reasons": {k: v / n for k, v in reasons[name].items()},
                   "p99_ms": float(np.quantile(elapsed[name], 0.99)), "mean_ms": float(elapsed[name].mean())}
            for name in names}  # fmt: skip
    return served, times if answers else None


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    add_exit_run_options(p)
    p.add_argument("--images", type=int, default=1000, help="test images answered per deadline and runtime")
    p.add_argument(
        "--hindsight-images",
        type=int,
        default=3000,
        help="test images timed per exit for the oracle (default 3000: a p99 from the 30th largest)",
    )
    p.add_argument(
        "--no-policy", action="store_true", help="no confident early exits: go as deep as the deadline allows"
    )
    p.add_argument(
        "--max-drop",
        type=float,
        default=MAX_DROP,
        help=f"calibrate the policy for at most this many points below the last exit (default {MAX_DROP})",
    )
    args = p.parse_args()
    run_dir = exit_run_dir(args.run, args.quick, args.card)
    count, hindsight_count = (60, 300) if args.quick else (args.images, args.hindsight_images)
    deadlines_per_load = 4 if args.quick else DEADLINES
    _, best, chosen = prepare_exit_run(run_dir, args.quick, max_drop=args.max_drop, card_path=args.card)
    default_threads = torch.get_num_threads()
    profiles = {}
    for threads in dict.fromkeys((default_threads, 1)):
        print(f"profiling {run_dir} on the quiet machine ({PROFILE_REPEATS} repeats at batch 1, {threads} threads)...")
        profiles[threads] = profile_run(
            run_dir,
            ProfileSettings(
                batch_sizes=(1,),
                repeats=200 if args.quick else PROFILE_REPEATS,
                memory=False,
                threads=threads,
                form=args.form,
            ),
            out=run_dir / f"profile-batch1-{threads}threads.json",
        )
    profile, profile_path = profiles[default_threads]
    loaded = load_run(run_dir, form=args.form)
    model = loaded.model
    policy = None if args.no_policy else chosen.policy
    images, labels = _test_images(run_dir, max(count, hindsight_count))
    with torch.inference_mode():
        logits = torch.cat([model.forward_all(images[i : min(i + 250, count)]) for i in range(0, count, 250)], dim=1)  # type: ignore[operator]
    step_accuracy = (logits.argmax(dim=2) == labels[:count]).double().mean(dim=1).numpy()
    print(f"{'no policy' if policy is None else f'{best} policy {policy.thresholds}'}; exits' accuracy on the {count} images: "
          f"{[round(100 * float(a), 2) for a in step_accuracy]}")  # fmt: skip
    rows: list[dict[str, Any]] = []
    loads: dict[str, Any] = {}
    for load, auto in (("quiet", False), ("one core busy", False), ("one core busy", True)):
        hog = None
        torch.set_num_threads(default_threads)
        if load != "quiet":
            context = multiprocessing.get_context("spawn")
            ready = context.Event()
            hog = context.Process(target=_spin, args=(HOG_CORE, ready), daemon=True)
            hog.start()
            ready.wait(timeout=60)
        try:
            threads = default_threads
            if auto:  # what the runtime chooses from the load it sees, and the profile taken at that count
                choice = choose_threads()
                threads = choice.threads
                print(f"{load}: {choice.busy_cores:.2f} of {choice.cores} cores busy -> {threads} thread(s)")
                load = f"{load}, auto threads"
            torch.set_num_threads(threads)
            profile = profiles[threads][0] if threads in profiles else profiles[default_threads][0]
            first = AnytimeRunner(
                model, profile, policy, quantile=QUANTILE, adapt=True
            )  # as deployed: its path costs most
            times = _hindsight(model, first, images, hindsight_count)
            steps = profile.num_steps
            p99_all = np.quantile(times, QUANTILE, axis=1, method="inverted_cdf")
            p99, runtime_first_p99 = p99_all[:steps], float(p99_all[steps])
            # The runtime's own answer at each exit: the first answer at exit 0, straight there at the others.
            runtime_p99 = np.concatenate([[runtime_first_p99], p99_all[steps + 1 :]])
            p99_upper = np.array([quantile_upper_bound(t, QUANTILE) for t in times[:steps]])
            runtime_first_upper = quantile_upper_bound(times[steps], QUANTILE)
            deadlines = np.geomspace(0.8 * p99[0], 1.3 * p99[-1], deadlines_per_load)
            loads[load] = {"threads": threads, "exit_p99_ms": p99.tolist(), "exit_p99_upper95_ms": p99_upper.tolist(),
                           "exit_p50_ms": np.median(times[:steps], axis=1).tolist(), "runtime_p99_ms": runtime_p99.tolist(),
                           "runtime_p50_ms": np.median(times[steps:], axis=1).tolist(),
                           "runtime_first_exit_p99_ms": runtime_first_p99, "runtime_first_exit_p99_upper95_ms": runtime_first_upper,
                           "runtime_first_exit_p50_ms": float(np.median(times[steps]))}  # fmt: skip
            print(f"{load}: exits' p99 alone {np.round(p99, 3).tolist()} ms, the runtime's answers "
                  f"{np.round(runtime_p99, 3).tolist()} ms (profile at {profile.settings['threads']} threads: "
                  f"{[round(profile.step_quantile(k, QUANTILE), 3) for k in range(profile.num_steps)]})")  # fmt: skip
            runners = {mode: AnytimeRunner(model, profile, policy, quantile=QUANTILE, adapt=mode == "adaptive")
                       for mode in ("static", "adaptive")}  # fmt: skip
            # A server runs continuously: requests before the sweep (not scored) warm the caches and let the
            # adaptive runtime learn the device's current speed.
            _serve(runners, images[:WARMUP_REQUESTS], labels[:WARMUP_REQUESTS], float(deadlines[-1]))
            # Timed beside the runtimes where a turn costs milliseconds: the deployed conditions.
            answers = _answers_at(first, steps) if load == "quiet" or auto else None
            for deadline in deadlines:
                fits = p99 <= deadline
                first_fits_point = runtime_first_p99 <= deadline
                first_fits = runtime_first_upper <= deadline
                reach = runtime_p99 <= deadline
                load_oracle = float(step_accuracy[reach].max()) if reach.any() else None
                # Where the runtime's own first answer fits, exit 0 is within reach even if, timed alone under
                # load, its p99 came out higher (a noisy p99 under load).
                exit_oracle = (
                    float(step_accuracy[fits].max())
                    if fits.any()
                    else None
                    if load_oracle is None
                    else float(step_accuracy[0])
                )
                sure = p99_upper <= deadline
                sure_oracle = (
                    float(step_accuracy[sure].max())
                    if sure.any()
                    else None
                    if load_oracle is None
                    else float(step_accuracy[0])
                )
                served, answer_times = _serve(runners, images[:count], labels[:count], float(deadline), answers)
                oracle, now_p99 = load_oracle, None
                if answer_times is not None:
                    now_p99 = np.quantile(answer_times, QUANTILE, axis=1, method="inverted_cdf")
                    # The runtime always answers: at exit 0 at least, whatever its p99 in these minutes.
                    oracle = (
                        float(step_accuracy[now_p99 <= deadline].max())
                        if (now_p99 <= deadline).any()
                        else float(step_accuracy[0])
                    )
                for mode, result in served.items():
                    condition = f"{load}, {mode}"
                    rows.append({"condition": condition, "load": load, "adaptive": mode == "adaptive",
                                 "deadline_ms": float(deadline), "first_exit_fits": bool(first_fits),
                                 "first_exit_fits_point": bool(first_fits_point),
                                 "first_exit_alone_fits": bool(fits[0]),
                                 "oracle_accuracy": oracle, "load_oracle_accuracy": load_oracle,
                                 "exit_oracle_accuracy": exit_oracle, "sure_oracle_accuracy": sure_oracle,
                                 "runtime_p99_now_ms": None if now_p99 is None else now_p99.tolist(), **result})  # fmt: skip
                    gap = "" if oracle is None or load_oracle is None else (
                        f", oracle {100 * oracle:.2f}% (the load's {100 * load_oracle:.2f}%, exits alone "
                        f"{100 * exit_oracle:.2f}%, sure {100 * sure_oracle:.2f}%)")  # fmt: skip
                    print(f"  {condition:<24} deadline {deadline:7.3f} ms: miss {100 * result['miss_rate']:5.2f}%, "
                          f"accuracy {100 * result['accuracy']:.2f}%{gap}, mean {result['mean_ms']:.3f} ms, "
                          f"reasons {({k: round(v, 3) for k, v in result['reasons'].items()})}")  # fmt: skip
        finally:
            torch.set_num_threads(default_threads)
            if hog is not None:
                hog.terminate()
                hog.join()
    out = run_dir / ("deadline-no-policy" if policy is None else "deadline")
    write_csv(
        out / "deadline_cifar10.csv", [{k: v for k, v in r.items() if not isinstance(v, (list, dict))} for r in rows]
    )
    conditions = list(dict.fromkeys(r["condition"] for r in rows))
    plot_deadline_runs(rows, out / "deadline_cifar10", f"{run_dir.name}: anytime runtime vs deadline",
                       conditions=conditions)  # fmt: skip
    verdicts: dict[str, dict[str, Any]] = {}
    for condition in conditions:
        scored = [r for r in rows if r["condition"] == condition and r["first_exit_fits"]]
        point = [r for r in rows if r["condition"] == condition and r["first_exit_fits_point"]]
        alone = [r for r in rows if r["condition"] == condition and r["first_exit_alone_fits"]]
        worst_miss = max((r["miss_rate"] for r in scored), default=float("nan"))
        worst_gap = max((r["oracle_accuracy"] - r["accuracy"] for r in scored), default=float("nan"))
        worst_load_gap = max((r["load_oracle_accuracy"] - r["accuracy"] for r in scored), default=float("nan"))
        worst_exit_gap = max((r["exit_oracle_accuracy"] - r["accuracy"] for r in scored), default=float("nan"))
        worst_sure_gap = max((r["sure_oracle_accuracy"] - r["accuracy"] for r in scored), default=float("nan"))
        worst_point = max((r["miss_rate"] for r in point), default=float("nan"))
        worst_alone = max((r["miss_rate"] for r in alone), default=float("nan"))
        verdicts[condition] = {"deadlines_scored": len(scored), "worst_miss_rate": worst_miss,
                               "worst_accuracy_gap": worst_gap, "worst_load_oracle_gap": worst_load_gap,
                               "worst_exit_oracle_gap": worst_exit_gap, "worst_sure_oracle_gap": worst_sure_gap,
                               "meets_targets_load_oracle": bool(scored) and worst_miss <= MISS_TARGET + EXACT and worst_load_gap <= ACCURACY_TARGET + EXACT,
                               "meets_targets_exit_oracle": bool(scored) and worst_miss <= MISS_TARGET + EXACT and worst_exit_gap <= ACCURACY_TARGET + EXACT,
                               "deadlines_first_exit_fits_point": len(point), "worst_miss_rate_where_first_exit_fits_point": worst_point,
                               "deadlines_exit_alone_fits": len(alone),
                               "worst_miss_rate_where_exit_alone_fits": worst_alone,
                               "meets_targets": bool(scored) and worst_miss <= MISS_TARGET + EXACT and worst_gap <= ACCURACY_TARGET + EXACT}  # fmt: skip
        print(f"{condition:<26} where the first exit fits ({len(scored)} deadlines): worst miss rate "
              f"{100 * worst_miss:.2f}%, worst gap to the oracle {100 * worst_gap:+.2f} points (the load's "
              f"{100 * worst_load_gap:+.2f}, exits alone "
              f"{100 * worst_exit_gap:+.2f}, sure {100 * worst_sure_gap:+.2f}); where its measured p99 fits ({len(point)}): worst miss rate "
              f"{100 * worst_point:.2f}%; where the exit alone fits ({len(alone)}): worst miss rate "
              f"{100 * worst_alone:.2f}%")  # fmt: skip
    # The runtime as deployed: quiet, and under load with the threads it chooses (and the profile at that count).
    deployed = [v for c, v in verdicts.items() if "adaptive" in c and (c.startswith("quiet") or "auto threads" in c)]
    worst = max(v["worst_miss_rate"] for v in deployed)
    # The verdict is the issue's: the runtime as deployed adapts. The static runtime (adaptation off) is the
    # ablation that shows what adaptation is for, reported beside it but not required to keep the targets: with
    # no feedback, a deadline that falls between an exit's profiled p99 and today's misses more than 1%.
    passed = all(v["meets_targets"] for v in deployed)
    passed_exit_oracle = all(v["meets_targets_exit_oracle"] for v in deployed)
    passed_load_oracle = all(v["meets_targets_load_oracle"] for v in deployed)
    print(f"against the load's oracle (timed before the sweep), the deployed runtime "
          f"{'keeps' if passed_load_oracle else 'misses'} the targets; against the oracle of the exits timed alone "
          f"(no runtime's answer costs that little), it {'keeps' if passed_exit_oracle else 'misses'} them")  # fmt: skip
    for condition in (c for c in conditions if c.endswith("static")):
        print(
            f"{condition} (reported, not part of the verdict): the static profile "
            f"{'keeps' if verdicts[condition]['meets_targets'] else 'misses'} the targets"
        )
    print(f"results in {out}")
    figures = {"run": str(run_dir), "profile": str(profile_path), "criterion": None if policy is None else best, "thresholds": None if policy is None else list(policy.thresholds),
               "max_drop": None if policy is None else args.max_drop,
               "images": count, "hindsight_images": hindsight_count, "quantile": QUANTILE, "threads": default_threads, "form": args.form,
               "step_accuracy": step_accuracy.tolist(), "loads": loads, "verdicts": verdicts,
               "passed_load_oracle": passed_load_oracle, "passed_exit_oracle": passed_exit_oracle, "rows": rows}  # fmt: skip
    return report(
        "deadline_cifar10",
        args,
        figures,
        100 * worst,
        "<= 1 (% late, adaptive, quiet and under load with auto threads, where the first exit fits)",
        passed,
    )


if __name__ == "__main__":
    run(main)
