"""The instrumented training loop: SGD, per-epoch metrics, per-iteration phase timing, exact resume."""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anytime.backbones.footprint import check_forward_memory, model_bytes
from anytime.data import Augment, BatchLoader, DatasetSplits, Delivery, make_loader
from anytime.data.base import DatasetInfo
from anytime.data.text import TOKENIZER_FILE
from anytime.errors import AnytimeError, first_line
from anytime.train.channels import CHANNELS_FILE
from anytime.train.checkpoint import load_checkpoint, save_checkpoint, save_weights
from anytime.train.config import TrainConfig
from anytime.train.distributed import Distributed, sync_batch_norms
from anytime.train.epoch import EpochJob, TrainingForward, run_epoch
from anytime.train.evaluation import evaluate_exits
from anytime.train.linear_baseline import fit_baseline
from anytime.train.logbook import RunSetting, data_note, train_summary, write_run_config, write_tables
from anytime.train.multi_exit import build_model
from anytime.train.pruning import MASK_FILE, kept_checkpoint
from anytime.train.recipe import init_from_data, lr_factor, make_optimizer, weight_average
from anytime.train.records import CHECKPOINT
from anytime.train.splits import load_splits
from anytime.train.summary import RunSummary
from anytime.train.tickets import RunTicket, run_ticket
from anytime.train.timing import Clock
from anytime.utils.io import DiskFullError, write_json, write_text
from anytime.utils.machine import resolve_device
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
from anytime.utils.resources import check_disk
from anytime.utils.seed import seed_everything

# what gloo and NCCL say (as plain RuntimeErrors) when a peer process has gone
_LOST_PEER = re.compile(r"gloo|nccl|connection (reset|closed|refused)|broken pipe|timed out", re.IGNORECASE)
_SOURCE_PLACE = re.compile(r"^\[[^\]\s]+:\d+\]\s*")  # "[.../gloo/transport/tcp/pair.cc:545] " before gloo's words


def _peer_error(exc: BaseException, limit: int = 160) -> str:
    """The first sentence of a communication error, without the C++ source place, cut at a word if long."""
    text = _SOURCE_PLACE.sub("", first_line(exc))
    sentence = re.split(r"(?<=\.)\s", text, maxsplit=1)[0].rstrip(".")
    if len(sentence) > limit:
        sentence = sentence[:limit].rsplit(" ", 1)[0] + " ..."
    return sentence


@dataclass(frozen=True)
class EpochEnd:
    """What a callback sees after an epoch has been checkpointed."""

    epoch: int
    metrics: dict[str, float | None]
    run_dir: Path


