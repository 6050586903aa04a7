"""``anytime <command>``: the dispatcher of the command line.

:func:`main` reads the command's name, imports that command's module alone (:mod:`anytime.commands`), parses the
arguments with its options, runs it, and turns what went wrong into one line on stderr and an exit status.
:func:`build_parser` builds the parser of every command at once, for the tests and the command reference.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Collection, Sequence
from types import ModuleType
from typing import Any, NoReturn

from anytime import __version__
from anytime.commands.output import print_error
from anytime.errors import AnytimeError, PeerStopped
from anytime.utils.tempnames import user_path

# Every command, in the order `anytime --help` lists them: the module that declares and runs it, and its line in
# that help. The line is here so that the help needs no command's module; the module's SUMMARY must say the same.
COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("anytime.commands.models", "list the model zoo and torchvision classifiers, with parameter counts"),
    "train": ("anytime.commands.train", "train a model (or a model card), plain or with early exits; record time, "
              "memory and accuracy"),
    "exits": ("anytime.commands.exits", "show the exits attach_exits puts on a model, with cumulative FLOPs and "
              "parameters"),
    "collect": ("anytime.commands.collect", "run a trained multi-exit model once over a split and cache every exit's "
                "logits"),
    "sweep": ("anytime.commands.sweep", "sweep exit thresholds over the cached outputs: accuracy, FLOPs, exit shares, "
              "Pareto front"),
    "calibrate": ("anytime.commands.calibrate", "fit exit thresholds on validation for an accuracy drop or a FLOPs "
                  "budget (RUN/calibration.json)"),
    "evaluate": ("anytime.commands.evaluate", "real early exit on a split: accuracy, exit shares, latency per sample "
                 "vs the plain backbone"),
    "plot": ("anytime.commands.plot", "plot a multi-exit run: accuracy vs cost, vs threshold, exit histogram, per-exit "
             "accuracy, deadlines"),
    "cam": ("anytime.commands.cam", "class activation maps of every step (CAM for global-pooled heads, Grad-CAM "
            "otherwise) for the same images: a figure side by side and the arrays"),
    "ponder": ("anytime.commands.ponder", "maps of the residual units a SACT run spends at every position of an image, "
               "at each halting threshold"),
    "profile": ("anytime.commands.profile", "measure every step's latency (p50/p90/p99), FLOPs and memory on this "
                "device, or compare two profiles"),
    "schedule": ("anytime.commands.schedule", "the most accurate step or early-exit policy that meets a deadline on a "
                 "profiled device (JSON)"),
    "cut": ("anytime.commands.cut", "cut residual links or skip blocks of a trained ResNet: accuracy and latency (CSV, "
            "plots), or a ladder run"),
    "quantize": ("anytime.commands.quantize", "a run's steps at another precision (int8, int8-dynamic, bf16, fp16), as "
                 "a run the pipeline takes"),
    "export": ("anytime.commands.export", "deployable artifacts of a run's steps (torch.export .pt2 or ONNX), a "
               "manifest and the parity table"),
    "ensemble": ("anytime.commands.ensemble", "an ensemble of trained runs (any architecture, any precision) fused "
                 "after each member, as a run"),
    "ensemble-baseline": ("anytime.commands.ensemble_baseline", "torchensemble's fusion, voting, bagging, gradient "
                          "boosting or snapshot ensemble, as a run"),
    "ticket": ("anytime.commands.ticket", "lottery tickets by iterative magnitude pruning of a dense run, rewound to "
               "its epoch K (late resetting): one ordinary run per round"),
    "seeds": ("anytime.commands.seeds", "several seeds of one recipe: every step's validation and test accuracy as "
              "mean, spread and range"),
    "jobs": ("anytime.commands.jobs", "a sweep of training runs (a grid or a list in TOML) on local joblib workers or "
             "SLURM job arrays (submitit): resumable, one run folder per job, results table and plot"),
    "report": ("anytime.commands.report", "one self-contained HTML page of a run (RUN/report.html): recipe, curves, "
               "steps, calibration, latency"),
    "serve": ("anytime.commands.serve", "serve a run over HTTP: POST /predict answers within each request's deadline "
              "(queue time counted); --role server finishes split-computing requests over TCP"),
    "split": ("anytime.commands.split", "split computing: the partition point, codec and exit thresholds that answer "
              "most accurately within a deadline over a link, from the device's and the server's profiles (JSON)"),
    "split-run": ("anytime.commands.split_run", "the device's half of split computing: answer images, sending "
                  "activations to a --role server over a shaped link, and measure end-to-end time, misses and "
                  "accuracy"),
    "experiment": ("anytime.commands.experiment", "run a study from experiments/ (batch-time, memory, time-accuracy, "
                   "residual-cutting, precision, ensemble-baselines, ensembles, lottery)"),
    "demo": ("anytime.commands.demo", "the whole multi-exit pipeline on the embedded digits, and where training time "
             "goes (no files needed)"),
    "prepare-data": ("anytime.commands.prepare_data", "pack an image folder into shards of resized uint8 images "
                     "(resumable, parallel) that training reads batch by batch (--data shards)"),
}  # fmt: skip


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command (exposed for tests and documentation)."""
    return _parser(COMMANDS)


