"""Fusers: how an ensemble turns its members' answers into one.

Every fuser maps the members' log-probabilities ``[k, B, C]`` (the first k members, cost order) to fused logits
``[B, C]``. ``mean`` averages probabilities, ``vote`` counts each member's top class (ties go to the class with the
higher mean probability), ``weighted`` averages probabilities with weights fit on held-out data, and ``mlp`` is a
learned log-linear pool (each member's log-probabilities times a positive weight, which weights the member and
re-calibrates its confidence at once) plus a small network on the concatenated log-probabilities whose output
corrects the pool (its last layer starts at zero, so before fitting it is the geometric mean of the members).

Fitting is cross-fitted: :func:`cross_fit` splits the held-out samples into folds, fits one fuser per fold on the
others and answers each sample with the fuser that did not see it (so thresholds calibrated on those answers are
not calibrated on the fuser's own training data), then fits the deployed fuser on every sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.errors import AnytimeError

FUSERS: tuple[str, ...] = ("mlp", "mean", "vote", "weighted")
LOG_FLOOR = -20.0  # log-probabilities below this carry no information a fuser can use, only overflow risk
_VOTE_TIE_BREAK = 0.5  # mean probability (< 1) added to the votes: it separates ties, never outvotes a vote


def log_probs(logits: Tensor) -> Tensor:
    """Members' logits as log-probabilities, floored at ``LOG_FLOOR`` (so an int8 member's saturated logit
    cannot dominate a fuser's input)."""
    return F.log_softmax(logits.float(), dim=-1).clamp_min(LOG_FLOOR)


def _mean(logps: Tensor) -> Tensor:
    return torch.logsumexp(logps, dim=0) - np.log(logps.shape[0])


class Fuser(nn.Module):
    """Fused logits ``[B, C]`` from the first k members' log-probabilities ``[k, B, C]``."""

    kind = ""
    reads_logits = False  # True: the fuser reads the members' raw logits instead of their log-probabilities

    def __init__(self, members: int, num_classes: int) -> None:
        super().__init__()
        self.members = members
        self.num_classes = num_classes

    def check(self, logps: Tensor) -> None:
        """Refuse inputs of another number of members or classes than the fuser was made for."""
        if logps.ndim != 3 or logps.shape[0] != self.members or logps.shape[2] != self.num_classes:
            raise AnytimeError(f"a {self.kind} fuser of {self.members} members and {self.num_classes} classes got "
                               f"log-probabilities of shape {list(logps.shape)}")  # fmt: skip

    def flops(self) -> int:
        """Multiply-adds x 2 of one sample (the elementwise work of averaging counted as one FLOP each)."""
        return 2 * self.members * self.num_classes


class MeanFuser(Fuser):
    """The log of the members' mean probability."""

    kind = "mean"

    def forward(self, logps: Tensor) -> Tensor:
        return _mean(logps)


class VoteFuser(Fuser):
    """Majority vote of the members' top classes; ties go to the tied class of higher mean probability. The
    logits are the log of the vote shares (smoothed by the tie-break), so entropy still measures agreement."""

    kind = "vote"

    def forward(self, logps: Tensor) -> Tensor:
        votes = F.one_hot(logps.argmax(dim=-1), self.num_classes).sum(dim=0).float()
        shares = votes + _VOTE_TIE_BREAK * _mean(logps).exp()
        return torch.log(shares / shares.sum(dim=-1, keepdim=True))


class WeightedFuser(Fuser):
    """The log of a weighted mean of the members' probabilities; the weights (a softmax of ``logit_weights``,
    so positive and summing to one) are fit to the held-out labels."""

    kind = "weighted"

    def __init__(self, members: int, num_classes: int) -> None:
        super().__init__(members, num_classes)
        self.logit_weights = nn.Parameter(torch.zeros(members))

    @property
    def weights(self) -> Tensor:
        """The members' weights, positive and summing to one."""
        return self.logit_weights.softmax(dim=0)

    def forward(self, logps: Tensor) -> Tensor:
        return torch.logsumexp(logps + self.weights.log()[:, None, None], dim=0)


_MAX_LOG_WEIGHT = 10.0


