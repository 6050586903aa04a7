"""An early-exit policy (a criterion, a threshold per exit, optional temperatures) and real early exit.

The same policy is applied to the outputs cache (offline) and to a running model (online). Online, a
batch is run stage by stage and the samples that are confident leave: the next stage computes only the
samples still in, so no work is spent on a sample that has already left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anytime.calibrate.criteria import get_criterion
from anytime.errors import AnytimeError

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import Tensor

    from anytime.outputs import OutputCache


@dataclass(frozen=True)
class PolicyResult:
    """How a policy does on a split: accuracy, mean FLOPs per sample and where samples leave."""

    accuracy: float
    mean_flops: float
    flops_ratio: float
    exit_share: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, with the speed-up in FLOPs (base / mean)."""
        return {"accuracy": self.accuracy, "mean_flops": self.mean_flops, "flops_ratio": self.flops_ratio,
                "flops_speedup": 1.0 / self.flops_ratio if self.flops_ratio > 0 else None,
                "exit_share": list(self.exit_share)}  # fmt: skip


@dataclass(frozen=True)
class EarlyExitOutput:
    """Real early exit on a batch: each sample's predicted class, the exit it left at, and its logits."""

    predictions: Tensor
    exits: Tensor
    logits: Tensor


@dataclass(frozen=True)
class ExitPolicy:
    """Leave at the first exit whose criterion passes its threshold; the last exit answers the rest.

    ``thresholds`` holds one value per early exit in the criterion's units; ``None`` means nobody leaves at
    that exit. ``temperatures`` (one per exit, optional) divide the logits before scoring; they never change
    an exit's predicted class.
    """

    criterion: str
    thresholds: tuple[float | None, ...]
    temperatures: tuple[float, ...] | None = None
    _limits: list[float] = field(init=False, repr=False, compare=False)
    _temps: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        crit = get_criterion(self.criterion)
        for k, t in enumerate(self.thresholds):
            if t is not None and (not isinstance(t, (int, float)) or not math.isfinite(t)):
                raise AnytimeError(f"threshold of exit {k} is {t}; thresholds must be finite numbers (or null)")
        if self.temperatures is not None:
            if len(self.temperatures) != len(self.thresholds) + 1:
                raise AnytimeError(f"{len(self.temperatures)} temperatures for {len(self.thresholds) + 1} exits")
            if not all(math.isfinite(t) and t > 0 for t in self.temperatures):
                raise AnytimeError(f"temperatures must be positive numbers (got {list(self.temperatures)})")
        signed = [-math.inf if t is None else (t if crit.low_is_confident else -t) for t in self.thresholds]
        # Plain floats, computed once: the batch-1 path compares against them with no tensor work.
        object.__setattr__(self, "_limits", signed)
        object.__setattr__(self, "_temps", tuple(self.temperatures or (1.0,) * (len(self.thresholds) + 1)))

    @property
    def num_steps(self) -> int:
        """The number of exits this policy is for."""
        return len(self.thresholds) + 1

    def check(self, num_steps: int, num_classes: int) -> None:
        """Refuse a policy for another number of exits, or a threshold outside the criterion's range."""
        if num_steps != self.num_steps:
            raise AnytimeError(
                f"this policy has thresholds for {self.num_steps} exits but the model has {num_steps}; "
                "calibrate it on this model's outputs"
            )
        get_criterion(self.criterion).check_thresholds(self.thresholds, num_classes, num_steps)

    def signed_thresholds(self) -> Tensor:
        """Thresholds turned so that a sample leaves when its signed score is at most them; -inf: never."""
        import torch

        return torch.tensor(self._limits, dtype=torch.float64)

    def _per_exit(self) -> None:
        if get_criterion(self.criterion).stateful:
            raise AnytimeError(f"the {self.criterion} criterion compares an exit with the earlier ones, which this "
                               "path does not keep; use a per-exit criterion (entropy, confidence, ...) here, or "
                               "`anytime evaluate` for real early exit with patience")  # fmt: skip

    def confident(self, k: int, logits: Tensor) -> Tensor | None:
        """Which samples may leave at early exit ``k`` given its logits (``None`` if nobody leaves there)."""
        self._per_exit()
        limit = self._limits[k]
        if limit == -math.inf:
            return None
        crit = get_criterion(self.criterion)
        return crit.signed(crit.score(logits, self._temps[k])) <= limit

    def leaves(self, k: int, logits: Tensor) -> bool:
        """Whether the one sample of ``logits`` (``[1, C]``) leaves at early exit ``k``: a scalar decision, no
        per-sample bookkeeping (the batch-1 latency path)."""
        self._per_exit()
        limit = self._limits[k]
        if limit == -math.inf:
            return False
        crit = get_criterion(self.criterion)
        score = float(crit.score(logits, self._temps[k]))
        return (score if crit.low_is_confident else -score) <= limit

    def evaluate(self, cache: OutputCache) -> PolicyResult:
        """Accuracy, cost and exit shares of this policy on a cache (offline)."""
        from anytime.calibrate.sweeps import evaluate_settings, scores_of

        self.check(cache.num_steps, cache.num_classes)
        scores = scores_of(cache, self.criterion, None if self.temperatures is None else list(self.temperatures))
        acc, cost, share = evaluate_settings(scores, self.signed_thresholds().view(1, -1), floor_disables=False)
        return PolicyResult(
            accuracy=float(acc[0]), mean_flops=float(cost[0]), flops_ratio=float(cost[0]) / cache.base_flops,
            exit_share=tuple(float(s) for s in share[0]),
        )  # fmt: skip

    def assign(self, cache: OutputCache) -> np.ndarray:
        """The exit every cached sample leaves at."""
        from anytime.calibrate.sweeps import assign_exits, scores_of

        self.check(cache.num_steps, cache.num_classes)
        scores = scores_of(cache, self.criterion, None if self.temperatures is None else list(self.temperatures))
        return assign_exits(scores.signed, self.signed_thresholds().view(1, -1))[0].numpy()

    def run(self, model: torch.nn.Module, x: Tensor) -> EarlyExitOutput:
        """Real early exit of a multi-exit model on the batch ``x`` (in inference mode: the outputs carry
        no autograd history and cannot enter one). The logits come back in float32 whatever precision each
        step computes in: a converted model's heads answer in float32, its last segment in its own precision."""
        import torch

        with torch.inference_mode():
            return self._run(model, x)

    def _run(self, model: torch.nn.Module, x: Tensor) -> EarlyExitOutput:
        import torch

        # An attribute look-up, not isinstance against the runtime-checkable protocol: that check costs about
        # 13 us, a few percent of a small network's whole answer at batch 1.
        segments = getattr(model, "segments", None)
        heads = getattr(model, "heads", None)
        if not isinstance(segments, (tuple, list)) or not isinstance(heads, (tuple, list, torch.nn.ModuleList)):
            segments = ()
        if len(segments) != self.num_steps:
            raise AnytimeError(
                f"this policy is for {self.num_steps} exits; the model has {len(segments) or 'no'} exits"
            )
        if model.training:
            raise AnytimeError(
                "early exit needs the model in eval mode (call model.eval()): in training mode batch norm would "
                "depend on which samples are still in"
            )
        crit = get_criterion(self.criterion)
        if crit.stateful:
            return self._run_patience(segments, heads, x)
        if x.shape[0] == 1:
            return self._run_one(segments, heads, x)
        limits, temps = self._limits, self._temps
        batch = x.shape[0]
        last = self.num_steps - 1
        predictions = torch.empty(batch, dtype=torch.long, device=x.device)
        exits = torch.full((batch,), last, dtype=torch.long, device=x.device)
        out_logits: Tensor | None = None
        index = torch.arange(batch, device=x.device)
        h = x
        for k, segment in enumerate(segments):
            h = segment(h)
            if k < last and limits[k] == -math.inf:
                continue
            logits = h if k == last else heads[k](h)
            if out_logits is None:
                out_logits = torch.empty(batch, logits.shape[1], dtype=torch.float32, device=x.device)
            leave = None if k == last else crit.signed(crit.score(logits, temps[k])) <= limits[k]
            if leave is None or bool(leave.all()):
                predictions[index] = logits.argmax(dim=1)
                exits[index] = k
                out_logits[index] = logits.float()
                break
            if bool(leave.any()):
                gone = index[leave]
                predictions[gone] = logits[leave].argmax(dim=1)
                exits[gone] = k
                out_logits[gone] = logits[leave].float()
                stay = ~leave
                index, h = index[stay], h[stay]
        assert out_logits is not None
        return EarlyExitOutput(predictions=predictions, exits=exits, logits=out_logits)

    def _run_patience(self, segments: Sequence[torch.nn.Module], heads: list[torch.nn.Module], x: Tensor) -> EarlyExitOutput:
        # Patience: every early exit's head runs (its answer extends or breaks the streak), and a sample leaves
        # at an enabled exit once its streak reaches that exit's threshold.
        import torch

        batch, last = x.shape[0], self.num_steps - 1
        predictions = torch.empty(batch, dtype=torch.long, device=x.device)
        exits = torch.full((batch,), last, dtype=torch.long, device=x.device)
        out_logits: Tensor | None = None
        index = torch.arange(batch, device=x.device)
        streak = torch.zeros(batch, dtype=torch.float64, device=x.device)
        previous: Tensor | None = None
        h = x
        for k, segment in enumerate(segments):
            h = segment(h)
            logits = h if k == last else heads[k](h)
            if out_logits is None:
                out_logits = torch.empty(batch, logits.shape[1], dtype=torch.float32, device=x.device)
            predicted = logits.argmax(dim=1)
            if previous is not None:
                streak = torch.where(predicted == previous, streak + 1, 0.0)
            leave = torch.ones_like(predicted, dtype=torch.bool) if k == last else -streak <= self._limits[k]
            if bool(leave.any()):
                gone = index[leave]
                predictions[gone], exits[gone], out_logits[gone] = predicted[leave], k, logits[leave].float()
                stay = ~leave
                if not bool(stay.any()):
                    break
                index, h, streak, predicted = index[stay], h[stay], streak[stay], predicted[stay]
            previous = predicted
        assert out_logits is not None
        return EarlyExitOutput(predictions=predictions, exits=exits, logits=out_logits)

    def _run_one(self, segments: Sequence[torch.nn.Module], heads: list[torch.nn.Module], x: Tensor) -> EarlyExitOutput:
        # One sample: no bookkeeping of who is still in, one scalar decision per exit (the latency path).
        import torch

        last = len(segments) - 1
        h = x
        for k, segment in enumerate(segments):
            h = segment(h)
            if k == last:
                logits = h
                break
            if self._limits[k] == -math.inf:
                continue
            logits = heads[k](h)
            if self.leaves(k, logits):
                break
        return EarlyExitOutput(logits.argmax(dim=1), torch.tensor([k], device=x.device), logits.float())

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {"criterion": self.criterion, "thresholds": list(self.thresholds),
                "temperatures": None if self.temperatures is None else list(self.temperatures)}  # fmt: skip

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, where: str = "policy") -> ExitPolicy:
        """Rebuild from :meth:`to_dict`'s output; a clear error for anything malformed."""
        try:
            thresholds = tuple(None if t is None else float(t) for t in values["thresholds"])
            temps = values.get("temperatures")
            return cls(
                criterion=str(values["criterion"]), thresholds=thresholds,
                temperatures=None if temps is None else tuple(float(t) for t in temps),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            raise AnytimeError(f"{where}: not a valid exit policy (needs criterion and thresholds)") from None
