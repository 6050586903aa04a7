"""The instrumented training loop: SGD, per-epoch metrics, per-iteration phase timing, exact resume."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.backbones.footprint import check_forward_memory, model_bytes
from anytime.data import Augment, BatchLoader, DatasetSplits, make_loader
from anytime.data.base import DatasetInfo
from anytime.data.text import TOKENIZER_FILE
from anytime.errors import AnytimeError
from anytime.train.channels import CHANNELS_FILE, ChannelPlan, shrink
from anytime.train.checkpoint import load_checkpoint, save_checkpoint, save_weights
from anytime.train.config import TrainConfig
from anytime.train.distributed import Distributed, sync_batch_norms
from anytime.train.linear_baseline import fit_baseline
from anytime.train.memory import cuda_peak_bytes, peak_rss_bytes
from anytime.train.multi_exit import build_model, exit_weights, multi_exit_loss
from anytime.train.pruning import MASK_FILE, Mask, kept_checkpoint, make_channel_ticket, make_ticket
from anytime.train.records import CHECKPOINT
from anytime.train.splits import load_splits
from anytime.train.timing import PHASES, Clock, PhaseLog
from anytime.utils.io import DiskFullError, read_csv, write_csv, write_json, write_text
from anytime.utils.machine import describe_machine, device_label, git_sha, resolve_device
from anytime.utils.outputs import (
    MARKER,
    RUN,
    RUN_ENTRIES,
    DirState,
    check_output_dir,
    clear_run,
    output_lock,
    write_marker,
)
from anytime.utils.progress import progress_bar
from anytime.utils.resources import check_disk
from anytime.utils.seed import derive_seed, seed_everything

# what gloo and NCCL say (as plain RuntimeErrors) when a peer process has gone
_LOST_PEER = re.compile(r"gloo|nccl|connection (reset|closed|refused)|broken pipe|timed out", re.IGNORECASE)
METRICS_COLUMNS: tuple[str, ...] = (
    "epoch", "lr", "train_loss", "train_acc", "val_loss", "val_acc", "epoch_s", "train_s", "eval_s", "elapsed_s",
    "data_s", "forward_s", "backward_s", "step_s", "images_per_s", "peak_rss_mb", "cuda_peak_mb",
)  # fmt: skip


@dataclass(frozen=True)
class EpochEnd:
    """What a callback sees after an epoch has been checkpointed."""

    epoch: int
    metrics: dict[str, float | None]
    run_dir: Path


class _TrainingForward(nn.Module):
    """The training pass as one module call, so that DistributedDataParallel sees every forward: all steps of the
    model, or only the ``chosen`` ones (the sandwich rule of sliced networks), stacked."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor, chosen: list[int] | None = None) -> Tensor:
        if chosen is None:
            return self.model(images)
        return torch.stack([self.model.forward_until(images, k) for k in chosen])  # type: ignore[operator]


def lr_factor(config: TrainConfig, epoch: int, fraction: float = 0.0) -> float:
    """The multiplier of the base learning rate ``fraction`` of the way through ``epoch`` (0-based).

    ``cosine``, ``step`` and ``constant`` change once per epoch; ``onecycle`` falls linearly to 0 at the end
    of the run, every iteration; a ``warmup`` multiplies any of them by a linear rise from 0 over that
    share of the run.
    """
    progress = (epoch + fraction) / config.epochs
    if config.schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * epoch / config.epochs))
    elif config.schedule == "step":
        passed = sum(epoch >= math.floor(m * config.epochs) for m in config.step_milestones)
        factor = config.step_gamma**passed
    elif config.schedule == "onecycle":
        factor = max(0.0, min(1.0, (1.0 - progress) / (1.0 - config.warmup)))
    else:
        factor = 1.0
    if config.warmup > 0 and progress < config.warmup:
        factor *= progress / config.warmup
    return factor


def parameter_groups(model: nn.Module, config: TrainConfig) -> list[dict[str, Any]]:
    """The optimiser's groups of trainable parameters: normalisation layers' biases (learning rate times
    ``norm_bias_lr_scale``, weight decay divided by it, so their decay per step is unchanged), then the rest."""
    norms = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    norm_biases = {id(m.bias) for m in model.modules() if isinstance(m, norms) and m.bias is not None}
    trainable = [p for p in model.parameters() if p.requires_grad]
    scale = config.norm_bias_lr_scale
    biases = [p for p in trainable if id(p) in norm_biases]
    rest = [p for p in trainable if id(p) not in norm_biases]
    if scale == 1.0 or not biases:
        return [{"params": trainable, "lr": config.lr, "weight_decay": config.weight_decay}]
    return [{"params": biases, "lr": config.lr * scale, "weight_decay": config.weight_decay / scale},
            {"params": rest, "lr": config.lr, "weight_decay": config.weight_decay}]  # fmt: skip


def per_iteration_lr(config: TrainConfig) -> bool:
    """Whether the recipe's learning rate changes every iteration (else once per epoch)."""
    return config.schedule == "onecycle" or config.warmup > 0


