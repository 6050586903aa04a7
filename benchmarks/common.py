"""What every benchmark shares: arguments, the machine record, the --json report and the results folder."""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anytime.errors import AnytimeError
from anytime.utils.io import write_json
from anytime.utils.machine import describe_machine, git_sha
from anytime.utils.memory import allocator_state, hold_freed_memory

if TYPE_CHECKING:
    from anytime.tasks.calibration import CalibrationReport

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"  # RESULTS/<machine>/<benchmark>.json: the latest full run per machine
EXITS_CARD = REPO / "models" / "cifar10-resnet32-exits.toml"


def parser(description: str) -> argparse.ArgumentParser:
    """The benchmark contract: ``python benchmarks/NAME.py [--quick] [--json PATH]``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer repeats: a smoke run, not figures to record")
    p.add_argument("--json", metavar="PATH", help="write the ratios with their target and verdict")
    return p


def median(values: list[float]) -> float:
    """The median of a list of measurements."""
    return float(statistics.median(values))


def machine_name(machine: dict[str, Any]) -> str:
    """The folder a machine's results go in: its CPU model and core count, and its GPU where it has one (a
    host name says nothing about speed and changes with every lease)."""
    parts = [str(machine.get("cpu_model") or "cpu"), f"{machine.get('cpu_count') or 0}c"]
    if machine.get("gpu"):
        parts.append(str(machine["gpu"]))
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


def report(
    name: str,
    args: argparse.Namespace,
    figures: dict[str, Any],
    ratio: float,
    target: str,
    passed: bool | None,
    *,
    results: Path = RESULTS,
) -> int:
    """Print the verdict and write the whole report: a full run (not ``--quick``) to ``results/<machine>/NAME.json``,
    where ``benchmarks/page.py`` renders it into ``docs/benchmarks.md``, and to ``--json PATH`` if given. Exit status 0
    either way (a figure, not a test). ``passed=None``: a comparison with no target, reported as "info"."""
    verdict = "info" if passed is None else "pass" if passed else "fail"
    print(f"{name}: ratio {ratio:.3f} (target {target}): {verdict}")
    machine = describe_machine()
    document = {
        "benchmark": name, "ratio": ratio, "target": target, "verdict": verdict, "figures": figures,
        "quick": args.quick, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(), "machine": machine, "allocator": allocator_state(),
    }  # fmt: skip
    if not args.quick:
        recorded = results / machine_name(machine) / f"{name}.json"
        recorded.parent.mkdir(parents=True, exist_ok=True)
        write_json(recorded, document)
        print(f"recorded in {recorded.relative_to(REPO) if recorded.is_relative_to(REPO) else recorded}; "
              "render the page with `python benchmarks/page.py`")  # fmt: skip
    if args.json:
        write_json(args.json, document)
        print(f"report written to {args.json}")
    return 0


def run(main: Callable[[], int]) -> None:
    """Run a benchmark's main, turning a user error into one line and exit status 2. Freed memory is held in the
    process first (:func:`anytime.utils.memory.hold_freed_memory`), as the profiler and the runtime hold it:
    otherwise what a timing pays in page faults depends on what the process allocated before it."""
    hold_freed_memory()
    try:
        code = main()
    except AnytimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    raise SystemExit(code)


def add_exit_run_options(p: argparse.ArgumentParser) -> None:
    """``--card`` (the multi-exit recipe, default the ResNet-32 card), ``--run`` (default runs/CARD), ``--form``
    (the inference form timed) and ``--threads``."""
    p.add_argument("--card", type=Path, default=EXITS_CARD, help="the multi-exit card to train if --run is not there")
    p.add_argument("--run", type=Path, help="run directory (default runs/CARD_NAME)")
    p.add_argument("--form", default="eager", help="inference form timed (eager, fold, fold+channels-last...)")
    p.add_argument("--threads", type=int, help="torch threads for the timing (default torch's: one per core)")


def exit_run_dir(run_dir: Path | None, quick: bool, card: Path = EXITS_CARD) -> Path:
    """The multi-exit CIFAR-10 run a benchmark uses: ``--run`` (default runs/CARD_NAME), or its ``-quick``
    sibling in quick mode."""
    run_dir = run_dir if run_dir is not None else REPO / "runs" / card.stem
    return run_dir.with_name(run_dir.name + "-quick") if quick else run_dir


def train_card(run_dir: Path, quick: bool, card_path: Path) -> dict[str, Any]:
    """Train the card ``card_path`` into ``run_dir`` unless it is there (resuming an interrupted run) and return the
    run's summary. Quick mode trains 1 epoch on 2000 samples: a smoke run, not figures."""
    import json

    from anytime.train import Trainer, load_card
    from anytime.train.records import CHECKPOINT

    card = load_card(card_path)
    config = card.config.replace(epochs=1, limit_train=2000) if quick else card.config
    if not (run_dir / "model.safetensors").is_file():
        resume = (run_dir / CHECKPOINT).is_file()
        print(f"{'resuming' if resume else 'training'} {card.name} in {run_dir} ({config.epochs} epochs)...")
        Trainer(config, run_dir, extra_config={"card": str(card_path)}).fit(resume=resume)
    return json.loads((run_dir / "summary.json").read_text())


