"""One epoch of training: every batch's forward, loss, backward and step, timed by phase, then the scoring of the
validation split, as the row the epoch adds to ``metrics.csv``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.data import BatchLoader
from anytime.errors import AnytimeError
from anytime.train.config import TrainConfig
from anytime.train.distributed import Distributed
from anytime.train.evaluation import evaluate_exits
from anytime.train.memory import cuda_peak_bytes, peak_rss_bytes
from anytime.train.multi_exit import exit_weights, multi_exit_loss
from anytime.train.pruning import Mask
from anytime.train.recipe import lr_factor, per_iteration_lr
from anytime.train.timing import PHASES, Clock, PhaseLog
from anytime.utils.progress import progress_bar
from anytime.utils.seed import derive_seed


class TrainingForward(nn.Module):
    """The training pass as one module call, so that DistributedDataParallel sees every forward: all steps of the
    model, or only the ``chosen`` ones (the sandwich rule of sliced networks), stacked."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor, chosen: list[int] | None = None) -> Tensor:
        if chosen is None:
            return self.model(images)
        return torch.stack([self.model.forward_until(images, k) for k in chosen])  # type: ignore[operator]


@dataclass(frozen=True)
class EpochJob:
    """What every epoch of one training trains with: ``forward`` is the model's :class:`TrainingForward`, wrapped
    for data parallelism when ``distributed`` is given; ``ema`` is the weight average, if the recipe keeps one."""

    config: TrainConfig
    model: nn.Module
    forward: nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: BatchLoader
    val_loader: BatchLoader
    device: torch.device
    clock: Clock
    ema: nn.Module | None = None
    mask: Mask | None = None
    distributed: Distributed | None = None
    progress: bool = False


@dataclass
class _Sums:
    """The training split's running figures over one epoch (the last exit's loss, the objective, hits, samples)."""

    loss: Tensor
    objective: Tensor
    correct: Tensor
    seen: int = 0
    log: PhaseLog = field(default_factory=PhaseLog)


def all_finite(loss: Tensor, distributed: Distributed | None) -> bool:
    """Whether the loss is finite in every process (all of them stop together, or none does)."""
    finite = torch.tensor(float(math.isfinite(float(loss.detach()))), device=loss.device)
    if distributed is not None:
        distributed.sum(finite)
    return bool(finite >= (1 if distributed is None else distributed.world_size))