class MLPFuser(Fuser):
    """A log-linear pool of the members plus a correction computed by a two-layer MLP from every member's
    log-probabilities.

    The pool is ``sum_i w_i * log p_i`` with ``w_i > 0``: a member trained with label smoothing answers with soft
    probabilities and is drowned by confident members in a mean of probabilities, while its weight here also acts
    as an inverse temperature that restores its say. Unfitted, every ``w_i`` is ``1/k`` (the geometric mean).
    """

    kind = "mlp"

    def __init__(self, members: int, num_classes: int, hidden: int = 32) -> None:
        super().__init__(members, num_classes)
        self.hidden = hidden
        self.log_weights = nn.Parameter(torch.full((members,), -float(np.log(members))))
        self.net = nn.Sequential(nn.Linear(members * num_classes, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        nn.init.zeros_(self.net[2].weight)
        nn.init.zeros_(self.net[2].bias)

    @property
    def weights(self) -> Tensor:
        """The members' exponents in the pool, positive (they need not sum to one), at most e^10."""
        # Bounded so that every point the solver's line search tries has a finite loss: on members near chance
        # (three LeNets trained briefly on the digits) it tried an exponent of e^1212, whose loss was NaN, and
        # then stepped on to infinity.
        return self.log_weights.clamp(max=_MAX_LOG_WEIGHT).exp()

    def pool(self, logps: Tensor) -> Tensor:
        """The log-linear pool alone, ``[B, C]`` (unnormalised log-probabilities)."""
        return (logps * self.weights[:, None, None]).sum(dim=0)

    def forward(self, logps: Tensor) -> Tensor:
        features = logps.permute(1, 0, 2).reshape(logps.shape[1], -1)
        return self.pool(logps) + self.net(features)

    def flops(self) -> int:
        inputs = self.members * self.num_classes
        return super().flops() + 2 * (inputs * self.hidden + self.hidden * self.num_classes)


class LogitFuser(Fuser):
    """torchensemble's own fusion of raw logits (not log-probabilities): their mean (Fusion) or, with a
    ``scale``, their scaled sum (gradient boosting's shrinkage). Used by the ``ensemble-baseline`` runs."""

    kind = "logits"
    reads_logits = True

    def __init__(self, members: int, num_classes: int, scale: float = 0.0) -> None:
        super().__init__(members, num_classes)
        self.register_buffer("scale", torch.tensor(float(scale)))  # 0: the mean

    def forward(self, logps: Tensor) -> Tensor:
        total = logps.sum(dim=0)
        return total * self.scale if float(self.scale) else total / logps.shape[0]


def make_fuser(kind: str, members: int, num_classes: int, *, hidden: int = 32, scale: float = 0.0) -> Fuser:
    """A fresh (unfitted) fuser of ``kind`` for ``members`` members (``logits``: see :class:`LogitFuser`)."""
    if kind == "mlp":
        return MLPFuser(members, num_classes, hidden)
    if kind == "logits":
        return LogitFuser(members, num_classes, scale)
    classes = {"mean": MeanFuser, "vote": VoteFuser, "weighted": WeightedFuser}
    if kind not in classes:
        raise AnytimeError(f"unknown fuser '{kind}'; choose one of {', '.join(FUSERS)}")
    return classes[kind](members, num_classes)


def is_fitted_kind(kind: str) -> bool:
    """Whether fusers of ``kind`` learn parameters from held-out data (and so are cross-fitted)."""
    return kind in ("mlp", "weighted")


@dataclass(frozen=True)
class FitSettings:
    """How learned fusers are fit on the held-out samples. Weights of pools and weighted means are solved by
    L-BFGS to convergence; the MLP's correction is then fit on top of its solved pool by full-batch Adam (these
    settings)."""

    hidden: int = 32
    epochs: int = 200
    lr: float = 0.01
    # smaller decay let the correction over-fit 4,000 CIFAR-10 validation images (test -0.4 points against the pool)
    weight_decay: float = 0.1
    seed: int = 0


def fit_fuser(fuser: Fuser, logps: Tensor, labels: Tensor, settings: FitSettings = FitSettings()) -> Fuser:
    """Fit ``fuser`` (in place) to ``labels`` from the members' log-probabilities ``[k, N, C]``; a fuser with no
    parameters is returned as it is."""
    fuser.check(logps)
    params = [p for p in fuser.parameters() if p.requires_grad]
    if not params:
        return fuser.eval()
    torch.manual_seed(settings.seed)
    fuser.train()
    with torch.enable_grad():
        if isinstance(fuser, MLPFuser):
            # the correction starts at zero, so the pool is solved first as if alone, then held while the MLP learns
            _solve(fuser, [fuser.log_weights], logps, labels)
            fuser.log_weights.requires_grad_(False)
            optimiser = torch.optim.Adam(fuser.net.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
            for _ in range(settings.epochs):
                optimiser.zero_grad(set_to_none=True)
                F.cross_entropy(fuser(logps), labels).backward()
                optimiser.step()
            fuser.log_weights.requires_grad_(True)
        else:
            _solve(fuser, params, logps, labels)
    return fuser.eval()


def _solve(fuser: Fuser, params: list[nn.Parameter], logps: Tensor, labels: Tensor) -> None:
    """A handful of weights: a quasi-Newton solve of the held-out cross-entropy to convergence."""
    solver = torch.optim.LBFGS(params, lr=1.0, max_iter=200, line_search_fn="strong_wolfe")

    def loss() -> Tensor:
        solver.zero_grad(set_to_none=True)
        value = F.cross_entropy(fuser(logps), labels)
        value.backward()
        return value

    solver.step(loss)


def fold_assignment(count: int, folds: int, seed: int) -> np.ndarray:
    """Each of ``count`` samples' fold, ``0..folds-1``, balanced and shuffled by ``seed``."""
    if folds < 2 or folds > count:
        raise AnytimeError(f"cross-fitting needs 2 to {count} folds (got {folds}); pass e.g. --folds 5")
    order = np.random.default_rng(seed).permutation(count)
    assignment = np.empty(count, dtype=np.int64)
    assignment[order] = np.arange(count) % folds
    return assignment


@dataclass(frozen=True)
class CrossFit:
    """The fusers of every prefix of members, fit on held-out data.

    ``fusers[k]`` fuses members 0..k and was fit on every held-out sample (the deployed one);
    ``fold_fusers[f][k]`` was fit without fold ``f``; ``heldout`` ``[K, N, C]`` answers each sample with the
    fusers that did not see it, ``folds`` ``[N]`` says which fold each sample is in.
    """

    kind: str
    fusers: tuple[Fuser, ...]
    fold_fusers: tuple[tuple[Fuser, ...], ...]
    heldout: np.ndarray
    folds: np.ndarray


@torch.no_grad()
def cross_fit(kind: str, logps: Tensor, labels: Tensor, *, folds: int = 5,
              settings: FitSettings = FitSettings()) -> CrossFit:  # fmt: skip
    """Fit a ``kind`` fuser for every prefix of the ``K`` members whose log-probabilities ``[K, N, C]`` are given,
    cross-fitted over ``folds`` folds of the ``N`` held-out samples (see :class:`CrossFit`)."""
    num_members, count, classes = logps.shape
    assignment = fold_assignment(count, folds, settings.seed)
    fusers = tuple(fit_fuser(make_fuser(kind, k + 1, classes, hidden=settings.hidden), logps[: k + 1], labels, settings)
                   for k in range(num_members))  # fmt: skip
    if not is_fitted_kind(kind):
        heldout = torch.stack([f(logps[: k + 1]) for k, f in enumerate(fusers)])
        return CrossFit(kind, fusers, (), heldout.numpy(), assignment)
    heldout = torch.empty(num_members, count, classes)
    fold_fusers = []
    for fold in range(folds):
        inside = torch.from_numpy(assignment != fold)
        fitted = []
        for k in range(num_members):
            fuser = fit_fuser(make_fuser(kind, k + 1, classes, hidden=settings.hidden), logps[: k + 1, inside],
                              labels[inside], settings)  # fmt: skip
            heldout[k, ~inside] = fuser(logps[: k + 1, ~inside])
            fitted.append(fuser)
        fold_fusers.append(tuple(fitted))
    return CrossFit(kind, fusers, tuple(fold_fusers), heldout.numpy(), assignment)
