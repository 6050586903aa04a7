"""The training recipe, as one frozen dataclass that round-trips through JSON and model cards."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from anytime.data.augment import DEFAULT_PADDING, Augment, default_augment
from anytime.errors import AnytimeError
from anytime.families.exits import GRADED, HEADS, exit_head_error
from anytime.families.sact import SACT_MODES, parse_thresholds
from anytime.families.slicing import SLICE_KINDS

SCHEDULES: tuple[str, ...] = ("constant", "cosine", "step", "onecycle")
AMP: tuple[str, ...] = ("off", "bf16")
EXIT_MODES: tuple[str, ...] = ("joint", "heads-only")
LADDERS: tuple[str, ...] = ("top-down",)
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
_OPTIONAL_TYPES: dict[str, type] = {"data_root": str, "image_size": int, "limit_train": int, "exits": str, "init": str,
                                    "slices": str, "resolutions": str, "sact": str, "ladder": str, "augment": str, "prune_from": str,
                                    "vocab_size": int, "max_length": int, "tokenizer": str}  # fmt: skip
PRUNE_SCOPES: tuple[str, ...] = ("global", "layer")  # magnitudes ranked over all layers at once, or in each
PRUNE_UNITS: tuple[str, ...] = ("weights", "channels")  # single weights (masked), or whole channels (a smaller network)
_FLOAT_LISTS: dict[str, str] = {"step_milestones": "fractions of the run, e.g. [0.5, 0.75]",
                                "exit_weights": "one loss weight per exit, e.g. [1, 1, 1]"}  # fmt: skip


MAX_WORKERS = 64  # DataLoader worker processes; more only exhausts memory (each holds its own copy)


DISTILL_TEACHERS: tuple[str, ...] = ("last", "later")  # what each earlier step distils from


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run's result (and a few knobs that only decide its speed).

    Defaults follow the field's usual recipe: SGD, learning rate 0.01, momentum 0.9, cross-entropy.
    ``exits`` turns the model into a multi-exit one (points as :func:`anytime.attach_exits` takes them);
    its loss is the weighted sum of the exits' cross-entropies (by default SDN's weights: each exit's
    share of the backbone's FLOPs, the last exit 1), plus ``distill`` times the distillation loss from the last exit to the
    others (``distill_teacher`` ``later``: each exit learns from the mean of the softened outputs of every exit after it); ``gradient_equilibrium`` rescales the gradients where exits branch off, so shared layers get the mean
    of the exits' gradients rather than their sum. ``heads-only`` trains the exit heads on a frozen backbone loaded from ``init``.

    ``slices`` makes it a sliced network instead (``slice_kind`` width or cardinality); every slice weighs 1
    and, with ``sandwich``, a mini-batch trains the narrowest, the widest and one other slice; ``distill``
    then distils the widest slice into the others. ``stochastic_depth`` is the chance that the last residual
    block skips its branch in training (linear in depth). ``ladder`` marks a block-drop ladder (written by
    ``anytime cut --ladder``), whose steps are configurations of skipped blocks. ``resolutions`` (``"16,24,32"``,
    ``cN`` a central crop) makes the steps input resolutions of one network, with batch-norm statistics per
    resolution (:mod:`anytime.families.resolution`); every step weighs 1 and ``distill`` distils the largest into the
    others. ``sact`` (halting thresholds, ``"0.5,0.75,0.9,0.99"``) makes a ResNet's residual stages halt per
    position (``sact_mode`` ``spatial``) or per image (``image``), as spatially adaptive computation time
    (:mod:`anytime.families.sact`): training halts at the last threshold and adds ``ponder_cost`` times the
    ponder cost to the loss; each threshold is a step.

    The fast recipes add: ``augment`` (a policy of :data:`~anytime.data.augment.AUGMENT_POLICIES`, None for the
    dataset's default) with ``padding`` pixels for crops and a ``cutout`` square of that side (0: none);
    ``label_smoothing``; the ``onecycle`` schedule (a linear rise over the first ``warmup`` of the run, then a
    linear fall to 0, set every iteration; ``warmup`` also ramps the other schedules); ``ema``, the decay per step
    of an exponential moving average of the weights and batch-norm statistics, which is what is validated and saved;
    ``amp`` ``bf16`` (autocast of the forward pass to bfloat16: AMX/AVX-512 CPUs and recent GPUs run it several
    times faster, and the weights stay float32); ``norm_bias_lr_scale`` multiplies the learning rate of
    normalisation layers' biases (airbench's 64), their weight decay divided by as much so that it shrinks them no
    faster. ``channels_last`` and ``tta`` (also report test accuracy averaged over each image and its mirror, apart
    from the plain figure) change no weight.

    Lottery tickets (:mod:`anytime.train.pruning`): ``prune_from`` a finished run, to a total ``sparsity`` of the
    convolution and linear weights (``prune_scope`` global or per layer), rewound to the dense run's state after
    ``reset_epoch`` epochs; ``keep_checkpoints`` keeps a run's full checkpoint after those epochs (0: before the
    first) for tickets to rewind to. ``prune_unit`` ``channels`` prunes whole channels instead
    (:mod:`anytime.train.channels`): ``sparsity`` is then the share of the prunable channels removed, and the ticket
    is a smaller network.
    """

    model: str = "lenet"
    data: str = "digits"
    data_root: str | None = None
    image_size: int | None = None
    val_fraction: float = 0.1
    limit_train: int | None = None
    vocab_size: int | None = None
    max_length: int | None = None
    tokenizer: str | None = None
    epochs: int = 10
    batch_size: int = 128
    lr: float = 0.01
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = False
    schedule: str = "cosine"
    step_milestones: tuple[float, ...] = (0.5, 0.75)
    step_gamma: float = 0.1
    seed: int = 0
    init: str | None = None
    exits: str | None = None
    exit_head: str = "pool"
    exit_mode: str = "joint"
    exit_weights: tuple[float, ...] | None = None
    distill: float = 0.0
    distill_temperature: float = 3.0
    distill_teacher: str = "last"
    gradient_equilibrium: bool = False
    slices: str | None = None
    resolutions: str | None = None
    sact: str | None = None
    sact_mode: str = "spatial"
    ponder_cost: float = 0.01
    slice_kind: str = "width"
    sandwich: bool = False
    stochastic_depth: float = 0.0
    ladder: str | None = None
    augment: str | None = None
    padding: int = DEFAULT_PADDING
    cutout: int = 0
    label_smoothing: float = 0.0
    warmup: float = 0.0
    ema: float = 0.0
    norm_bias_lr_scale: float = 1.0
    amp: str = "off"
    prune_from: str | None = None
    sparsity: float = 0.0
    reset_epoch: int = 0
    prune_scope: str = "global"
    prune_unit: str = "weights"
    # Speed-only knobs: they change how fast, never what is computed.
    device: str = "auto"
    workers: int = 0
    prefetch_factor: int = 2
    pin_memory: bool = False
    eval_batch_size: int = 512
    channels_last: bool = False
    tta: bool = False
    keep_checkpoints: tuple[int, ...] = ()

    RUNTIME_FIELDS = ("device", "workers", "prefetch_factor", "pin_memory", "eval_batch_size", "channels_last", "tta",
                      "keep_checkpoints")  # fmt: skip

    def __post_init__(self) -> None:
        checks = self._recipe_checks() + self._family_checks() + self._regularisation_checks() + self._ticket_checks()
        for ok, message in checks:
            if not ok:
                raise AnytimeError(message)
        self.augmentation(dataset_hflip=True)  # Augment refuses an unknown policy, a negative padding or cutout
        if self.sact is not None:
            parse_thresholds(self.sact)

    def _recipe_checks(self) -> list[tuple[bool, str]]:
        """The optimiser, the schedule, the data and its loader."""
        return [
            (self.epochs >= 1, f"epochs must be at least 1 (got {self.epochs})"),
            (self.batch_size >= 1, f"batch size must be at least 1 (got {self.batch_size})"),
            (math.isfinite(self.lr) and self.lr > 0, f"learning rate must be a positive number (got {self.lr})"),
            (0 <= self.momentum < 1, f"momentum must be in [0, 1) (got {self.momentum})"),
            (
                self.optimizer in OPTIMIZERS,
                f"unknown optimizer '{self.optimizer}'; choose one of {', '.join(OPTIMIZERS)}",
            ),
            (not self.nesterov or self.optimizer == "sgd", "--nesterov is SGD's; AdamW takes no Nesterov momentum"),
            (
                self.vocab_size is None or self.vocab_size >= 100,
                f"--vocab-size must be at least 100 (got {self.vocab_size})",
            ),
            (
                self.max_length is None or self.max_length >= 2,
                f"--max-length must be at least 2 tokens (got {self.max_length})",
            ),
            (
                math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                f"weight decay must be >= 0 (got {self.weight_decay})",
            ),
            (0 < self.val_fraction < 1, f"validation fraction must be in (0, 1) (got {self.val_fraction})"),
            (
                self.schedule in SCHEDULES,
                f"unknown lr schedule '{self.schedule}'; choose one of {', '.join(SCHEDULES)}",
            ),
            (
                0 <= self.workers <= MAX_WORKERS,
                f"workers must be 0..{MAX_WORKERS} (got {self.workers}): each worker is a process with its own copy of "
                "the loader; a few per core is plenty",
            ),
            (self.prefetch_factor >= 1, f"prefetch factor must be >= 1 (got {self.prefetch_factor})"),
            (self.limit_train is None or self.limit_train >= 1, "limit_train must be a positive count"),
            (all(0 < m < 1 for m in self.step_milestones), "step milestones are fractions of the run in (0, 1)"),
        ]

    def _family_checks(self) -> list[tuple[bool, str]]:
        """The family of steps: exits, slices, ladders, resolutions, SACT."""
        return [
            (
                self.exit_mode in EXIT_MODES,
                f"unknown exit mode '{self.exit_mode}'; choose one of {', '.join(EXIT_MODES)}",
            ),
            (
                exit_head_error(self.exit_head) is None,
                f"unknown exit head '{self.exit_head}'; choose one of {', '.join(HEADS)}, one per early exit separated by "
                f"commas, or '{GRADED}'",
            ),
            (self.exits is not None or self.exit_mode == "joint", "--exit-mode heads-only needs --exits"),
            (
                self.exit_mode == "joint" or self.init is not None,
                "--exit-mode heads-only trains exits on a trained backbone: give it with --init CHECKPOINT",
            ),
            (
                self.exit_weights is None
                or self.exits is not None
                or self.slices is not None
                or self.resolutions is not None,
                "exit weights need --exits (or --slices or --resolutions)",
            ),
            (
                self.resolutions is None or (self.exits is None and self.slices is None and self.ladder is None),
                "a resolution ladder is a family of its own: it takes no --exits, --slices or ladder",
            ),
            (
                self.sact is None
                or (
                    self.exits is None
                    and self.slices is None
                    and self.ladder is None
                    and self.resolutions is None
                    and self.exit_weights is None
                    and self.distill == 0
                ),
                "SACT is a family of its own, trained at its last threshold: it takes no --exits, --slices, "
                "--resolutions, ladder, --exit-weights or --distill",
            ),
            (
                self.sact_mode in SACT_MODES,
                f"unknown --sact-mode '{self.sact_mode}'; choose one of {', '.join(SACT_MODES)}",
            ),
            (
                self.sact is not None or (self.sact_mode == "spatial" and self.ponder_cost == 0.01),
                "--sact-mode and --ponder-cost shape a SACT ResNet: give its halting thresholds with --sact",
            ),
            (
                math.isfinite(self.ponder_cost) and self.ponder_cost >= 0,
                f"--ponder-cost is the weight of the ponder cost in the loss, >= 0 (got {self.ponder_cost})",
            ),
            (
                self.exits is None or self.slices is None,
                "--exits and --slices together are not supported: choose one family",
            ),
            (
                self.ladder is None or (self.exits is None and self.slices is None),
                "a block-drop ladder is a family of its own: it takes no --exits or --slices",
            ),
            (
                self.ladder is None or self.ladder in LADDERS,
                f"unknown ladder '{self.ladder}'; choose one of {', '.join(LADDERS)}",
            ),
            (
                self.slice_kind in SLICE_KINDS,
                f"unknown slice kind '{self.slice_kind}'; choose one of {', '.join(SLICE_KINDS)}",
            ),
            (not self.sandwich or self.slices is not None, "--sandwich trains sliced networks: it needs --slices"),
        ]

    def _regularisation_checks(self) -> list[tuple[bool, str]]:
        """Regularisation, exit weights, distillation, precision of training."""
        return [
            (
                math.isfinite(self.stochastic_depth) and 0 <= self.stochastic_depth < 1,
                f"--stochastic-depth is a probability in [0, 1) (got {self.stochastic_depth})",
            ),
            (
                self.exit_weights is None
                or all(math.isfinite(w) and w >= 0 for w in self.exit_weights)
                and sum(self.exit_weights) > 0,
                "exit weights must be finite, >= 0 and not all 0",
            ),
            (
                math.isfinite(self.distill) and self.distill >= 0,
                f"distillation weight must be >= 0 (got {self.distill})",
            ),
            (
                not self.gradient_equilibrium or self.exits is not None,
                "--gradient-equilibrium balances the gradients of exits: it needs --exits",
            ),
            (
                self.distill == 0 or self.exits is not None or self.slices is not None or self.resolutions is not None,
                "distillation (from the last exit, the widest slice or the largest resolution to the others) needs "
                "--exits, --slices or --resolutions",
            ),
            (
                self.distill_teacher in DISTILL_TEACHERS,
                f"unknown distillation teacher '{self.distill_teacher}'; choose one of {', '.join(DISTILL_TEACHERS)}",
            ),
            (
                self.distill_teacher == "last" or self.distill > 0,
                f"--distill-teacher {self.distill_teacher} says what to distil from: it needs a weight (--distill)",
            ),
            (
                math.isfinite(self.distill_temperature) and self.distill_temperature > 0,
                f"distillation temperature must be > 0 (got {self.distill_temperature})",
            ),
            (
                math.isfinite(self.label_smoothing) and 0 <= self.label_smoothing < 1,
                f"label smoothing is in [0, 1) (got {self.label_smoothing})",
            ),
            (
                math.isfinite(self.warmup) and 0 <= self.warmup < 1,
                f"warm-up is a fraction of the run in [0, 1) (got {self.warmup})",
            ),
            (
                math.isfinite(self.ema) and 0 <= self.ema < 1,
                f"--ema is a decay per step in [0, 1), e.g. 0.999; 0 turns it off (got {self.ema})",
            ),
            (
                math.isfinite(self.norm_bias_lr_scale) and self.norm_bias_lr_scale > 0,
                f"--norm-bias-lr-scale multiplies a learning rate: it must be > 0 (got {self.norm_bias_lr_scale})",
            ),
            (self.amp in AMP, f"unknown --amp '{self.amp}'; choose one of {', '.join(AMP)}"),
        ]

    def _ticket_checks(self) -> list[tuple[bool, str]]:
        """Lottery tickets and the checkpoints kept for them."""
        return [
            (
                math.isfinite(self.sparsity) and 0 <= self.sparsity < 1,
                f"--sparsity is the share of weights pruned, in [0, 1) (got {self.sparsity})",
            ),
            (
                self.prune_from is not None or (self.sparsity == 0 and self.reset_epoch == 0),
                "--sparsity and --reset-epoch make a lottery ticket: give the run to prune with --prune-from RUN",
            ),
            (
                0 <= self.reset_epoch < self.epochs,
                f"--reset-epoch must be in 0..{self.epochs - 1}, an epoch of the run (got {self.reset_epoch})",
            ),
            (
                self.prune_scope in PRUNE_SCOPES,
                f"unknown --prune-scope '{self.prune_scope}'; choose one of {', '.join(PRUNE_SCOPES)}",
            ),
            (
                self.prune_unit in PRUNE_UNITS,
                f"unknown --prune-unit '{self.prune_unit}'; choose one of {', '.join(PRUNE_UNITS)}",
            ),
            (
                self.prune_from is not None or self.prune_unit == "weights",
                "--prune-unit channels makes a structured lottery ticket: give the run to prune with --prune-from RUN",
            ),
            (
                self.prune_unit == "weights" or self.slices is None,
                "a sliced network's steps share their channels; prune its weights (--prune-unit weights), not its channels",
            ),
            (
                all(0 <= k < self.epochs for k in self.keep_checkpoints),
                f"--keep-checkpoints are epochs in 0..{self.epochs - 1} (got {list(self.keep_checkpoints)})",
            ),
            (
                self.prune_from is None or self.exit_mode == "joint" and self.ladder is None,
                "a lottery ticket trains every layer of a plain, multi-exit or sliced network (no heads-only, no ladder)",
            ),
        ]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field."""
        out = dataclasses.asdict(self)
        out["step_milestones"] = list(self.step_milestones)
        out["exit_weights"] = None if self.exit_weights is None else list(self.exit_weights)
        out["keep_checkpoints"] = list(self.keep_checkpoints)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, where: str = "config") -> TrainConfig:
        """Build from a dict, refusing unknown keys and values of the wrong type with a clear message."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise AnytimeError(f"{where}: unknown setting(s) {', '.join(unknown)}; valid ones are {', '.join(known)}")
        clean: dict[str, Any] = {}
        for key, value in values.items():
            clean[key] = _coerce(key, value, known[key].default, where)
        return cls(**clean)

    def augmentation(self, dataset_hflip: bool) -> Augment:
        """The augmentation this recipe trains with on a dataset whose images may (``dataset_hflip``) be mirrored."""
        if self.augment is None:
            return Augment(default_augment(dataset_hflip).policy, self.padding, self.cutout)
        return Augment(self.augment, self.padding, self.cutout)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _coerce(key: str, value: Any, default: Any, where: str) -> Any:
    if key == "keep_checkpoints":
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise AnytimeError(f"{where}: keep_checkpoints must be a list of epochs, e.g. [0, 2]")
        return tuple(sorted(set(value)))
    if key in _FLOAT_LISTS:
        if value is None and key == "exit_weights":
            return None
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            raise AnytimeError(f"{where}: {key} must be a list of {_FLOAT_LISTS[key]}")
        return tuple(float(v) for v in value)
    if value is None:
        return value
    expected = _OPTIONAL_TYPES.get(key) if default is None else type(default)
    if expected is None:
        return value
    if expected is bool and not isinstance(value, bool):
        raise AnytimeError(f"{where}: {key} must be true or false (got {value!r})")
    if expected is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, expected):
        return value
    raise AnytimeError(f"{where}: {key} must be {expected.__name__} (got {value!r})")
