"""Recomputing batch-norm statistics after the network under them changed (a new slice, a cut block)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from anytime.errors import AnytimeError


@torch.no_grad()
def recompute_bn_statistics(
    model: nn.Module, batches: Iterable[Tensor | Sequence[Tensor]], *, norms: Sequence[nn.modules.batchnorm._BatchNorm] | None = None,
    forward: Callable[[Tensor], Tensor] | None = None, max_batches: int = 100,
) -> int:  # fmt: skip
    """Reset the running statistics of ``norms`` (default: every batch norm of ``model``) and recompute them as
    the plain average over ``batches`` (images, or (images, labels) pairs; at most ``max_batches``), running
    ``forward`` (default ``model``) with everything else in eval mode. Returns the number of batches used."""
    targets = (
        list(norms)
        if norms is not None
        else [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    )
    run = forward if forward is not None else model
    was_training = model.training
    momenta = [norm.momentum for norm in targets]
    model.eval()
    for norm in targets:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average
        norm.train()
    device = next(model.parameters()).device
    used = 0
    try:
        for batch in batches:
            if used >= max_batches:
                break
            images = batch if isinstance(batch, Tensor) else batch[0]
            run(images.to(device))
            used += 1
    finally:
        for norm, momentum in zip(targets, momenta):
            norm.momentum = momentum
        model.train(was_training)
    if used == 0:
        raise AnytimeError("no batches were given to recompute the batch-norm statistics")
    return used