def weight_average(model: nn.Module, decay: float) -> nn.Module | None:
    """An exponential moving average of ``model``'s weights and batch-norm statistics (None when ``decay`` is 0).

    The decay warms up as ``min(decay, (1 + n) / (10 + n))`` after ``n`` updates, so that a short run is not an
    average dominated by its random initial weights.
    """
    if decay <= 0:
        return None
    from torch.optim.swa_utils import AveragedModel

    @torch.no_grad()
    def update(averages: list[Tensor], currents: list[Tensor], updates: Tensor) -> None:
        n = float(updates)
        weight = 1.0 - min(decay, (1.0 + n) / (10.0 + n))
        if averages[0].is_floating_point():
            torch._foreach_lerp_(averages, currents, weight)
        else:  # counters such as batch norm's num_batches_tracked follow the model
            for average, current in zip(averages, currents):
                average.copy_(current)

    return AveragedModel(model, multi_avg_fn=update, use_buffers=True)


def init_from_data(model: nn.Module, splits: DatasetSplits, device: torch.device, count: int = 5000) -> None:
    """Give the layers that initialise themselves from data (e.g. a whitening stem) up to ``count`` training
    images, un-augmented and normalised, taken in a fixed order so that a run repeats exactly. A text model's
    layers that fit themselves to data (the n-gram bag of ``ngram_encoder``) get the whole training split's token
    ids and labels."""
    if splits.info.modality == "text":
        for module in model.modules():
            if callable(getattr(module, "init_from_text", None)):
                module.init_from_text(splits.train.images, splits.train.labels)
        return
    takers = [m for m in model.modules() if callable(getattr(m, "init_from_data", None))]
    if not takers:
        return
    from anytime.data.augment import normalize

    images = normalize(splits.train.images[:count], splits.info.mean, splits.info.std).to(device)
    for module in takers:
        module.init_from_data(images)


def require_checkpoint(run_dir: str | Path, verb: str) -> Path:
    """The checkpoint of the run to ``verb`` (resume or extend), or a one-line error saying there is none."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise AnytimeError(
            f"no run to {verb} at {run_dir} (no {CHECKPOINT}); train one with `anytime train --out {run_dir}`"
        )
    return path


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD over :func:`parameter_groups`, or AdamW (``momentum`` its first beta) with no weight decay on biases
    and normalisation weights (every 1-D parameter), as transformers are trained."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(parameter_groups(model, config), momentum=config.momentum, nesterov=config.nesterov)
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.dim() > 1], "lr": config.lr, "weight_decay": config.weight_decay},
              {"params": [p for p in trainable if p.dim() <= 1], "lr": config.lr, "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW([g for g in groups if g["params"]], betas=(config.momentum, 0.999))


@torch.no_grad()
def _mirror_note(cfg: TrainConfig, info: DatasetInfo) -> str:
    """Why the recipe's augmentation has no mirror flips, when it is the dataset's default."""
    if cfg.augment is not None or info.hflip:
        return ""
    return " (no mirror flips: a mirrored image may be another class here; --augment crop+flip adds them)"


def evaluate_exits(
    model: nn.Module,
    loader: BatchLoader,
    device: torch.device,
    *,
    mirror: bool = False,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> tuple[float, list[float]]:
    """Mean cross-entropy of the model's (last) output and the accuracy of every exit (one for a plain model).

    ``mirror`` averages the logits of each image and its left-right mirror (test-time augmentation). ``reduce``
    sums the loss, the hits and the count over data-parallel processes, each of which scored its own share.
    """
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct: Tensor | None = None
    count = 0
    with torch.no_grad():  # no autograd graph kept for scoring (and no warning when the loss becomes a float)
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            logits = model(images)
            if mirror:
                logits = (logits + model(images.flip(3))) / 2
            if logits.dim() == 2:
                logits = logits.unsqueeze(0)
            loss_sum += F.cross_entropy(logits[-1], labels, reduction="sum").double()
            hits = (logits.argmax(dim=2) == labels).sum(dim=1)
            correct = hits if correct is None else correct + hits
            count += labels.numel()
    model.train(was_training)
    if reduce is not None:
        if correct is None:  # this process's share was empty
            correct = torch.zeros(len(getattr(model, "exit_info", None) or [None]), device=device, dtype=torch.int64)
        totals = reduce(torch.cat([torch.stack([loss_sum, loss_sum.new_tensor(count)]), correct.double()]))
        loss_sum, count, correct = totals[0], int(totals[1]), totals[2:].long()
    if count == 0 or correct is None:
        return float("nan"), [float("nan")]
    return float(loss_sum) / count, [int(c) / count for c in correct]


def evaluate(model: nn.Module, loader: BatchLoader, device: torch.device) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` (its last exit, for a multi-exit model) over ``loader``."""
    loss, accuracies = evaluate_exits(model, loader, device)
    return loss, accuracies[-1]


