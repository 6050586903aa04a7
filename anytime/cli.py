"""``anytime <command>``: the only module that parses arguments and prints."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from anytime.errors import AnytimeError, PeerStopped

COMMANDS: dict[str, str] = {
    "models": "list the model zoo and torchvision classifiers, with parameter counts",
    "train": "train a model (or a model card), plain or with early exits; record time, memory and accuracy",
    "exits": "show the exits attach_exits puts on a model, with cumulative FLOPs and parameters",
    "collect": "run a trained multi-exit model once over a split and cache every exit's logits",
    "sweep": "sweep exit thresholds over the cached outputs: accuracy, FLOPs, exit shares, Pareto front",
    "calibrate": "fit exit thresholds on validation for an accuracy drop or a FLOPs budget (RUN/calibration.json)",
    "evaluate": "real early exit on a split: accuracy, exit shares, latency per sample vs the plain backbone",
    "plot": "plot a multi-exit run: accuracy vs cost, vs threshold, exit histogram, per-exit accuracy, deadlines",
    "cam": "class activation maps of every step (CAM for global-pooled heads, Grad-CAM otherwise) for the same images: "
    "a figure side by side and the arrays",
    "ponder": "maps of the residual units a SACT run spends at every position of an image, at each halting threshold",
    "profile": "measure every step's latency (p50/p90/p99), FLOPs and memory on this device, or compare two profiles",
    "schedule": "the most accurate step or early-exit policy that meets a deadline on a profiled device (JSON)",
    "cut": "cut residual links or skip blocks of a trained ResNet: accuracy and latency (CSV, plots), or a ladder run",
    "quantize": "a run's steps at another precision (int8, int8-dynamic, bf16, fp16), as a run the pipeline takes",
    "export": "deployable artifacts of a run's steps (torch.export .pt2 or ONNX), a manifest and the parity table",
    "ensemble": "an ensemble of trained runs (any architecture, any precision) fused after each member, as a run",
    "ensemble-baseline": "torchensemble's fusion, voting, bagging, gradient boosting or snapshot ensemble, as a run",
    "ticket": "lottery tickets by iterative magnitude pruning of a dense run, rewound to its epoch K (late "
    "resetting): one ordinary run per round",
    "seeds": "several seeds of one recipe: every step's validation and test accuracy as mean, spread and range",
    "jobs": "a sweep of training runs (a grid or a list in TOML) on local joblib workers or SLURM job arrays "
    "(submitit): resumable, one run folder per job, results table and plot",
    "report": "one self-contained HTML page of a run (RUN/report.html): recipe, curves, steps, calibration, latency",
    "serve": "serve a run over HTTP: POST /predict answers within each request's deadline (queue time counted); "
    "--role server finishes split-computing requests over TCP",
    "split": "split computing: the partition point, codec and exit thresholds that answer most accurately within a "
    "deadline over a link, from the device's and the server's profiles (JSON)",
    "split-run": "the device's half of split computing: answer images, sending activations to a --role server over "
    "a shaped link, and measure end-to-end time, misses and accuracy",
    "experiment": "run a study from experiments/ (batch-time, memory, time-accuracy, residual-cutting, precision, "
    "ensemble-baselines, ensembles, lottery)",
    "demo": "the whole multi-exit pipeline on the embedded digits, and where training time goes (no files needed)",
    "prepare-data": "pack an image folder into shards of resized uint8 images (resumable, parallel) that training "
    "reads batch by batch (--data shards)",
}


class _Parser(argparse.ArgumentParser):
    """Argument errors in one line, like every other error, pointing at the command's help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help: appended where the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default {action.default})"


def _module(verb: str) -> Any:
    return importlib.import_module("anytime.commands." + verb.replace("-", "_"))


def _add_command(sub: Any, verb: str) -> None:
    module = _module(verb)
    module.add_arguments(sub.add_parser(verb, description=module.SUMMARY))


