"""Scoring a model during and after training: the loss of its last output and the accuracy of every exit."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.data import BatchLoader


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