@dataclass
class _Training:
    """One training's moving parts, built by :meth:`Trainer._prepare`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    ema: nn.Module | None
    ticket: RunTicket
    history: list[dict[str, Any]]
    start_epoch: int
    hf_config: dict[str, Any] | None


def require_checkpoint(run_dir: str | Path, verb: str) -> Path:
    """The checkpoint of the run to ``verb`` (resume or extend), or a one-line error saying there is none."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise AnytimeError(
            f"no run to {verb} at {run_dir} (no {CHECKPOINT}); train one with `anytime train --out {run_dir}`"
        )
    return path


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
    ) -> RunSummary:
        """Train (or continue training) and return the summary that is also written to ``summary.json``.

        The run folder must be new, empty, or (with ``overwrite``) an earlier run, whose files alone are
        replaced. ``resume`` continues an interrupted run exactly; ``extend`` continues a run to the larger
        ``epochs`` of this recipe, with the learning-rate schedule recomputed for the new length (recorded in
        the run's ``config.json`` and summary). A run folder is written by one process at a time.
        """
        ctx = self.distributed
        if ctx is None:
            return RunSummary.from_dict(self._fit_main(resume, extend, overwrite, splits))
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
            return RunSummary.from_dict(summary)
        except RuntimeError as exc:
            if not isinstance(exc, dist.DistError) and not _LOST_PEER.search(str(exc)):
                raise
            raise AnytimeError(f"process {ctx.rank} lost contact with the others ({_peer_error(exc)}); the run keeps its last "
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
        cfg, ctx = self.config, self.distributed
        state, extensions, extend = self._resumed(resume, extend)
        device = resolve_device(cfg.device)
        if ctx is not None:
            device = ctx.device(device)
        if splits is None:
            splits = load_splits(cfg, self.run_dir if state is not None else None)
        info = splits.info
        if info.modality == "text" and (cfg.tta or cfg.augment is not None or cfg.cutout or cfg.channels_last):
            raise AnytimeError("--tta, --augment, --cutout and --channels-last are for images; leave them out for text")
        seed_everything(cfg.seed)
        training = self._prepare(state, splits, device, extend)
        augment = Augment("none", 0) if info.modality == "text" else cfg.augmentation(info.hflip)
        if ctx is None or ctx.main:
            self._write_start(training, state, splits, device, extensions, augment)
        forward: nn.Module = TrainingForward(training.model)
        if ctx is not None:
            # the sandwich rule leaves the slices it did not pick (their norms and heads) without a gradient
            forward = ctx.wrap(forward, device, find_unused=cfg.sandwich or cfg.ladder is not None)
        delivery = Delivery(workers=cfg.workers, prefetch_factor=cfg.prefetch_factor,
                            pin_memory=cfg.pin_memory and device.type == "cuda",
                            part=(0, 1) if ctx is None else ctx.part)  # fmt: skip
        loader_kw = {"seed": cfg.seed, "delivery": delivery}
        job = EpochJob(config=cfg, model=training.model, forward=forward, optimizer=training.optimizer,
                       train_loader=make_loader(splits.train, info, batch_size=cfg.batch_size, train=True,
                                                augment=augment, **loader_kw),
                       val_loader=make_loader(splits.val, info, batch_size=cfg.eval_batch_size, train=False, **loader_kw),
                       device=device, clock=Clock(device), ema=training.ema, mask=training.ticket.mask,
                       distributed=ctx, progress=self.progress)  # fmt: skip
        if self.on_start is not None:
            self.on_start(
                f"{'resuming' if state is not None else 'training'} {cfg.model} on {info.name} "
                f"({len(splits.train)} train / {len(splits.val)} val / {len(splits.test)} test "
                f"{'sentences' if info.modality == 'text' else 'images'}) "
                f"from epoch {training.start_epoch + 1} to {cfg.epochs} on {device} -> {self.run_dir}"
                + data_note(cfg, splits, augment)
            )
        self._train_epochs(training, job, info, extensions)
        test_loader = make_loader(splits.test, info, batch_size=cfg.eval_batch_size, train=False, **loader_kw)
        summary = self._finish(training, job, splits, test_loader, augment)
        if extensions:
            summary["extended"] = extensions
        if (ctx is None or ctx.main) and len(splits.test):
            baseline = fit_baseline(splits, seed=cfg.seed)
            summary["baseline"] = {**baseline.to_dict(),
                                   "gap_to_last_exit": summary["final"]["test_acc"] - baseline.test_acc}  # fmt: skip
        if ctx is None or ctx.main:
            write_json(self.run_dir / "summary.json", summary)
        return summary

    def _resumed(self, resume: bool, extend: bool) -> tuple[dict[str, Any] | None, list[dict[str, Any]], bool]:
        """The checkpoint a resumed run goes on from (None for a new run), the run's extensions so far (with this
        one, if it extends), and whether this is an extension (an interrupted one goes on like a resume)."""
        if not resume:
            return None, [], extend
        cfg = self.config
        state = load_checkpoint(self.run_dir / CHECKPOINT)
        self._check_same_recipe(state["config"], extend=extend)
        extensions = list(state.get("extensions", []))
        before = TrainConfig.from_dict(state["config"]).epochs
        done = int(state["epoch"]) + 1
        if extend and (cfg.epochs < before or (cfg.epochs == before and done >= before)):
            raise AnytimeError(
                f"--extend trains {self.run_dir} longer: --epochs must be more than its {before} (got {cfg.epochs})"
            )
        extend = extend and cfg.epochs > before
        if extend:
            extensions.append({"from_epochs": before, "to_epochs": cfg.epochs, "at_epoch": int(state["epoch"]) + 1,
                               "time": datetime.now(timezone.utc).isoformat(timespec="seconds")})  # fmt: skip
        return state, extensions, extend

    def _prepare(self, state: dict[str, Any] | None, splits: DatasetSplits, device: torch.device,
                 extend: bool) -> _Training:  # fmt: skip
        """The model, optimizer, schedule and weight average, as new or as the checkpoint (or ticket) left them."""
        cfg, ctx, info = self.config, self.distributed, splits.info
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
        ticket = run_ticket(cfg, model, state, info, self.run_dir / CHECKPOINT)
        if ctx is not None and ctx.sync_bn:
            sync_batch_norms(model)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self._check_resources(model, info.input_shape)
        optimizer = make_optimizer(model, cfg)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: lr_factor(cfg, epoch))
        training = _Training(model, optimizer, scheduler, weight_average(model, cfg.ema), ticket, [], 0, hf_config)
        if state is not None and ctx is not None and bool(state.get("sync_bn", False)) != ctx.sync_bn:
            raise AnytimeError(f"{self.run_dir} was trained {'with' if state.get('sync_bn') else 'without'} --sync-bn; "
                               "resume it the same way (the batch norms would change mid-run)")  # fmt: skip
        if ticket.source is not None:
            self._restore(training, ticket.source, info, resumed=state is not None)
        if ticket.mask is not None:
            ticket.mask.apply(model, optimizer)
        if (ticket.mask is not None or ticket.plan is not None) and state is None:  # the ticket's own average
            training.ema = weight_average(model, cfg.ema)
        if state is not None:
            training.history = list(state["history"])
            if training.ema is not None:
                if "ema" not in state:
                    raise AnytimeError(f"{self.run_dir / CHECKPOINT} holds no weight average, but the recipe asks for "
                                       f"--ema {cfg.ema}; start a new --out")  # fmt: skip
                training.ema.load_state_dict(state["ema"])
            if extend:  # the schedule of the new length, from the epoch the run goes on at
                for group in optimizer.param_groups:
                    group["lr"] = group["initial_lr"] * lr_factor(cfg, training.start_epoch)
        return training

    def _restore(self, training: _Training, source: dict[str, Any], info: DatasetInfo, *, resumed: bool) -> None:
        """Load the weights, schedule and optimizer of the checkpoint (or the dense run's rewound epoch)."""
        if source.get("dataset", {}).get("fingerprint") != info.fingerprint:
            raise AnytimeError(
                f"the {info.name} data at {info.source} changed since "
                f"{self.run_dir if resumed else training.ticket.dense_run} was checkpointed; "
                "a resumed run or a ticket would not match it, so start a new --out"
            )
        training.model.load_state_dict(source["model"])
        training.scheduler.load_state_dict(source["scheduler"])
        training.start_epoch = int(source["epoch"]) + 1
        if source["optimizer"] is not None:
            training.optimizer.load_state_dict(source["optimizer"])
        else:
            for group in training.optimizer.param_groups:
                group["lr"] = group["initial_lr"] * lr_factor(self.config, training.start_epoch)

    def _write_start(self, training: _Training, state: dict[str, Any] | None, splits: DatasetSplits,
                     device: torch.device, extensions: list[dict[str, Any]], augment: Augment) -> None:  # fmt: skip
        """Write what the run folder holds before its first epoch: the record, a ticket's mask or plan, the
        tokenizer."""
        ctx, ticket = self.distributed, training.ticket
        self.run_dir.mkdir(parents=True, exist_ok=True)
        setting = RunSetting(splits.info.to_dict(), device, processes=1 if ctx is None else ctx.world_size,
                             sync_bn=None if ctx is None else ctx.sync_bn, augment=augment,
                             hf_config=training.hf_config, extra=self.extra_config)  # fmt: skip
        write_run_config(self.run_dir, self.config, setting,
                         resumed_from=training.start_epoch if state is not None else None,
                         extensions=extensions)  # fmt: skip
        if ticket.mask is not None and state is None:
            ticket.mask.save(self.run_dir / MASK_FILE)
        if ticket.plan is not None and state is None:
            ticket.plan.save(self.run_dir / CHANNELS_FILE)
        if splits.tokenizer is not None and not (self.run_dir / TOKENIZER_FILE).is_file():
            write_text(self.run_dir / TOKENIZER_FILE, splits.tokenizer)

    def _snapshot(self, training: _Training, epoch: int, info: DatasetInfo,
                  extensions: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
        """The checkpoint of the run at the end of ``epoch``: everything an exact resume needs."""
        ctx, ticket, ema = self.distributed, training.ticket, training.ema
        return {
            "epoch": epoch, "config": self.config.to_dict(), "model": training.model.state_dict(),
            "optimizer": training.optimizer.state_dict(), "scheduler": training.scheduler.state_dict(),
            "history": training.history, "dataset": info.to_dict(), "extensions": extensions,
            **({"hf_config": training.hf_config} if training.hf_config is not None else {}),
            **({"ema": ema.state_dict()} if ema is not None else {}),
            **({"mask": ticket.mask.state(), "dense_run": ticket.dense_run} if ticket.mask is not None else {}),
            **({"channels": ticket.plan.to_dict(), "dense_run": ticket.dense_run,
                "dense_parameters": ticket.dense_parameters} if ticket.plan is not None else {}),
            "sync_bn": ctx is not None and ctx.sync_bn,
        }  # fmt: skip

    def _train_epochs(self, training: _Training, job: EpochJob, info: DatasetInfo,
                      extensions: list[dict[str, Any]]) -> None:  # fmt: skip
        """Train the epochs left, checkpointing and writing the tables after each (process 0 alone)."""
        cfg, main = self.config, self.distributed is None or self.distributed.main
        if main and training.start_epoch == 0 and 0 in cfg.keep_checkpoints:
            save_checkpoint(kept_checkpoint(self.run_dir, 0), self._snapshot(training, -1, info, extensions))
        for epoch in range(training.start_epoch, cfg.epochs):
            record, phases = run_epoch(job, epoch, training.history)
            training.scheduler.step()
            training.history.append({"metrics": record, "phases": phases})
            if not main:
                continue
            if epoch + 1 in cfg.keep_checkpoints:  # a rewind point for lottery tickets, before the epoch counts as done
                save_checkpoint(kept_checkpoint(self.run_dir, epoch + 1),
                                self._snapshot(training, epoch, info, extensions))  # fmt: skip
            save_checkpoint(self.run_dir / CHECKPOINT, self._snapshot(training, epoch, info, extensions))
            write_tables(self.run_dir, training.history)
            if self.on_epoch_end is not None:
                self.on_epoch_end(EpochEnd(epoch=epoch, metrics=record, run_dir=self.run_dir))

    def _finish(self, training: _Training, job: EpochJob, splits: DatasetSplits, test_loader: BatchLoader,
                augment: Augment) -> dict[str, Any]:  # fmt: skip
        """Fit what fits to validation, score the test split, save the final weights; the summary."""
        cfg, ctx, device, ticket = self.config, self.distributed, job.device, training.ticket
        final = training.model if training.ema is None else training.ema.module
        for module in list(final.modules()):
            if callable(getattr(module, "fit_to_validation", None)) and len(splits.val):
                module.fit_to_validation(final, splits.val.images, splits.val.labels)
        reduce = None if ctx is None else ctx.sum
        if hasattr(final, "measure_cost"):  # a step's FLOPs depend on the images (SACT): count them on real ones
            final.measure_cost(images.to(device) for images, _ in job.val_loader)
        test_loss, test_accs = evaluate_exits(final, test_loader, device, reduce=reduce)
        if ctx is None or ctx.main:
            save_weights(final, self.run_dir / "model.safetensors")
        summary = train_summary(self.run_dir, cfg, training.history, final, device, (test_loss, test_accs),
                                splits.info.to_dict())  # fmt: skip
        summary["augment"] = augment.describe()
        summary["processes"] = 1 if ctx is None else ctx.world_size
        if ticket.mask is not None:
            nonzero: int = sum(int(p.count_nonzero()) for p in final.parameters())  # type: ignore[misc]
            summary["ticket"] = {"prune_from": cfg.prune_from, "dense_run": ticket.dense_run,
                                 "sparsity": ticket.mask.sparsity, "reset_epoch": cfg.reset_epoch,
                                 "scope": cfg.prune_scope, "nonzero_parameters": nonzero}  # fmt: skip
        if ticket.plan is not None:
            parameters: int = sum(p.numel() for p in final.parameters())  # type: ignore[misc]
            summary["ticket"] = {"prune_from": cfg.prune_from, "dense_run": ticket.dense_run, "unit": "channels",
                                 "sparsity": ticket.plan.sparsity, "reset_epoch": cfg.reset_epoch,
                                 "scope": cfg.prune_scope, "parameters": parameters,
                                 "dense_parameters": ticket.dense_parameters}  # fmt: skip
        if cfg.tta:
            _, mirrored = evaluate_exits(final, test_loader, device, mirror=True, reduce=reduce)
            summary["final"]["test_acc_tta"] = mirrored[-1]
            for entry, acc in zip(summary.get("exits", []), mirrored):
                entry["test_acc_tta"] = acc
        return summary

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