def _moved(verb: str) -> Callable[[argparse.Namespace], int]:
    return lambda args: _module(verb).run(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command (exposed for tests and documentation)."""
    parser = _Parser(
        prog="anytime",
        description="Anytime inference research in PyTorch: train, measure and schedule models on a device.",
        formatter_class=_Formatter,
        epilog="commands:\n"
        + "\n".join(f"  {name:<18} {text}" for name, text in COMMANDS.items())
        + "\n\nrun 'anytime COMMAND --help' for a command's options",
    )
    from anytime import __version__

    parser.add_argument("--version", action="version", version=f"anytime {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, help="one of the commands below")

    _add_command(sub, "models")

    _add_command(sub, "train")

    _add_command(sub, "exits")

    _add_command(sub, "collect")

    _add_command(sub, "sweep")

    _add_command(sub, "calibrate")

    _add_command(sub, "evaluate")

    _add_command(sub, "plot")

    _add_command(sub, "cam")

    _add_command(sub, "ponder")

    _add_command(sub, "profile")

    _add_command(sub, "schedule")

    _add_command(sub, "cut")

    _add_command(sub, "quantize")

    _add_command(sub, "export")

    _add_command(sub, "ensemble")

    _add_command(sub, "ensemble-baseline")

    _add_command(sub, "jobs")

    _add_command(sub, "ticket")

    _add_command(sub, "seeds")

    _add_command(sub, "report")

    _add_command(sub, "serve")

    _add_command(sub, "split")

    _add_command(sub, "split-run")

    _add_command(sub, "experiment")

    _add_command(sub, "demo")

    _add_command(sub, "prepare-data")

    for command in sub.choices.values():
        command.formatter_class = _Formatter
        for action in command._actions:  # argparse offers no public list; an option without help shows no default
            if action.help is None and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                action.help = f"default {action.default}"
    return parser


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "models": _moved("models"), "train": _moved("train"), "exits": _moved("exits"), "collect": _moved("collect"), "sweep": _moved("sweep"),
    "calibrate": _moved("calibrate"), "evaluate": _moved("evaluate"), "plot": _moved("plot"), "cam": _moved("cam"), "ponder": _moved("ponder"), "profile": _moved("profile"),
    "schedule": _moved("schedule"), "cut": _moved("cut"), "quantize": _moved("quantize"), "export": _moved("export"),
    "ensemble": _moved("ensemble"), "ensemble-baseline": _moved("ensemble-baseline"),
    "seeds": _moved("seeds"),
    "jobs": _moved("jobs"),
    "ticket": _moved("ticket"),
    "report": _moved("report"),
    "serve": _moved("serve"),
    "split": _moved("split"),
    "split-run": _moved("split-run"),
    "experiment": _moved("experiment"),
    "demo": _moved("demo"),
    "prepare-data": _moved("prepare-data"),
}  # fmt: skip


class _Terminated(BaseException):
    """SIGTERM or SIGHUP: unwinds the stack, so temporary files and staged folders are removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminate(owner: int, signum: int, _frame: Any) -> None:
    if os.getpid() != owner:  # a forked worker (a decoding pool, a DataLoader) inherited this: end as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise _Terminated(signum)


def _catch_termination() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    handler = functools.partial(_terminate, os.getpid())
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}


def _quiet_broken_pipe() -> int:
    """The reader of our output went away (``anytime ... | head``): stop without a word, as ``cat`` does."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _other_process() -> bool:
    """Whether this is one of several data-parallel processes but not process 0."""
    return "WORLD_SIZE" in os.environ and os.environ.get("RANK", "0") != "0"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``anytime`` command; returns the exit status (a data-parallel training process ends
    itself with it instead, see :func:`anytime.train.distributed.end_process`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    status = _run_command(args)
    distributed = sys.modules.get("anytime.train.distributed")
    if distributed is not None and distributed.joined_a_group():
        distributed.end_process(status)
    return status


def _run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; returns the exit status, having said why on stderr where it failed."""
    previous = _catch_termination()
    try:
        status = HANDLERS[args.command](args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except AnytimeError as exc:
        if not isinstance(exc, PeerStopped):  # process 0 has said why
            where = f" (process {os.environ.get('RANK')})" if _other_process() else ""
            print(f"anytime {args.command}: error{where}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave that cannot be read or written
        from anytime.utils.tempnames import user_path

        where = f" ({user_path(exc.filename)})" if exc.filename else ""
        print(f"anytime {args.command}: error: {exc.strerror or exc}{where}; check the path and its permissions",
              file=sys.stderr)  # fmt: skip
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except _Terminated as exc:
        if not _other_process():
            print(f"\nstopped by signal {exc.signum}; nothing partial was kept", file=sys.stderr)
        return 128 + exc.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
