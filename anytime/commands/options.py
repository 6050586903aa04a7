"""Options and argument types that several commands share, each declared once.

The helpers take a parser (or one of its argument groups) and add one option, or a few that go together; where
commands word an option differently, the help is a parameter. The types turn a command-line string into a value
or raise :class:`argparse.ArgumentTypeError`, which argparse reports in one line.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from anytime.errors import AnytimeError
from anytime.utils.figure_sizes import FIGURE_SIZES

# One --device everywhere: int8 quantization, which runs on the CPU only, takes auto as the CPU.
DEVICE_HELP = "auto (a CUDA GPU if torch sees one, else the CPU) | cpu | cuda[:N] (default auto)"
THREADS_HELP = "auto: the cores other processes leave free (measured over 0.25 s), at least 1"
FIGURE_SIZE_HELP = "figure size: " + "; ".join(f"{s.name}: {s.description}" for s in FIGURE_SIZES.values())
FORM_HELP = (
    "inference form: eager (default), or any of fold (batch norm into the convolutions), channels-last, "
    "compile, joined by '+'"
)
# The exit criteria, as anytime.calibrate names them (a test checks that they agree).
CRITERIA = ("entropy", "normalized-entropy", "confidence", "margin", "patience", "learned")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """The type of a whole number no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def finite_float(text: str) -> float:
    """A number, neither NaN nor infinite."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got '{text}'")
    return value


def name_list(text: str) -> tuple[str, ...]:
    """A comma-separated list of names, none empty."""
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected NAME,NAME,... without empty names (got '{text}')")
    return names


def share_or_off(text: str) -> float | None:
    """A share above 0, or ``off`` (None)."""
    if text == "off":
        return None
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a share above 0 (e.g. 0.25) or off, got '{text}'")
    return value


def ms_or_off(text: str) -> float | None:
    """Milliseconds from 0 to 60000, or ``off`` (None)."""
    if text == "off":
        return None
    value = finite_float(text)
    if not 0 <= value < 60_000:
        raise argparse.ArgumentTypeError(f"expected milliseconds from 0 to 60000 or off, got '{text}'")
    return value


def threads(text: str) -> int | str:
    """A positive number of torch threads, or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of threads or 'auto', got '{text}'")
    return value


def form(text: str) -> str:
    """An inference form (``eager``, ``fold+compile``...), checked by the library and named as it names it."""
    from anytime.deploy.inference import InferenceForm  # torch: only where --form is parsed

    try:
        return InferenceForm.parse(text).name
    except AnytimeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def step_list(text: str | None) -> list[int] | None:
    """The steps a ``--steps K,K,...`` value names (None: every step)."""
    if not text:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise AnytimeError(f"--steps '{text}' is not a comma-separated list of step numbers, e.g. 0,2") from None


def add_json(parser: argparse._ActionsContainer, help: str = "print JSON") -> None:
    """``--json``: print the result as JSON instead of text."""
    parser.add_argument("--json", action="store_true", help=help)


def add_out(parser: argparse._ActionsContainer, help: str, *, metavar: str = "DIR", required: bool = False) -> None:
    """``--out``: where the command writes (a folder, or a file where ``metavar`` says so)."""
    parser.add_argument("--out", required=required, metavar=metavar, help=help)


def add_overwrite(parser: argparse._ActionsContainer, help: str) -> None:
    """``--overwrite``: replace what an earlier run of the command left in ``--out``."""
    parser.add_argument("--overwrite", action="store_true", help=help)


def add_device(parser: argparse._ActionsContainer, help: str = DEVICE_HELP, default: str | None = "auto") -> None:
    """``--device``: where torch runs."""
    parser.add_argument("--device", default=default, help=help)


def add_split(
    parser: argparse._ActionsContainer,
    choices: Sequence[str],
    *,
    default: str | None = None,
    help: str | None = None,
    dest: str = "split",
) -> None:
    """``--split``: which split of the run's data the command reads."""
    parser.add_argument("--split", dest=dest, choices=list(choices), default=default, help=help)


def add_batch_size(parser: argparse._ActionsContainer, default: int | None = None, help: str | None = None) -> None:
    """``--batch-size``: samples per batch."""
    parser.add_argument("--batch-size", type=positive_int, default=default, metavar="B", help=help)


def add_threads(parser: argparse._ActionsContainer, help: str, default: int | None = None) -> None:
    """``--threads``: torch's CPU threads, a number or auto."""
    parser.add_argument("--threads", type=threads, default=default, metavar="N|auto", help=help)


def add_form(parser: argparse._ActionsContainer, help: str = FORM_HELP) -> None:
    """``--form``: the inference form the steps run in."""
    parser.add_argument("--form", type=form, default="eager", help=help)


def add_figure_size(parser: argparse._ActionsContainer, help: str) -> None:
    """``--figure-size``: the size figures are drawn at (screen, or a paper's)."""
    parser.add_argument("--figure-size", default="screen", choices=list(FIGURE_SIZES), help=help)


def add_profile(parser: argparse._ActionsContainer, help: str) -> None:
    """``--profile``: a device profile written by ``anytime profile``."""
    parser.add_argument("--profile", metavar="FILE", help=help)


def add_calibration(parser: argparse._ActionsContainer, help: str) -> None:
    """``--calibration``: early-exit thresholds written by ``anytime calibrate``."""
    parser.add_argument("--calibration", metavar="FILE", help=help)