class Trainer:
    """Trains one model on one dataset into a run directory.

    The run directory holds ``config.json``, ``metrics.csv`` (one row per epoch), ``iterations.csv``
    (data/forward/backward/step seconds of every iteration), ``checkpoint.pt`` (written atomically
    after every epoch), ``model.safetensors`` and ``summary.json`` at the end.

    Each epoch's randomness (shuffle, augmentation, dropout) is seeded from ``(seed, epoch)``, so a run
    resumed from the checkpoint of epoch ``e`` ends exactly where an uninterrupted run would, bit for bit
    on a CPU (on CUDA only up to the non-determinism of its kernels, unless the user enables
    ``torch.use_deterministic_algorithms``). ``peak_rss_mb`` is the process's peak resident memory so
    far (model, optimizer and the dataset held in memory; DataLoader workers not included).

    With ``distributed`` (one of the processes torchrun starts), the processes train one model on shares of
    each global batch of ``batch_size`` (DistributedDataParallel), and process 0 alone writes the run folder.
    The gradient is the one a single process computes on the whole batch; batch norm normalises by each
    process's own rows, or with ``distributed.sync_bn`` by the whole batch's statistics, and then the processes
    train the model one process would, up to float rounding. A run resumes with any number of processes.
    """

    def __init__(
        self,
        config: TrainConfig,
        run_dir: str | Path,
        *,
        progress: bool = False,
        on_epoch_end: Callable[[EpochEnd], None] | None = None,
        on_start: Callable[[str], None] | None = None,
        extra_config: dict[str, Any] | None = None,
        create_parents: bool = True,
        distributed: Distributed | None = None,
    ) -> None:
        self.config = config
        self.distributed = distributed
        self.run_dir = Path(run_dir)
        self.create_parents = create_parents
        self.progress = progress
        self.on_epoch_end = on_epoch_end
        self.on_start = on_start
        self.extra_config = dict(extra_config or {})

    def fit(
        self,
        *,
        resume: bool = False,
        extend: bool = False,
        overwrite: bool = False,
        splits: DatasetSplits | None = None,
    ) -> dict[str, Any]:
        """Train (or continue training) and return the summary that is also written to ``summary.json``.

        The run folder must be new, empty, or (with ``overwrite``) an earlier run, whose files alone are
        replaced. ``resume`` continues an interrupted run exactly; ``extend`` continues a run to the larger
        ``epochs`` of this recipe, with the learning-rate schedule recomputed for the new length (recorded in
        the run's ``config.json`` and summary). A run folder is written by one process at a time.
        """
        ctx = self.distributed
        if ctx is None:
            return self._fit_main(resume, extend, overwrite, splits)
        import torch.distributed as dist

        ctx.start(ctx.device(resolve_device(self.config.device)))
        finished = False
        try:
            if not ctx.main:
                ctx.agree(None)  # waits for process 0 to claim the run folder
                summary = self._fit(resume or extend, extend, splits)
            else:
                summary = self._fit_main(resume, extend, overwrite, splits)
            finished = True
            return summary
        except RuntimeError as exc:
            if not isinstance(exc, dist.DistError) and not _LOST_PEER.search(str(exc)):
                raise
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise AnytimeError(f"process {ctx.rank} lost contact with the others ({first}); the run keeps its last "
                               "complete epoch: continue with --resume") from None  # fmt: skip
        finally:
            ctx.stop(together=finished)

    def _fit_main(self, resume: bool, extend: bool, overwrite: bool, splits: DatasetSplits | None) -> dict[str, Any]:
        """Claim the run folder (telling the other processes, if any, whether it could be), then train."""
        with ExitStack() as stack:
            try:
                if (resume or extend) and overwrite:
                    raise AnytimeError("--overwrite starts the run again; it does not go with --resume or --extend")
                if self.run_dir.exists() and not self.run_dir.is_dir():
                    raise AnytimeError(
                        f"--out {self.run_dir} is a file, not a folder; give a new folder name for the run"
                    )
                if not (resume or extend):
                    check_output_dir(self.run_dir, RUN, create_parents=self.create_parents)
                else:
                    require_checkpoint(self.run_dir, "extend" if extend else "resume")
                self.run_dir.parent.mkdir(parents=True, exist_ok=True)
                stack.enter_context(output_lock(self.run_dir))
                fresh = not (resume or extend)
                created = fresh and self._claim(overwrite)
            except AnytimeError as exc:
                if self.distributed is not None:
                    self.distributed.agree(str(exc))
                raise
            if self.distributed is not None:
                self.distributed.agree(None)
            try:
                return self._fit(resume or extend, extend, splits)
            except DiskFullError as exc:
                if not (self.run_dir / CHECKPOINT).is_file():
                    raise
                raise DiskFullError(
                    f"{exc}; the last complete epoch is kept: continue with `anytime train --out {self.run_dir} --resume`"
                ) from None
            except BaseException:
                if fresh and not (self.run_dir / CHECKPOINT).is_file():
                    self._remove_unstarted(created)
                raise

    def _claim(self, overwrite: bool) -> bool:
        """Check the run folder again under the lock; clear an earlier run if allowed. True if we create it."""
        state = check_output_dir(self.run_dir, RUN, create_parents=self.create_parents)
        started = any((self.run_dir / name).is_file() for name in (CHECKPOINT, "model.safetensors"))
        if state is DirState.OURS and started:  # a run that never finished an epoch holds nothing to lose
            init = self.config.init
            if overwrite and init is not None and Path(init).resolve().is_relative_to(self.run_dir.resolve()):
                raise AnytimeError(f"--init {init} is inside {self.run_dir}, which --overwrite would clear; copy the "
                                   "weights elsewhere or choose another --out")  # fmt: skip
            if not overwrite:
                raise AnytimeError(
                    f"{self.run_dir} already holds a run; continue it with --resume, train it longer with --extend "
                    "--epochs N, replace it with --overwrite, or choose another --out"
                )
        if state is DirState.OURS:
            clear_run(self.run_dir)
        self.run_dir.mkdir(exist_ok=True)
        write_marker(self.run_dir, RUN, RUN_ENTRIES)
        return state is DirState.NEW

    def _remove_unstarted(self, created: bool) -> None:
        """A run that failed before its first checkpoint leaves nothing behind (the user's empty folder stays)."""
        if not self.run_dir.is_dir():
            return
        clear_run(self.run_dir)
        (self.run_dir / MARKER).unlink(missing_ok=True)
        if created and not any(self.run_dir.iterdir()):
            self.run_dir.rmdir()

    def _fit(self, resume: bool, extend: bool, splits: DatasetSplits | None) -> dict[str, Any]:
        cfg = self.config
        checkpoint_path = self.run_dir / CHECKPOINT
        state: dict[str, Any] | None = None
        extensions: list[dict[str, Any]] = []
        if resume:
            state = load_checkpoint(checkpoint_path)
            self._check_same_recipe(state["config"], extend=extend)
            extensions = list(state.get("extensions", []))
            before = TrainConfig.from_dict(state["config"]).epochs
            done = int(state["epoch"]) + 1
            if extend and (cfg.epochs < before or (cfg.epochs == before and done >= before)):
                raise AnytimeError(
                    f"--extend trains {self.run_dir} longer: --epochs must be more than its {before} (got {cfg.epochs})"
                )
            extend = extend and cfg.epochs > before  # an interrupted extension goes on like a resume
            if extend:
                extensions.append({"from_epochs": before, "to_epochs": cfg.epochs, "at_epoch": int(state["epoch"]) + 1,
                                   "time": datetime.now(timezone.utc).isoformat(timespec="seconds")})  # fmt: skip
        ctx = self.distributed
        main = ctx is None or ctx.main
        device = resolve_device(cfg.device)
        if ctx is not None:
            device = ctx.device(device)
        if splits is None:
            splits = load_splits(cfg, self.run_dir if state is not None else None)
        info = splits.info
        if info.modality == "text" and (cfg.tta or cfg.augment is not None or cfg.cutout or cfg.channels_last):
            raise AnytimeError("--tta, --augment, --cutout and --channels-last are for images; leave them out for text")
        seed_everything(cfg.seed)
        model = build_model(
            cfg,
            num_classes=info.num_classes,
            in_channels=info.in_channels,
            image_size=info.image_size,
            load_init=state is None,  # a resumed run takes every weight from its checkpoint
            text=(info.vocab_size, info.max_length) if info.modality == "text" else None,
            hf_config=None if state is None else state.get("hf_config"),
        ).to(device)
        hf_config = getattr(getattr(model, "backbone", model), "hf_config", None)
        if state is None and cfg.init is None:
            init_from_data(model, splits, device)
        mask: Mask | None = None
        plan: ChannelPlan | None = None
        dense_run: str | None = None
        dense_parameters: int | None = None
        source = state
        if state is None and cfg.prune_from is not None and cfg.prune_unit == "channels":
            # a structured ticket: the dense run's rewound weights cut to the kept channels, a smaller network
            structured = make_channel_ticket(model, cfg.prune_from, sparsity=cfg.sparsity, reset_epoch=cfg.reset_epoch,
                                             scope=cfg.prune_scope, input_shape=(info.in_channels, *info.image_size),
                                             num_classes=info.num_classes)  # fmt: skip
            self._check_ticket_recipe(structured.rewind["config"], structured.dense_run)
            plan, dense_run, dense_parameters = structured.plan, str(structured.dense_run), structured.dense_parameters
            model.load_state_dict(structured.rewind["model"])
            shrink(model, plan)
            # the momentum of removed channels has no place in the smaller network: the optimiser starts afresh
            source = {**structured.rewind, "model": model.state_dict(), "optimizer": None}
        elif state is None and cfg.prune_from is not None:  # a lottery ticket: prune, then rewind to the dense run
            ticket = make_ticket(model, cfg.prune_from, sparsity=cfg.sparsity, reset_epoch=cfg.reset_epoch,
                                 scope=cfg.prune_scope)  # fmt: skip
            self._check_ticket_recipe(ticket.rewind["config"], ticket.dense_run)
            mask, source, dense_run = ticket.mask, ticket.rewind, str(ticket.dense_run)
        elif state is not None and "mask" in state:
            mask = Mask({name: keep.bool() for name, keep in state["mask"].items()})
            dense_run = str(state.get("dense_run", cfg.prune_from))
        elif state is not None and "channels" in state:
            plan = ChannelPlan.from_dict(state["channels"], str(checkpoint_path))
            dense_run, dense_parameters = str(state.get("dense_run", cfg.prune_from)), state.get("dense_parameters")
            shrink(model, plan)
        if ctx is not None and ctx.sync_bn:
            sync_batch_norms(model)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self._check_resources(model, info.input_shape)
        optimizer = make_optimizer(model, cfg)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: lr_factor(cfg, epoch))
        history: list[dict[str, Any]] = []
        start_epoch = 0
        ema = weight_average(model, cfg.ema)
        if state is not None and ctx is not None and bool(state.get("sync_bn", False)) != ctx.sync_bn:
            raise AnytimeError(f"{self.run_dir} was trained {'with' if state.get('sync_bn') else 'without'} --sync-bn; "
                               "resume it the same way (the batch norms would change mid-run)")  # fmt: skip
        if source is not None:
            saved = source.get("dataset", {}).get("fingerprint")
            if saved != info.fingerprint:
                raise AnytimeError(
                    f"the {info.name} data at {info.source} changed since "
                    f"{self.run_dir if state is not None else dense_run} was checkpointed; "
                    "a resumed run or a ticket would not match it, so start a new --out"
                )
            model.load_state_dict(source["model"])
            scheduler.load_state_dict(source["scheduler"])
            start_epoch = int(source["epoch"]) + 1
            if source["optimizer"] is not None:
                optimizer.load_state_dict(source["optimizer"])
            else:
                for group in optimizer.param_groups:
                    group["lr"] = group["initial_lr"] * lr_factor(cfg, start_epoch)
        if mask is not None:
            mask.apply(model, optimizer)
        if (mask is not None or plan is not None) and state is None:  # the ticket's own average, not the dense run's
            ema = weight_average(model, cfg.ema)
        if state is not None:
            history = list(state["history"])
            if ema is not None:
                if "ema" not in state:
                    raise AnytimeError(f"{checkpoint_path} holds no weight average, but the recipe asks for --ema "
                                       f"{cfg.ema}; start a new --out")  # fmt: skip
                ema.load_state_dict(state["ema"])
            if extend:  # the schedule of the new length, from the epoch the run goes on at
                for group in optimizer.param_groups:
                    group["lr"] = group["initial_lr"] * lr_factor(cfg, start_epoch)
        augment = Augment("none", 0) if info.modality == "text" else cfg.augmentation(info.hflip)
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._write_config(info.to_dict(), device, resumed_from=start_epoch if state is not None else None,
                               extensions=extensions, augment=augment, hf_config=hf_config)  # fmt: skip
            if mask is not None and state is None:
                mask.save(self.run_dir / MASK_FILE)
            if plan is not None and state is None:
                plan.save(self.run_dir / CHANNELS_FILE)
            if splits.tokenizer is not None and not (self.run_dir / TOKENIZER_FILE).is_file():
                write_text(self.run_dir / TOKENIZER_FILE, splits.tokenizer)
        forward: nn.Module = _TrainingForward(model)
        if ctx is not None:
            # the sandwich rule leaves the slices it did not pick (their norms and heads) without a gradient
            forward = ctx.wrap(forward, device, find_unused=cfg.sandwich or cfg.ladder is not None)

        loader_kw = {"seed": cfg.seed, "workers": cfg.workers, "prefetch_factor": cfg.prefetch_factor,
                     "pin_memory": cfg.pin_memory and device.type == "cuda", "part": (0, 1) if ctx is None else ctx.part}  # fmt: skip
        train_loader = make_loader(splits.train, info, batch_size=cfg.batch_size, train=True, augment=augment,
                                   **loader_kw)  # fmt: skip
        val_loader = make_loader(splits.val, info, batch_size=cfg.eval_batch_size, train=False, **loader_kw)
        clock = Clock(device)
        if self.on_start is not None:
            self.on_start(
                f"{'resuming' if state is not None else 'training'} {cfg.model} on {info.name} "
                f"({len(splits.train)} train / {len(splits.val)} val / {len(splits.test)} test "
                f"{'sentences' if info.modality == 'text' else 'images'}) "
                f"from epoch {start_epoch + 1} to {cfg.epochs} on {device} -> {self.run_dir}"
                + ("" if info.modality == "text" else f"; augmentation {augment.describe()}{_mirror_note(cfg, info)}")
            )

        def snapshot(epoch: int) -> dict[str, Any]:
            return {
                "epoch": epoch, "config": cfg.to_dict(), "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "history": history,
                "dataset": info.to_dict(), "extensions": extensions,
                **({"hf_config": hf_config} if hf_config is not None else {}),
                **({"ema": ema.state_dict()} if ema is not None else {}),
                **({"mask": mask.state(), "dense_run": dense_run} if mask is not None else {}),
                **({"channels": plan.to_dict(), "dense_run": dense_run, "dense_parameters": dense_parameters}
                   if plan is not None else {}),
                "sync_bn": ctx is not None and ctx.sync_bn,
            }  # fmt: skip

        if main and start_epoch == 0 and 0 in cfg.keep_checkpoints:
            save_checkpoint(kept_checkpoint(self.run_dir, 0), snapshot(-1))
        for epoch in range(start_epoch, cfg.epochs):
            record, phases = self._run_epoch(model, forward, ema, optimizer, train_loader, val_loader, device, clock,
                                             epoch, history, mask)  # fmt: skip
            scheduler.step()
            history.append({"metrics": record, "phases": phases})
            if not main:
                continue
            if epoch + 1 in cfg.keep_checkpoints:  # a rewind point for lottery tickets, before the epoch counts as done
                save_checkpoint(kept_checkpoint(self.run_dir, epoch + 1), snapshot(epoch))
            save_checkpoint(checkpoint_path, snapshot(epoch))
            self._write_tables(history)
            if self.on_epoch_end is not None:
                self.on_epoch_end(EpochEnd(epoch=epoch, metrics=record, run_dir=self.run_dir))

        final = model if ema is None else ema.module
        for module in list(final.modules()):
            if callable(getattr(module, "fit_to_validation", None)) and len(splits.val):
                module.fit_to_validation(final, splits.val.images, splits.val.labels)
        reduce = None if ctx is None else ctx.sum
        test_loader = make_loader(splits.test, info, batch_size=cfg.eval_batch_size, train=False, **loader_kw)
        if hasattr(final, "measure_cost"):  # a step's FLOPs depend on the images (SACT): count them on real ones
            final.measure_cost(images.to(device) for images, _ in val_loader)
        test_loss, test_accs = evaluate_exits(final, test_loader, device, reduce=reduce)
        if main:
            save_weights(final, self.run_dir / "model.safetensors")
        summary = self._summary(history, final, device, test_loss, test_accs, info.to_dict())
        summary["augment"] = augment.describe()
        summary["processes"] = 1 if ctx is None else ctx.world_size
        if mask is not None:
            nonzero: int = sum(int(p.count_nonzero()) for p in final.parameters())  # type: ignore[misc]
            summary["ticket"] = {"prune_from": cfg.prune_from, "dense_run": dense_run,
                                 "sparsity": mask.sparsity, "reset_epoch": cfg.reset_epoch, "scope": cfg.prune_scope,
                                 "nonzero_parameters": nonzero}  # fmt: skip
        if plan is not None:
            parameters: int = sum(p.numel() for p in final.parameters())  # type: ignore[misc]
            summary["ticket"] = {"prune_from": cfg.prune_from, "dense_run": dense_run, "unit": "channels",
                                 "sparsity": plan.sparsity, "reset_epoch": cfg.reset_epoch, "scope": cfg.prune_scope,
                                 "parameters": parameters,
                                 "dense_parameters": dense_parameters}  # fmt: skip
        if cfg.tta:
            _, mirrored = evaluate_exits(final, test_loader, device, mirror=True, reduce=reduce)
            summary["final"]["test_acc_tta"] = mirrored[-1]
            for entry, acc in zip(summary.get("exits", []), mirrored):
                entry["test_acc_tta"] = acc
        if extensions:
            summary["extended"] = extensions
        if main and len(splits.test):
            baseline = fit_baseline(splits, seed=cfg.seed)
            summary["baseline"] = {**baseline.to_dict(),
                                   "gap_to_last_exit": summary["final"]["test_acc"] - baseline.test_acc}  # fmt: skip
        if main:
            write_json(self.run_dir / "summary.json", summary)
        return summary

    def _run_epoch(
        self,
        model: nn.Module,
        forward: nn.Module,
        ema: nn.Module | None,
        optimizer: torch.optim.Optimizer,
        train_loader: BatchLoader,
        val_loader: BatchLoader,
        device: torch.device,
        clock: Clock,
        epoch: int,
        history: list[dict[str, Any]],
        mask: Mask | None = None,
    ) -> tuple[dict[str, Any], dict[str, list[float]]]:
        cfg = self.config
        ctx = self.distributed
        # per-sample randomness (dropout, stochastic depth) is drawn on each process's own rows: own streams
        torch.manual_seed(
            derive_seed(cfg.seed, epoch) if ctx is None else derive_seed(cfg.seed, epoch, "rank", ctx.rank)
        )
        train_loader.set_epoch(epoch)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model.train()
        weights = exit_weights(cfg, model).to(device)
        log = PhaseLog()
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)  # the last exit's cross-entropy
        objective_sum = torch.zeros((), device=device, dtype=torch.float64)  # what is minimised
        correct = torch.zeros((), device=device, dtype=torch.int64)
        seen = 0
        batches = len(train_loader)
        bar = progress_bar(batches, f"epoch {epoch + 1}/{cfg.epochs}", enabled=self.progress and (ctx is None or ctx.main),
                           unit="batch")  # fmt: skip
        stepwise = per_iteration_lr(cfg)
        memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        epoch_start = tick = clock.now()
        for iteration, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True, memory_format=memory_format)
            labels = labels.to(device, non_blocking=True)
            t_data = clock.now()
            chosen = None
            if hasattr(model, "training_steps"):  # every process must choose alike: a stream of its own per batch
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(derive_seed("steps", cfg.seed, epoch, iteration))
                    chosen = model.training_steps()
            if chosen is not None and len(chosen) >= len(weights):
                chosen = None
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
                logits = forward(images, chosen)
            step_weights = weights if chosen is None else weights[chosen]
            logits = logits.float()
            multi_exit = logits.dim() == 3
            if multi_exit:
                loss = multi_exit_loss(
                    logits,
                    labels,
                    step_weights,
                    distill=cfg.distill,
                    temperature=cfg.distill_temperature,
                    label_smoothing=cfg.label_smoothing,
                    teacher=cfg.distill_teacher,
                )
                logits = logits[-1]
            else:
                loss = F.cross_entropy(logits, labels, label_smoothing=cfg.label_smoothing)
            if hasattr(model, "auxiliary_loss"):  # e.g. SACT's ponder cost, kept by the model's forward
                loss = loss + model.auxiliary_loss()
            with torch.no_grad():
                objective_sum += loss.detach().double() * labels.numel()
                last_loss = F.cross_entropy(logits, labels) if multi_exit else loss
                loss_sum += last_loss.detach().double() * labels.numel()
                correct += (logits.argmax(dim=1) == labels).sum()
            if ctx is not None:  # processes' gradients are averaged: weigh each by its share of the global batch
                loss = loss * (labels.numel() * ctx.world_size / train_loader.batch_total(iteration))
            t_forward = clock.now()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if mask is not None:
                mask.mask_gradients(model)
            t_backward = clock.now()
            if stepwise:
                factor = lr_factor(cfg, epoch, (iteration + 1) / batches)
                for group in optimizer.param_groups:
                    group["lr"] = group["initial_lr"] * factor
            optimizer.step()
            if mask is not None:  # float rounding in the step must not revive a pruned weight
                mask.apply(model)
            if ema is not None:
                ema.update_parameters(model)  # type: ignore[operator]
            t_step = clock.now()
            batch = labels.numel() if ctx is None else train_loader.batch_total(iteration)  # all processes' images
            log.add(t_data - tick, t_forward - t_data, t_backward - t_forward, t_step - t_backward, batch)
            seen += labels.numel()
            tick = t_step
            bar.update(1)
            if iteration % 50 == 0 and not self._all_finite(loss):
                bar.close()
                raise AnytimeError(
                    f"training diverged in epoch {epoch + 1}, iteration {iteration + 1} (loss is {float(loss):.4g}); "
                    f"lower --lr (now {cfg.lr}) and start again"
                )
        bar.close()
        if ctx is not None:
            totals = ctx.sum(torch.stack([loss_sum, objective_sum, correct.double(), loss_sum.new_tensor(seen)]))
            loss_sum, objective_sum, correct, seen = totals[0], totals[1], totals[2].long(), int(totals[3])
            ctx.share_buffers(model, ema)
        train_s = clock.now() - epoch_start
        val_loss, val_accs = evaluate_exits(model if ema is None else ema.module, val_loader, device,
                                            reduce=None if ctx is None else ctx.sum)  # fmt: skip
        val_acc = val_accs[-1]
        epoch_s = clock.now() - epoch_start
        train_loss = float(loss_sum) / max(seen, 1)
        if not math.isfinite(train_loss):
            raise AnytimeError(
                f"training diverged in epoch {epoch + 1} (mean loss is {train_loss}); lower --lr (now {cfg.lr})"
            )
        phase_totals = log.totals()
        previous = history[-1]["metrics"]["elapsed_s"] if history else 0.0
        cuda_peak = cuda_peak_bytes(device)
        record: dict[str, Any] = {
            "epoch": epoch, "lr": cfg.lr * lr_factor(cfg, epoch), "train_loss": train_loss,
            "train_acc": int(correct) / max(seen, 1), "val_loss": val_loss, "val_acc": val_acc,
            "epoch_s": epoch_s, "train_s": train_s, "eval_s": epoch_s - train_s, "elapsed_s": previous + epoch_s,
            **{f"{phase}_s": phase_totals[phase] for phase in PHASES},
            "images_per_s": seen / train_s if train_s > 0 else float("nan"),
            "peak_rss_mb": peak_rss_bytes() / 2**20,
            "cuda_peak_mb": None if cuda_peak is None else cuda_peak / 2**20,
        }  # fmt: skip
        if len(val_accs) > 1:
            record["train_objective"] = float(objective_sum) / max(seen, 1)
            record.update({f"val_acc_exit{k}": acc for k, acc in enumerate(val_accs)})
        phases = {"data": log.data, "forward": log.forward, "backward": log.backward, "step": log.step,
                  "batch": [float(b) for b in log.batch]}  # fmt: skip
        return record, phases

    def _check_same_recipe(self, saved: dict[str, Any], *, extend: bool = False) -> None:
        current = self.config.to_dict()
        saved = TrainConfig.from_dict(saved).to_dict()  # a checkpoint from before a setting existed has its default
        free = set(TrainConfig.RUNTIME_FIELDS) | ({"epochs"} if extend else set())
        differing = [
            f"{key}={current[key]!r} (run has {saved.get(key)!r})"
            for key in current
            if key not in free and saved.get(key) != current[key]
        ]
        if differing:
            longer = (
                "; to train longer, use --extend --epochs N"
                if not extend and current["epochs"] != saved["epochs"]
                else ""
            )
            raise AnytimeError(
                f"{'--extend' if extend else '--resume'} continues {self.run_dir} as it was configured, but these "
                f"differ: {'; '.join(differing)}; drop those options or start a new --out{longer}"
            )

    def _all_finite(self, loss: Tensor) -> bool:
        """Whether the loss is finite in every process (all of them stop together, or none does)."""
        finite = torch.tensor(float(math.isfinite(float(loss.detach()))), device=loss.device)
        if self.distributed is not None:
            self.distributed.sum(finite)
        return bool(finite >= (1 if self.distributed is None else self.distributed.world_size))

    def _check_ticket_recipe(self, dense: dict[str, Any], dense_run: Path) -> None:
        """A ticket trains on with its dense run's recipe: refuse one that differs in more than the ticket's own
        settings and the speed-only ones."""
        current = self.config.to_dict()
        saved = TrainConfig.from_dict(dense).to_dict()
        free = {*TrainConfig.RUNTIME_FIELDS, "prune_from", "sparsity", "reset_epoch", "prune_scope", "prune_unit"}
        differing = [f"{key}={current[key]!r} (dense run has {saved[key]!r})" for key in current
                     if key not in free and saved.get(key) != current[key]]  # fmt: skip
        if differing:
            raise AnytimeError(f"a ticket trains on with the recipe of its dense run {dense_run}, but these differ: "
                               f"{'; '.join(differing)}; use the dense run's recipe")  # fmt: skip

    def _check_resources(self, model: nn.Module, shape: tuple[int, ...]) -> None:
        """Refuse, before the first batch, a batch that cannot fit in memory or checkpoints that cannot fit on disk."""
        cfg = self.config
        samples = f"sentences of {shape[0]} tokens" if len(shape) == 1 else f"{shape[1]}x{shape[2]} images"
        check_forward_memory(model, shape, cfg.batch_size, training=True,
                             what=f"training {cfg.model} on batches of {cfg.batch_size} {samples}",
                             hint="lower --batch-size, --image-size or --max-length")  # fmt: skip
        # the checkpoint (weights and momentum) twice while it is replaced, and the final weights
        check_disk(self.run_dir, 5 * model_bytes(model), f"the checkpoints of {cfg.model}",
                   "free some space or choose another --out")  # fmt: skip

    def _write_config(
        self, dataset: dict[str, Any], device: torch.device, resumed_from: int | None,
        extensions: list[dict[str, Any]] | None = None, augment: Augment | None = None,
        hf_config: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        path = self.run_dir / "config.json"
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        payload: dict[str, Any] = {
            "train": self.config.to_dict(),
            "dataset": dataset,
            "device": str(device),
            "machine": describe_machine(self.config.data_root),
            "git_sha": git_sha(),
            "processes": 1 if self.distributed is None else self.distributed.world_size,
            **({"sync_bn": self.distributed.sync_bn} if self.distributed is not None else {}),
            "created": now,
            **({"augment": dataclasses.asdict(augment)} if augment is not None else {}),
            **({"hf_config": hf_config} if hf_config is not None else {}),  # the run rebuilds from it, not --init
            **self.extra_config,
        }
        if resumed_from is not None and path.exists():
            try:
                old = json.loads(path.read_text())
            except ValueError:
                old = {}  # the checkpoint, not this record, is what the run resumes from
            payload["created"] = old.get("created", now)
            payload["resumed"] = [*old.get("resumed", []),
                                  {"at_epoch": resumed_from, "time": now, "processes": payload["processes"]}]  # fmt: skip
        if extensions:
            payload["extended"] = extensions
        write_json(path, payload)

    def _write_tables(self, history: list[dict[str, Any]]) -> None:
        rows = [entry["metrics"] for entry in history]
        exit_columns = [key for key in rows[-1] if key.startswith("val_acc_exit") or key == "train_objective"]
        write_csv(self.run_dir / "metrics.csv", rows, [*METRICS_COLUMNS, *exit_columns])
        iterations = [
            {"epoch": entry["metrics"]["epoch"], "iteration": i, "batch": int(batch),
             **{f"{p}_s": entry["phases"][p][i] for p in PHASES}}
            for entry in history
            for i, batch in enumerate(entry["phases"]["batch"])
        ]  # fmt: skip
        write_csv(self.run_dir / "iterations.csv", iterations, ["epoch", "iteration", "batch",
                                                                *(f"{p}_s" for p in PHASES)])  # fmt: skip

    def _summary(
        self,
        history: list[dict[str, Any]],
        model: nn.Module,
        device: torch.device,
        test_loss: float,
        test_accs: list[float],
        dataset: dict[str, Any],
    ) -> dict[str, Any]:
        last = history[-1]["metrics"]
        test_acc = test_accs[-1]

        def phase_summary(entries: list[dict[str, Any]]) -> dict[str, float] | None:
            if not entries:
                return None
            log = PhaseLog()
            for entry in entries:
                p = entry["phases"]
                for values in zip(p["data"], p["forward"], p["backward"], p["step"], p["batch"]):
                    log.add(*values[:4], int(values[4]))
            return log.summary()

        return {
            "run_dir": str(self.run_dir),
            "model": self.config.model,
            "data": self.config.data,
            "dataset": {k: dataset[k] for k in ("name", "num_classes", "in_channels", "image_size", "source")},
            "epochs": len(history),
            "parameters": sum(p.numel() for p in model.parameters()),
            "final": {
                "train_acc": last["train_acc"],
                "val_acc": last["val_acc"],
                "val_loss": last["val_loss"],
                "test_acc": test_acc,
                "test_loss": test_loss,
            },  # fmt: skip
            "best_val_acc": max(h["metrics"]["val_acc"] for h in history),
            "train_time_s": sum(h["metrics"]["train_s"] for h in history),
            "wall_time_s": last["elapsed_s"],
            "timing": {"epoch0": phase_summary(history[:1]), "steady": phase_summary(history[1:])},
            "peak_rss_mb": max(h["metrics"]["peak_rss_mb"] for h in history),
            "cuda_peak_mb": None
            if last["cuda_peak_mb"] is None
            else max(h["metrics"]["cuda_peak_mb"] for h in history),
            "device": device_label(device),
            "torch_threads": torch.get_num_threads(),
            **self._exit_summary(model, last, test_accs),
        }

    @staticmethod
    def _exit_summary(model: nn.Module, last: dict[str, Any], test_accs: list[float]) -> dict[str, Any]:
        info = getattr(model, "exit_info", None)
        if info is None:
            return {}
        return {
            "exits": [
                {**e.to_dict(), "val_acc": last[f"val_acc_exit{e.index}"], "test_acc": test_accs[e.index]} for e in info
            ],
            "backbone_flops": model.backbone_flops,  # type: ignore[union-attr]
        }


def read_metrics(run_dir: str | Path) -> list[dict[str, str]]:
    """The rows of a run's ``metrics.csv`` (one per epoch), as strings."""
    return read_csv(Path(run_dir) / "metrics.csv")