def _parser(declared: Collection[str]) -> argparse.ArgumentParser:
    """The parser of ``anytime`` with the options of the commands in ``declared``. The others are there by name
    only, their modules not imported: enough for the help, and for argparse to name them all when a name is wrong."""
    parser = _Parser(
        prog="anytime",
        description="Anytime inference research in PyTorch: train, measure and schedule models on a device.",
        formatter_class=_Formatter,
        epilog="commands:\n"
        + "\n".join(f"  {name:<18} {summary}" for name, (_, summary) in COMMANDS.items())
        + "\n\nrun 'anytime COMMAND --help' for a command's options",
    )
    parser.add_argument("--version", action="version", version=f"anytime {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, help="one of the commands below")
    for name in _registration_order():
        command = sub.add_parser(name, formatter_class=_Formatter)
        if name in declared:
            _declare(command, _module(name))
    return parser


def _registration_order() -> list[str]:
    """The commands in the order argparse knows them, which its error for an unknown command and the command
    reference (docs/reference/cli.md) follow: the help's, but with jobs before ticket and seeds, as the parser had
    them before this table; drop the move together with regenerating that page."""
    names = [name for name in COMMANDS if name != "jobs"]
    names.insert(names.index("ticket"), "jobs")
    return names


def _module(name: str) -> ModuleType:
    path, summary = COMMANDS[name]
    module = importlib.import_module(path)
    if module.SUMMARY != summary:
        raise RuntimeError(f"{path}.SUMMARY and anytime.cli.COMMANDS[{name!r}] differ: make them say the same")
    return module


def _declare(command: argparse.ArgumentParser, module: ModuleType) -> None:
    """The command's description and options, each option's default shown in its help."""
    command.description = module.SUMMARY
    module.add_arguments(command)
    for action in command._actions:  # argparse offers no public list; an option without help shows no default
        if action.help is None and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            action.help = f"default {action.default}"


class _Terminated(BaseException):
    """SIGTERM or SIGHUP: unwinds the stack, so temporary files and staged folders are removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _TerminationGuard:
    """Turns the first SIGTERM or SIGHUP into :class:`_Terminated` while a command runs (main thread only).

    One signal unwinds the command; later ones, and any that arrive once :meth:`disarm` has been called (a failure
    is being reported), are let pass, so a launcher stopping a process that is already saying why it failed gets
    that reason and its exit status, never a traceback raised from the middle of the report.
    """

    def __init__(self) -> None:
        self._owner = os.getpid()
        self._armed = True
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def _handle(self, signum: int, _frame: Any) -> None:
        if os.getpid() != self._owner:  # a forked worker (a decoding pool, a DataLoader) inherited this
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._armed:
            self._armed = False
            raise _Terminated(signum)

    def disarm(self) -> None:
        """From now on a signal no longer interrupts: the command is already on its way out."""
        self._armed = False

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        self._armed = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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
    name = next((arg for arg in argv if not arg.startswith("-")), None)  # `anytime` itself takes no values
    args = _parser([name] if name in COMMANDS else []).parse_args(argv)
    args.argv = argv
    status = _run_command(args)
    distributed = sys.modules.get("anytime.train.distributed")
    if distributed is not None and distributed.joined_a_group():
        distributed.end_process(status)
    return status


def _run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; returns the exit status, having said why on stderr where it failed."""
    guard = _TerminationGuard()
    try:
        try:
            status = _module(args.command).run(args)
            sys.stdout.flush()
            return status
        except BrokenPipeError:
            guard.disarm()
            return _quiet_broken_pipe()
        except AnytimeError as exc:
            guard.disarm()
            if not isinstance(exc, PeerStopped):  # process 0 has said why
                where = f" (process {os.environ.get('RANK')})" if _other_process() else ""
                print_error(args.command, str(exc), where)
            return 2
        except OSError as exc:  # a path the user gave that cannot be read or written
            guard.disarm()
            path = f" ({user_path(exc.filename)})" if exc.filename else ""
            print_error(args.command, f"{exc.strerror or exc}{path}; check the path and its permissions")
            return 2
        except KeyboardInterrupt:
            guard.disarm()
            print("\ninterrupted", file=sys.stderr)
            return 130
    except _Terminated as exc:  # also one that came between a failure and its handler's first line
        if not _other_process():
            print(f"\nstopped by signal {exc.signum}; nothing partial was kept", file=sys.stderr)
        return 128 + exc.signum
    finally:
        guard.restore()


if __name__ == "__main__":
    raise SystemExit(main())