def add_images(parser: argparse._ActionsContainer) -> None:
    """``--images`` or ``--split`` with ``--count``: the images a map is drawn for (see :func:`step_list`)."""
    parser.add_argument(
        "--images",
        nargs="+",
        default=[],
        metavar="FILE",
        help="PNG or JPEG images (or .npy arrays) of the run's input size",
    )
    add_split(parser, ("train", "val", "test"), help="draw images from the run's data instead")
    parser.add_argument(
        "--count", type=positive_int, default=8, metavar="N", help="images drawn from --split (default 8, at most 64)"
    )


def add_steps(parser: argparse._ActionsContainer, help: str) -> None:
    """``--steps K,K,...``: some of the run's steps, read with :func:`step_list`."""
    parser.add_argument("--steps", metavar="K,K,...", help=help)


def add_exit_points(parser: argparse._ActionsContainer, help: str, default: str | None = None) -> None:
    """``--exits POINTS``: where a model's early exits go (auto, sdn, a number, FLOPs fractions, point names)."""
    parser.add_argument("--exits", default=default, metavar="POINTS", help=help)


def add_exit_head(parser: argparse._ActionsContainer, help: str, default: str | None = None) -> None:
    """``--exit-head HEAD``: the design of the early exits' heads."""
    parser.add_argument("--exit-head", default=default, metavar="HEAD", help=help)


def add_sparsity(parser: argparse._ActionsContainer, help: str, required: bool = False) -> None:
    """``--sparsity S``: the share of a network's weights (or channels) that pruning removes."""
    parser.add_argument("--sparsity", type=finite_float, required=required, metavar="S", help=help)


def add_reset_epoch(parser: argparse._ActionsContainer, help: str, default: int | None = None) -> None:
    """``--reset-epoch K``: the epoch of the dense run a lottery ticket's weights are rewound to."""
    parser.add_argument("--reset-epoch", type=non_negative_int, default=default, metavar="K", help=help)


def add_emulate_slowdown(parser: argparse._ActionsContainer, help: str) -> None:
    """``--emulate-slowdown F``: behave as a board F times slower than this machine."""
    parser.add_argument("--emulate-slowdown", type=finite_float, default=1.0, metavar="F", help=help)


def add_calibration_images(parser: argparse._ActionsContainer, help: str) -> None:
    """``--calibration-images``: the training images that calibrate int8 activations."""
    parser.add_argument("--calibration-images", type=positive_int, default=512, metavar="N", help=help)


def add_float_layers(parser: argparse._ActionsContainer, scope: str, artifact: str) -> None:
    """The options of accuracy-aware int8, shared by quantize and export."""
    parser.add_argument(
        "--float-layers",
        type=name_list,
        default=(),
        metavar="NAME,NAME,...",
        help=f"{scope}: convolutions or linear layers (module names, e.g. backbone.stem.conv) kept in float",
    )
    parser.add_argument(
        "--min-agreement",
        type=finite_float,
        metavar="A",
        help=f"{scope}: keep the layers int8 hurts most in float, fewest first, until every step agrees "
        "with the float run on at least this share of validation images (e.g. 0.99)",
    )
    parser.add_argument(
        "--max-float-layers",
        type=non_negative_int,
        default=8,
        metavar="N",
        help="--min-agreement keeps at most N layers in float (default 8)",
    )
    parser.add_argument(
        "--agreement-images",
        type=positive_int,
        default=1000,
        metavar="N",
        help="--min-agreement measures on N validation images, labels unread (default 1000)",
    )
    parser.add_argument(
        "--min-size-ratio",
        type=finite_float,
        metavar="R",
        help=f"--min-agreement keeps no more weights in float than leave the int8 {artifact} at least "
        "R times smaller than the fp32 one (e.g. 3.5; default: no limit)",
    )


def add_split_plan(parser: argparse._ActionsContainer) -> None:
    """The options of a split-computing plan (the profiles, the link, the deadline), shared by split and
    split-run."""
    parser.add_argument("--device-profile", required=True, metavar="A.json", help="the run profiled on the device")
    parser.add_argument("--server-profile", required=True, metavar="B.json", help="the run profiled on the server")
    parser.add_argument(
        "--bandwidth-mbps", type=finite_float, required=True, metavar="W", help="link bandwidth, Mbit/s"
    )
    parser.add_argument("--rtt-ms", type=finite_float, default=0.0, metavar="R", help="link round trip, ms (default 0)")
    parser.add_argument(
        "--overhead-ms",
        type=finite_float,
        default=0.0,
        metavar="O",
        help="what one exchange takes beyond the round trip and its bytes at the bandwidth, at the "
        "quantile (encoding, framing, waits), ms (default 0; split-run measures it, see "
        "--link-samples)",
    )
    parser.add_argument(
        "--deadline-ms", type=finite_float, required=True, metavar="D", help="the time budget of one request"
    )
    parser.add_argument(
        "--quantile",
        type=finite_float,
        default=0.99,
        metavar="Q",
        help="the latency quantile that must fit (default 0.99)",
    )
    parser.add_argument(
        "--codecs",
        default="fp32,fp16,int8",
        metavar="C,C",
        help="how an activation may travel: fp32, fp16, int8 (per-channel affine); default all three",
    )
    parser.add_argument(
        "--criterion", choices=list(CRITERIA), default="entropy", help="exit criterion (default entropy)"
    )
    parser.add_argument(
        "--partitions",
        metavar="P,P",
        help="only these partition points: server (send the input), device (send nothing) or K (after "
        "exit K); default all",
    )
    add_json(parser)
