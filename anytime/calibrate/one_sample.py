"""The batch-1 fast path of real early exit: :func:`one_sample_path` builds, for one policy and one model's
segments and heads, a function that answers one sample with one scalar decision per exit and no bookkeeping of
who is still in (the latency path of :meth:`ExitPolicy.run` and :meth:`ExitPolicy.runner`), and
:data:`ROW_CLASSES` bounds the classes up to which a sample is scored in Python floats.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from anytime.calibrate.policy_answers import EarlyExitOutput
from anytime.errors import AnytimeError

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from anytime.calibrate.policy import ExitPolicy
    from anytime.calibrate.policy_answers import ExitAnswers


ROW_CLASSES = 128  # up to this many classes, one sample is scored in Python floats (Criterion.score_row)


def one_sample_path(
    segments: Sequence[torch.nn.Module], heads: Sequence[torch.nn.Module], policy: ExitPolicy, device: torch.device,
) -> Callable[[Tensor, ExitAnswers | None], EarlyExitOutput]:  # fmt: skip
    """Real early exit of one sample on ``device`` under ``policy``: a function of the sample ``x`` (``[1, ...]``)
    and, where the policy combines exits, its :class:`ExitAnswers`. No bookkeeping of who is still in, one scalar
    decision per exit (the latency path), and what it reads bound here, once.

    On a CPU an exit's logits are read once as Python floats, which give the score and, where the sample leaves,
    its class: a NaN or +inf in the row makes the score NaN (Criterion.score_row), so a row that leaves has a finite
    maximum, and its first maximum is argmax's answer. Between a small network's stages a PyTorch operator costs
    10-15 us; LeNet's answers at batch 1 took 8-13 us less than with argmax, torch.tensor and .float() on the way
    out."""
    import torch

    segments = tuple(segments)
    heads = (*heads, *(None,) * (len(segments) - len(heads)))  # a ModuleList's [k] costs 1 us
    last = len(segments) - 1
    runs, limits, temps = policy._heads, policy._limits, policy._temps
    score_row, low, leaves = policy._crit.score_row, policy._crit.low_is_confident, policy.leaves
    rows = device.type == "cpu"
    full, long, float32, never = torch.full, torch.long, torch.float32, -math.inf

    def answer(x: Tensor, answers: ExitAnswers | None) -> EarlyExitOutput:
        h = x
        for k, segment in enumerate(segments):
            h = segment(h)
            if k == last:
                logits = h if answers is None else answers.answer(k, h)
                return EarlyExitOutput(logits.argmax(dim=1), full((1,), k, dtype=long, device=device),
                                       logits if logits.dtype == float32 else logits.float())  # fmt: skip
            if not runs[k]:
                continue
            raw = heads[k](h)
            logits = raw if answers is None else answers.answer(k, raw)
            if limits[k] == never:
                continue
            if rows and logits.shape[-1] <= ROW_CLASSES:
                row = logits.tolist()[0]
                score = score_row(row, temps[k])
                if not (score if low else -score) <= limits[k]:  # a NaN score stays
                    continue
                predicted = full((1,), row.index(max(row)), dtype=long, device=device)
            elif leaves(k, logits):
                predicted = logits.argmax(dim=1)
            else:
                continue
            return EarlyExitOutput(predicted, full((1,), k, dtype=long, device=device),
                                   logits if logits.dtype == float32 else logits.float())  # fmt: skip
        raise AnytimeError("a multi-exit model needs at least one segment")

    return answer