def prepare_exit_run(
    run_dir: Path, quick: bool, *, max_drop: float, card_path: Path = EXITS_CARD, combine: bool = False
) -> tuple[dict[str, CalibrationReport], str, CalibrationReport]:
    """Train the card ``card_path`` (default models/cifar10-resnet32-exits.toml) into ``run_dir`` if it is not there
    (resuming an interrupted run), then :func:`calibrate_criteria`. Quick mode trains 1 epoch on 2000 images: a smoke
    run, not figures."""
    train_card(run_dir, quick, card_path)
    return calibrate_criteria(run_dir, max_drop=max_drop, combine=combine)


def calibrate_criteria(
    run_dir: Path, *, max_drop: float, combine: bool = False
) -> tuple[dict[str, CalibrationReport], str, CalibrationReport]:
    """Cache a trained run's exit outputs on validation and test (unless cached from these weights), and calibrate
    every criterion on validation for at most ``max_drop`` points below the last exit (with ``combine``, every
    criterion that scores combined exits); the criterion with the fewest validation FLOPs becomes
    ``RUN/calibration.json``. Returns every criterion's report, the chosen one's name and its report."""
    from anytime.calibrate import CRITERIA, get_criterion
    from anytime.outputs import load_cache
    from anytime.scheduler.query import run_fingerprint
    from anytime.tasks.calibration import CalibrationSettings, calibrate_run
    from anytime.tasks.collect import collect_run

    fingerprint = run_fingerprint(run_dir)
    for split in ("val", "test"):
        try:
            load_cache(run_dir, split, fingerprint=fingerprint)
        except AnytimeError:  # missing, or from other weights
            collect_run(run_dir, split)
    criteria = [c for c in CRITERIA if not (combine and get_criterion(c).stateful)]
    candidates = {c: calibrate_run(run_dir, CalibrationSettings(max_drop=max_drop, criterion=c, combine=combine),
                                   out=run_dir / f"calibration-{c}.json") for c in criteria}  # fmt: skip
    best = min(candidates, key=lambda c: candidates[c].validation.result.mean_flops)
    chosen = calibrate_run(run_dir, CalibrationSettings(max_drop=max_drop, criterion=best, combine=combine))
    return candidates, best, chosen


def member_runs(members: str) -> tuple[list[Path], list[Path]]:
    """The float runs named in ``--members`` (comma-separated) and their int8 forms ``RUN-int8`` beside them,
    refused in one line if any is missing."""
    floats = [Path(m) for m in members.split(",") if m.strip()]
    quantized = [m.with_name(f"{m.name}-int8") for m in floats]
    missing = [str(m) for m in floats + quantized if not m.is_dir()]
    if missing:
        raise AnytimeError(f"runs missing: {', '.join(missing)}; train them (models/*.toml) and "
                           "`anytime quantize RUN --precision int8` each")  # fmt: skip
    return floats, quantized


def fuser_share(ensemble_dir: Path, samples: int) -> tuple[float, float]:
    """Median batch-1 ms of an ensemble run's last fuser alone and of its whole last step, interleaved on random
    inputs (the fuser reads the members' answers to the first input)."""
    import numpy as np
    import torch

    from anytime.profile.latency import per_sample_latency
    from anytime.train.runs import load_run

    run = load_run(ensemble_dir)
    model, last = run.model, run.num_steps - 1
    size = run.dataset.get("image_size") or [32, 32]
    inputs = torch.randn(samples, int(run.dataset["in_channels"]), *size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        answers = torch.stack([model.member_answer(inputs[:1], i) for i in range(model.num_steps)])
        fuser = model.bank.fusers[last]
        times = per_sample_latency({"fuser": lambda x: fuser(answers), "ladder": lambda x: model.forward_until(x, last)},
                                   inputs, warmup=20)  # fmt: skip
    return float(np.median(times["fuser"]) * 1000), float(np.median(times["ladder"]) * 1000)


def onnx_programs(
    model: Any, policy: Any, folder: Path, *, input_shape: tuple[int, ...], num_classes: int
) -> tuple[Any, ...]:
    """The multi-exit ``model`` and its plain backbone exported as fp32 ONNX into ``folder`` and loaded back (as many
    ONNX Runtime threads as torch has), ``policy`` compiled into the first and the plain network's argmax into the
    second: (early exit's program, the backbone's program, the multi-exit export, the plain export)."""
    import torch

    from anytime.calibrate import ExitPolicy
    from anytime.deploy.export import ManifestLabels, export_model
    from anytime.deploy.loader import load_export

    exports = []
    for name, part in (("exits", model), ("plain", model.backbone)):
        (folder / name).mkdir()
        export_model(part, "onnx", "fp32", folder / name, input_shape=input_shape,
                     labels=ManifestLabels(name, num_classes))  # fmt: skip
        exports.append(load_export(folder / name, threads=torch.get_num_threads()))
    program, plain = exports[0].exit_program(policy), exports[1].exit_program(ExitPolicy(policy.criterion, ()))
    if program is None or plain is None:
        raise AnytimeError("this policy cannot be compiled into ONNX graphs (a combining or patience policy); "
                           "time it through policy.run instead")  # fmt: skip
    return program, plain, exports[0], exports[1]
