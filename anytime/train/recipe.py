"""A recipe's optimisation: the optimizer and its parameter groups, the learning-rate schedule, the weight average,
and the layers that initialise themselves from the training data."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from anytime.data import DatasetSplits
from anytime.train.config import TrainConfig


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


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD over :func:`parameter_groups`, or AdamW (``momentum`` its first beta) with no weight decay on biases
    and normalisation weights (every 1-D parameter), as transformers are trained."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(parameter_groups(model, config), momentum=config.momentum, nesterov=config.nesterov)
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.dim() > 1], "lr": config.lr, "weight_decay": config.weight_decay},
              {"params": [p for p in trainable if p.dim() <= 1], "lr": config.lr, "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW([g for g in groups if g["params"]], betas=(config.momentum, 0.999))


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