def _batch_loss(cfg: TrainConfig, model: nn.Module, logits: Tensor, labels: Tensor, weights: Tensor,
                sums: _Sums) -> Tensor:  # fmt: skip
    """What one batch minimises; its last exit's loss, the objective and the hits are added to ``sums``."""
    logits = logits.float()
    multi_exit = logits.dim() == 3
    if multi_exit:
        loss = multi_exit_loss(
            logits,
            labels,
            weights,
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
        sums.objective += loss.detach().double() * labels.numel()
        last_loss = F.cross_entropy(logits, labels) if multi_exit else loss
        sums.loss += last_loss.detach().double() * labels.numel()
        sums.correct += (logits.argmax(dim=1) == labels).sum()
    return loss


def _chosen_steps(model: nn.Module, cfg: TrainConfig, epoch: int, iteration: int, steps: int) -> list[int] | None:
    """The steps this batch trains (the sandwich rule), or None for all of them."""
    if not hasattr(model, "training_steps"):
        return None
    with torch.random.fork_rng(devices=[]):  # every process must choose alike: a stream of its own per batch
        torch.manual_seed(derive_seed("steps", cfg.seed, epoch, iteration))
        chosen = model.training_steps()
    return None if chosen is None or len(chosen) >= steps else chosen


def _train_pass(job: EpochJob, epoch: int) -> _Sums:
    """Train on every batch of the training split once."""
    cfg, ctx, model, device, clock, loader = (
        job.config,
        job.distributed,
        job.model,
        job.device,
        job.clock,
        job.train_loader,
    )
    weights = exit_weights(cfg, model).to(device)
    zero = torch.zeros((), device=device, dtype=torch.float64)
    sums = _Sums(loss=zero.clone(), objective=zero.clone(), correct=torch.zeros((), device=device, dtype=torch.int64))
    batches = len(loader)
    bar = progress_bar(batches, f"epoch {epoch + 1}/{cfg.epochs}", enabled=job.progress and (ctx is None or ctx.main),
                       unit="batch")  # fmt: skip
    stepwise = per_iteration_lr(cfg)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    tick = clock.now()
    for iteration, (images, labels) in enumerate(loader):
        images = images.to(device, non_blocking=True, memory_format=memory_format)
        labels = labels.to(device, non_blocking=True)
        t_data = clock.now()
        chosen = _chosen_steps(model, cfg, epoch, iteration, len(weights))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
            logits = job.forward(images, chosen)
        loss = _batch_loss(cfg, model, logits, labels, weights if chosen is None else weights[chosen], sums)
        if ctx is not None:  # processes' gradients are averaged: weigh each by its share of the global batch
            loss = loss * (labels.numel() * ctx.world_size / loader.batch_total(iteration))
        t_forward = clock.now()
        job.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if job.mask is not None:
            job.mask.mask_gradients(model)
        t_backward = clock.now()
        if stepwise:
            factor = lr_factor(cfg, epoch, (iteration + 1) / batches)
            for group in job.optimizer.param_groups:
                group["lr"] = group["initial_lr"] * factor
        job.optimizer.step()
        if job.mask is not None:  # float rounding in the step must not revive a pruned weight
            job.mask.apply(model)
        if job.ema is not None:
            job.ema.update_parameters(model)  # type: ignore[operator]
        t_step = clock.now()
        batch = labels.numel() if ctx is None else loader.batch_total(iteration)  # all processes' images
        sums.log.add(t_data - tick, t_forward - t_data, t_backward - t_forward, t_step - t_backward, batch)
        sums.seen += labels.numel()
        tick = t_step
        bar.update(1)
        if iteration % 50 == 0 and not all_finite(loss, ctx):
            bar.close()
            raise AnytimeError(
                f"training diverged in epoch {epoch + 1}, iteration {iteration + 1} (loss is {float(loss):.4g}); "
                f"lower --lr (now {cfg.lr}) and start again"
            )
    bar.close()
    return sums


def run_epoch(
    job: EpochJob, epoch: int, history: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Train epoch ``epoch`` (0-based) and score the validation split: the epoch's row of ``metrics.csv`` and the
    phases of its iterations."""
    cfg, ctx, device, clock = job.config, job.distributed, job.device, job.clock
    # per-sample randomness (dropout, stochastic depth) is drawn on each process's own rows: own streams
    torch.manual_seed(derive_seed(cfg.seed, epoch) if ctx is None else derive_seed(cfg.seed, epoch, "rank", ctx.rank))
    job.train_loader.set_epoch(epoch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    job.model.train()
    epoch_start = clock.now()
    sums = _train_pass(job, epoch)
    loss_sum, objective_sum, correct, seen = sums.loss, sums.objective, sums.correct, sums.seen
    if ctx is not None:
        totals = ctx.sum(torch.stack([loss_sum, objective_sum, correct.double(), loss_sum.new_tensor(seen)]))
        loss_sum, objective_sum, correct, seen = totals[0], totals[1], totals[2].long(), int(totals[3])
        ctx.share_buffers(job.model, job.ema)
    train_s = clock.now() - epoch_start
    val_loss, val_accs = evaluate_exits(job.model if job.ema is None else job.ema.module, job.val_loader, device,
                                        reduce=None if ctx is None else ctx.sum)  # fmt: skip
    epoch_s = clock.now() - epoch_start
    train_loss = float(loss_sum) / max(seen, 1)
    if not math.isfinite(train_loss):
        raise AnytimeError(
            f"training diverged in epoch {epoch + 1} (mean loss is {train_loss}); lower --lr (now {cfg.lr})"
        )
    phase_totals = sums.log.totals()
    previous = history[-1]["metrics"]["elapsed_s"] if history else 0.0
    cuda_peak = cuda_peak_bytes(device)
    record: dict[str, Any] = {
        "epoch": epoch, "lr": cfg.lr * lr_factor(cfg, epoch), "train_loss": train_loss,
        "train_acc": int(correct) / max(seen, 1), "val_loss": val_loss, "val_acc": val_accs[-1],
        "epoch_s": epoch_s, "train_s": train_s, "eval_s": epoch_s - train_s, "elapsed_s": previous + epoch_s,
        **{f"{phase}_s": phase_totals[phase] for phase in PHASES},
        "images_per_s": seen / train_s if train_s > 0 else float("nan"),
        "peak_rss_mb": peak_rss_bytes() / 2**20,
        "cuda_peak_mb": None if cuda_peak is None else cuda_peak / 2**20,
    }  # fmt: skip
    if len(val_accs) > 1:
        record["train_objective"] = float(objective_sum) / max(seen, 1)
        record.update({f"val_acc_exit{k}": acc for k, acc in enumerate(val_accs)})
    log = sums.log
    phases = {"data": log.data, "forward": log.forward, "backward": log.backward, "step": log.step,
              "batch": [float(b) for b in log.batch]}  # fmt: skip
    return record, phases
