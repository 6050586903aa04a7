"""``anytime profile``: measure every step of a run (or an export) on this device: latency quantiles per batch
size, FLOPs, memory and optionally energy, the runtime's own answers and the serving overhead; or compare two
profiles; or write a board's profile from TensorRT's timings."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from anytime.commands.options import (
    FORM_HELP,
    THREADS_HELP,
    add_device,
    add_emulate_slowdown,
    add_form,
    add_json,
    add_out,
    add_threads,
    finite_float,
    int_at_least,
    ms_or_off,
    non_negative_int,
    positive_int,
    share_or_off,
)
from anytime.commands.output import print_json
from anytime.errors import AnytimeError
from anytime.utils.outputs import check_output_file, output_lock

SUMMARY = "measure every step's latency (p50/p90/p99), FLOPs and memory on this device, or compare two profiles"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime profile``: what is timed, how, where it goes, energy, and a board's timings."""
    parser.usage = "anytime profile RUN [options] | anytime profile --compare A.json B.json"
    parser.add_argument("run", metavar="RUN", nargs="?", help="a finished run directory, or an export (anytime export)")
    parser.add_argument("--batch-sizes", default="1,8,16,32", metavar="B,B,...", help="default 1,8,16,32")
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=200,
        metavar="N",
        help="timed repetitions per batch size (default 200; a p99 needs at least 100)",
    )
    parser.add_argument("--warmup", type=non_negative_int, default=10, metavar="N", help="untimed repetitions first")
    add_device(parser)
    add_threads(parser, "torch CPU threads (default: torch's; " + THREADS_HELP + "); recorded, and run by the runtime")
    add_form(parser, FORM_HELP + "; recorded, and run by the runtime")
    _add_conditions(parser)
    parser.add_argument("--train", action="store_true", help="also time a training mini-batch (forward, backward)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    add_out(parser, "default RUN/profile-<device>.json", metavar="FILE")
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two profiles side by side")
    _add_energy(
        parser.add_argument_group(
            "energy per inference (RAPL on an x86 CPU, NVML on an NVIDIA GPU, a Jetson's power rails)"
        )
    )
    add_json(parser, "print the summary as JSON")
    _add_trtexec(parser.add_argument_group("timings from a board (an ONNX export timed by TensorRT's trtexec)"))


def _add_conditions(parser: argparse.ArgumentParser) -> None:
    """How the steps run while timed, and what else is timed: SACT's execution, a slower board, idle gaps, the
    runtime's answers, serving, text lengths, suffixes, and the steadiness the profile must show."""
    parser.add_argument(
        "--execution",
        choices=["sparse", "dense"],
        help="SACT runs: compute only the positions still active (sparse) or every unit everywhere "
        "(dense, the default); timed on the run's validation images either way",
    )
    add_emulate_slowdown(
        parser,
        "runs with exits or ensembles: emulate a board F times slower than this machine (each "
        "segment waits F-1 times its own time); for anytime split-run --emulate-slowdown F",
    )
    parser.add_argument(
        "--gap-ms",
        type=finite_float,
        default=0.0,
        metavar="MS",
        help="idle this long before every timed repetition, as a server idles between sporadic "
        "requests (default 0: back to back)",
    )
    parser.add_argument(
        "--answer-gap-ms",
        type=ms_or_off,
        default=5.0,
        metavar="MS|off",
        help="then time the runtime's own answers at every step (what the scheduler and the runtime "
        "price options with), each after an idle gap of this mean, exponential as Poisson "
        "arrivals (default 5; 0: back to back; off: no answer prices)",
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="then serve the run on 127.0.0.1 and time what a client waits beyond the server's own "
        "count (HTTP parsing, the answer's serialisation and sending), kept in the profile: "
        "anytime serve keeps its quantile free at the end of every deadline",
    )
    parser.add_argument(
        "--length",
        metavar="T[,T2...]",
        help="text runs: time sentences of T tokens (default the run's maximum length), one profile "
        "per length bucket, RUN/profile-<device>-T<T>.json each",
    )
    parser.add_argument(
        "--suffixes",
        action="store_true",
        help="runs with exits or ensembles: also time the stages after each partition point, started "
        "from a stored activation after the --gap-ms idle, as a split-computing server runs them "
        "(anytime split prices the server's part from them)",
    )
    parser.add_argument(
        "--steady-within",
        type=share_or_off,
        default=0.25,
        metavar="S|off",
        help="take the profile again (3 in all, the steadiest kept) when the tails of the repetitions' "
        "two halves part by more than this share: other work came and went (default 0.25)",
    )


def _add_energy(group: argparse._ArgumentGroup) -> None:
    """Energy per inference: whether to measure it, and the windows it is measured over."""
    group.add_argument(
        "--energy",
        action="store_true",
        help="also measure joules per inference of every step at every batch size (refused, naming what "
        "was tried, where no energy source is readable)",
    )
    group.add_argument(
        "--energy-windows",
        type=int_at_least(2),
        default=20,
        metavar="N",
        help="measurement windows per step and batch size (default 20)",
    )
    group.add_argument(
        "--energy-window-s",
        type=float,
        default=0.25,
        metavar="S",
        help="a window's shortest length (default 0.25 s; longer where the counter is coarse)",
    )
    group.add_argument(
        "--energy-max-window-s",
        type=float,
        default=20.0,
        metavar="S",
        help="a window's longest length before the counter is called too coarse (default 20 s)",
    )
    group.add_argument(
        "--idle-s",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds of idle power measured first, recorded as the baseline (default 1; 0 skips)",
    )


def _add_trtexec(group: argparse._ArgumentGroup) -> None:
    """A profile written from TensorRT's timings on a board, instead of measured here."""
    group.add_argument(
        "--trtexec-times",
        metavar="DIR",
        help="DIR/<artifact>.json from `trtexec --onnx=<artifact>.onnx --exportTimes=<artifact>.json`, one per "
        "artifact of the export RUN: written as its profile instead of measuring here",
    )
    group.add_argument(
        "--engine-precision",
        choices=["fp32", "fp16", "int8"],
        help="what the engines were built for (trtexec --fp16/--int8; default the export's)",
    )
    group.add_argument(
        "--device-label",
        default="TensorRT (trtexec)",
        metavar="TEXT",
        help="the board, as the profile names it (e.g. 'Jetson Orin Nano 15W')",
    )
    group.add_argument(
        "--trtexec-batch", type=positive_int, default=1, metavar="B", help="the engines' batch size (default 1)"
    )


def run(args: argparse.Namespace) -> int:
    """Profile the run (each --length bucket apart) and print the figures; or compare two profiles; or write a
    board's profile from trtexec's timings."""
    from anytime.profile import DeviceProfile

    if args.compare:
        if args.run:
            raise AnytimeError("give either RUN (to profile it) or --compare A.json B.json, not both")
        a, b = (DeviceProfile.load(p) for p in args.compare)
        return _compare_profiles(a, b, args.compare)
    if not args.run:
        raise AnytimeError("give a run directory to profile (anytime profile RUN) or --compare A.json B.json")
    if args.trtexec_times:
        if args.energy:
            raise AnytimeError("--energy measures on this machine; trtexec's timings come from the board, so measure "
                               "energy there (anytime profile RUN --energy on the board)")  # fmt: skip
        return _trtexec_profile(args)
    from anytime.profile.energy import EnergySettings
    from anytime.tasks.profiling import ProfileSettings, profile_run

    energy = None
    if args.energy:
        energy = EnergySettings(args.energy_windows, args.energy_window_s, args.energy_max_window_s, idle_s=args.idle_s)
    for length in _lengths(args):
        profile, path = profile_run(
            args.run,
            ProfileSettings(
                batch_sizes=_batch_sizes(args.batch_sizes),
                repeats=args.repeats,
                warmup=args.warmup,
                train=args.train,
                memory=not args.no_memory,
                form=args.form,
                threads=args.threads,
                energy=energy,
                execution=args.execution,
                slowdown=args.emulate_slowdown,
                gap_ms=args.gap_ms,
                suffixes=args.suffixes,
                length=length,
                steady_within=args.steady_within,
                answer_gap_ms=args.answer_gap_ms,
            ),
            device=args.device,
            out=args.out,
            progress=sys.stderr.isatty(),
        )
        if args.serve:
            from anytime.serve.overhead import measure_serving_overhead

            profile = replace(profile, serving=measure_serving_overhead(args.run, profile=path))
            profile.save(path)
        if not args.json:
            _print_profile(profile, path)
        steady = profile.settings["steadiness"]
        if args.steady_within is not None and steady["spread"] > args.steady_within:
            print(f"note: the machine was not steady while profiling ({steady['where']}; {steady['attempts']} "
                  "profiles taken, the steadiest kept); profile again when it is quiet, or serve with the runtime's "
                  "adaptation on", file=sys.stderr)  # fmt: skip
    if args.json:
        summary = profile.to_dict()
        for batch in summary["batches"]:
            for block in (
                batch["steps"],
                batch["stages"] or [],
                batch.get("answers", []),
                batch.get("answer_paths", []),
            ):
                for entry in block:
                    entry.pop("samples_ms")
        return print_json(summary)
    return 0


def _lengths(args: argparse.Namespace) -> list[int | None]:
    """The --length buckets to profile one by one (None: the run's maximum length, or not a text run)."""
    lengths: list[int | None] = [None]
    if args.length is not None:
        try:
            lengths = [positive_int(v.strip()) for v in str(args.length).split(",") if v.strip()] or [None]
        except argparse.ArgumentTypeError as exc:
            raise AnytimeError(f"--length takes token counts, e.g. 16,32,64: {exc}") from None
        if len(lengths) > 1 and args.out:
            raise AnytimeError("several --length buckets make one profile each; leave --out out (each goes to "
                               "RUN/profile-<device>-T<length>.json)")  # fmt: skip
    return lengths


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise AnytimeError(f"--batch-sizes '{text}' is not a comma-separated list of whole numbers") from None
    if not sizes or min(sizes) < 1:
        raise AnytimeError(f"--batch-sizes '{text}' must list positive batch sizes, e.g. 1,8,16,32")
    return sizes


def _print_profile(profile: Any, path: Path) -> None:
    from anytime.profile import quantile_of

    d = profile.device
    power = f", power mode {d['jetson_power_mode']}" if d.get("jetson_power_mode") else ""
    steady = profile.settings.get("steadiness")
    halves = (
        ""
        if not steady
        else (
            f", halves within {100 * steady['spread']:.0f}%"
            + (f" ({steady['attempts']} profiles taken)" if steady["attempts"] > 1 else "")
        )
    )
    print(f"{profile.model} ({profile.model_fingerprint}) on {d.get('label')} [{d.get('type')}], "
          f"{profile.settings.get('threads')} threads{power}, {profile.settings.get('repeats')} repeats"
          f"{halves}")  # fmt: skip
    for b in profile.batch_sizes:
        _print_batch(profile, b)
    if profile.serving is not None:
        print(f"serving: a client here waits {quantile_of(profile.serving, 0.5):.3f} ms (p50), "
              f"{quantile_of(profile.serving, 0.99):.3f} ms (p99) beyond the server's own count "
              f"({profile.serving.size} requests); anytime serve keeps that quantile free")  # fmt: skip
    if profile.energy is not None:
        e = profile.energy
        idle = f", idle {e.idle_w:.3g} W" if e.idle_w is not None else ""
        mode = f", {e.source.power_mode}" if e.source.power_mode else ""
        print(f"energy: {e.source.reader} ({e.source.detail}){mode}{idle}, {e.settings.windows} windows per figure")
    else:
        print("energy: not measured (anytime profile RUN --energy)")
    print(f"saved to {path}")


def _print_batch(profile: Any, b: int) -> None:
    """One batch size of a profile: memory, training, and every step's latency (and energy) quantiles."""
    from anytime.profile import quantile_of

    at = profile.at(b)
    mem = (
        f", peak memory {at.memory['peak_mb']:.0f} MB ({at.memory['activations_mb']:.1f} MB in the forward)"
        if at.memory
        else ""
    )
    train = (f", train fwd {1000 * at.training['forward_p50_s']:.2f} ms "
             f"bwd {1000 * at.training['backward_p50_s']:.2f} ms" if at.training else "")  # fmt: skip
    print(f"batch {b}{mem}{train}")
    priced = at.answers is not None
    print(f"  {'step':<8} {'GFLOPs':>8} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9}"
          + (f" {'stage p99':>10}" if at.stages else "") + (f" {'answer p99':>11}" if priced else "")
          + (f" {'via heads':>10}" if at.answer_paths else ""))  # fmt: skip
    for k, name in enumerate(profile.step_names):
        q = [profile.step_quantile(k, v, b) for v in (0.5, 0.9, 0.99)]
        stage = f" {profile.stage_quantile(k, 0.99, b):10.3f}" if at.stages else ""
        answer = f" {quantile_of(profile.answer_samples(k, b), 0.99):11.3f}" if priced else ""
        heads = f" {quantile_of(profile.answer_path_samples(k, b), 0.99):10.3f}" if at.answer_paths else ""
        gflops = profile.step_flops[k] / 1e9
        print(f"  {name:<8} {gflops:8.4f} {q[0]:9.3f} {q[1]:9.3f} {q[2]:9.3f}{stage}{answer}{heads}")
    if at.energy is not None:
        print(
            f"  {'step':<8} {'mJ mean':>9} {'mJ p50':>9} {'mJ p99':>9} {'power W':>8}"
            + (f" {'path mJ':>9}" if at.energy.paths else "")
        )
        for k, name in enumerate(profile.step_names):
            w = at.energy.steps[k]
            path_mj = f" {1000 * at.energy.paths[k].mean_j:9.4g}" if at.energy.paths else ""
            print(f"  {name:<8} {1000 * w.mean_j:9.4g} {1000 * w.quantile_j(0.5):9.4g} "
                  f"{1000 * w.quantile_j(0.99):9.4g} {w.power_w:8.3g}{path_mj}")  # fmt: skip


def _trtexec_profile(args: argparse.Namespace) -> int:
    from anytime.profile.store import PROFILE_FORMAT
    from anytime.profile.trtexec import trtexec_profile

    profile = trtexec_profile(args.run, args.trtexec_times, batch_size=args.trtexec_batch,
                              device_label=args.device_label, engine_precision=args.engine_precision)  # fmt: skip
    default = Path(args.run) / "profile-tensorrt.json"
    target = check_output_file(Path(args.out) if args.out else default, what="profile", format_tag=PROFILE_FORMAT,
                               create_parents=False, example="profile.json")  # fmt: skip
    with output_lock(target):
        path = profile.save(target)
    _print_profile(profile, path)
    return 0


def _compare_profiles(a: Any, b: Any, paths: list[str]) -> int:
    if a.num_steps != b.num_steps:
        raise AnytimeError(f"{paths[0]} has {a.num_steps} steps and {paths[1]} has {b.num_steps}: not the same model")
    for tag, path, p in (("A", paths[0], a), ("B", paths[1], b)):
        print(
            f"{tag}: {path}: {p.device.get('label')} [{p.device.get('type')}], {p.settings.get('threads')} threads, "
            f"torch {p.device.get('torch')}"
        )
    if a.model_fingerprint != b.model_fingerprint:
        print(f"note: different weights ({a.model_fingerprint} vs {b.model_fingerprint}); latencies compare, "
              "accuracies may not")  # fmt: skip
    common = [s for s in a.batch_sizes if s in b.batch_sizes]
    if not common:
        raise AnytimeError(f"the profiles share no batch size ({list(a.batch_sizes)} vs {list(b.batch_sizes)})")
    for size in common:
        print(f"batch {size}")
        print(f"  {'step':<8} {'A p50':>9} {'B p50':>9} {'A p99':>9} {'B p99':>9} {'B/A p99':>8}")
        for k, name in enumerate(a.step_names):
            a50, b50 = a.step_quantile(k, 0.5, size), b.step_quantile(k, 0.5, size)
            a99, b99 = a.step_quantile(k, 0.99, size), b.step_quantile(k, 0.99, size)
            ratio = b99 / a99 if a99 > 0 else float("nan")
            print(f"  {name:<8} {a50:9.3f} {b50:9.3f} {a99:9.3f} {b99:9.3f} {ratio:8.2f}")
        if a.at(size).energy is not None and b.at(size).energy is not None:
            print(f"  {'step':<8} {'A mJ':>9} {'B mJ':>9} {'B/A mJ':>8}")
            for k, name in enumerate(a.step_names):
                ea, eb = 1000 * a.step_energy_j(k, size), 1000 * b.step_energy_j(k, size)
                print(f"  {name:<8} {ea:9.4g} {eb:9.4g} {eb / ea if ea > 0 else float('nan'):8.2f}")
    return 0
