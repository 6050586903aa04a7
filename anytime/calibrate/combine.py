"""Exits that answer together: each exit's answer is a weighted geometric ensemble of itself and the exits before it.

Zero Time Waste (Wołczyk et al., NeurIPS 2021) observed that an early exit's answer is thrown away when the
sample goes on, although it is free information about the sample. Here exit ``k`` answers with the combined
log-probabilities ``c_k = sum_{j <= k} W[k][j] * log_softmax(z_j)``, with non-negative weights fit on
validation to minimise each combined exit's negative log-likelihood (a weight also acts as that exit's
temperature). The exit criterion then scores ``c_k``. Every head whose exit has a weight runs, whether or not
samples may leave there, so the cost of leaving at exit ``k`` is the backbone up to ``k`` plus every such head.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from anytime.errors import AnytimeError

if TYPE_CHECKING:
    from torch import Tensor

    from anytime.outputs import OutputCache

Weights = tuple[tuple[float, ...], ...]


def check_weights(weights: Weights, num_steps: int | None = None) -> None:
    """Refuse combination weights that are not one row per exit, row ``k`` holding ``k + 1`` finite
    non-negative numbers with a positive diagonal (an exit counts its own answer), or all zero for an early exit
    outside the combination (nobody leaves there; its head runs only if a later exit weighs it)."""
    if num_steps is not None and len(weights) != num_steps:
        raise AnytimeError(f"the combination weights have {len(weights)} rows for {num_steps} exits; "
                           "calibrate again with --combine-exits")  # fmt: skip
    for k, row in enumerate(weights):
        if len(row) != k + 1:
            raise AnytimeError(f"row {k} of the combination weights has {len(row)} entries; it needs {k + 1} "
                               "(exit k combines exits 0..k)")  # fmt: skip
        if not all(isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 for w in row):
            raise AnytimeError(f"row {k} of the combination weights holds {list(row)}; weights are finite and >= 0")
        if row[k] <= 0 and (k == len(weights) - 1 or any(w > 0 for w in row)):
            raise AnytimeError(f"exit {k}'s own weight is {row[k]}; it must be positive (or its whole row zero)")


def running_exits(weights: Weights) -> tuple[bool, ...]:
    """Per exit, whether its head runs: it or some later exit gives it a weight."""
    return tuple(any(weights[k][j] > 0 for k in range(j, len(weights))) for j in range(len(weights)))


def combine_step(log_probs: Sequence[Tensor] | Mapping[int, Tensor], row: Sequence[float]) -> Tensor:
    """Exit k's combined answer, float32, from the float64 log-probabilities of exits 0..k and its row of
    weights. The one function both the cache and a running model use, so they agree sample for sample."""
    total: Tensor | None = None
    for j, w in enumerate(row):
        if w > 0:
            term = w * log_probs[j]
            total = term if total is None else total + term
    if total is None:  # an exit outside the combination, run for a later one: nobody leaves on this answer
        return log_probs[len(row) - 1].float()
    return total.float()


def log_probs(logits: Tensor) -> Tensor:
    """The float64 log-probabilities :func:`combine_step` combines."""
    import torch

    return torch.log_softmax(logits.double(), dim=-1)


def combine_logits(logits: Tensor, weights: Weights) -> Tensor:
    """Combined log-probabilities ``[K, N, C]`` (float32) of every exit's logits ``[K, N, C]``."""
    import torch

    check_weights(weights, int(logits.shape[0]))
    lp = log_probs(logits)
    return torch.stack([combine_step(lp, row) for row in weights])


def fit_weights(logits: Tensor, labels: Tensor, *, members: Iterable[int] | None = None, steps: int = 200) -> Weights:
    """Non-negative weights per exit minimising the negative log-likelihood of its combined answer on
    ``logits`` ``[K, N, C]`` (validation), by L-BFGS on their logarithms. ``members`` limits which exits may
    contribute (the last one always does): an exit outside it gets no weight and its head need not run."""
    import torch

    num_steps = int(logits.shape[0])
    allowed = set(range(num_steps)) if members is None else set(members) | {num_steps - 1}
    logp = log_probs(logits)
    target = labels.long()
    rows: list[tuple[float, ...]] = []
    for k in range(num_steps):
        if k not in allowed:
            rows.append(tuple([0.0] * (k + 1)))
            continue
        use = [j for j in range(k + 1) if j in allowed]
        # Start from the exit alone (the others at a weight of e^-4), so the fit only adds what helps.
        u = torch.tensor([0.0 if j == k else -4.0 for j in use], dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([u], max_iter=steps, line_search_fn="strong_wolfe")
        stacked = logp[use]

        def closure() -> Tensor:
            opt.zero_grad()
            combined = torch.einsum("j,jnc->nc", _weights_of(u), stacked)
            loss = torch.nn.functional.cross_entropy(combined, target)
            loss.backward()
            return loss

        opt.step(closure)
        fitted = _weights_of(u.detach()).tolist()
        if not all(math.isfinite(w) for w in fitted):  # a failed search: the exit alone, as before combining
            fitted = [1.0 if j == k else 0.0 for j in use]
        row = [0.0] * (k + 1)
        for j, value in zip(use, fitted):
            row[j] = round(float(value), 6)
        row[k] = max(row[k], 1e-6)
        rows.append(tuple(row))
    return tuple(rows)


def _weights_of(u: Tensor) -> Tensor:
    # Bounded (at most e^4 = 55): on an exit whose answers are all right, a growing weight keeps lowering the
    # log-loss and would run off to infinity.
    return u.clamp(-12.0, 4.0).exp()


def combined_costs(step: Tensor, cost: Tensor, running: Sequence[bool]) -> Tensor:
    """Per exit, the cost of leaving there when every running head on the way runs (``step`` and ``cost`` as
    the outputs cache holds them): :func:`~anytime.calibrate.sweeps.exit_costs` with the running heads enabled."""
    import torch

    from anytime.calibrate.sweeps import exit_costs

    return exit_costs(step, cost, torch.tensor([list(running[:-1])]))[0]


def combined_cache(cache: OutputCache, weights: Weights) -> OutputCache:
    """The cache as a combining policy sees it: every exit's combined log-probabilities as its logits, and
    each exit's cost with every running head paid (so the sweeps' own head bookkeeping adds nothing)."""
    import numpy as np
    import torch

    combined = combine_logits(torch.from_numpy(cache.logits), weights)
    costs = combined_costs(torch.from_numpy(cache.step_flops.astype(np.float64)),
                           torch.from_numpy(cache.cost_flops.astype(np.float64)), running_exits(weights))  # fmt: skip
    flops = np.maximum(np.round(costs.numpy()), 1).astype(np.int64)
    return replace(cache, logits=combined.numpy(), step_flops=flops, cost_flops=flops.copy())
