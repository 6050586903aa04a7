"""An early-exit policy (a criterion, a threshold per exit, optional temperatures) and real early exit.

The same policy is applied to the outputs cache (offline) and to a running model (online). Online, a
batch is run stage by stage and the samples that are confident leave: the next stage computes only the
samples still in, so no work is spent on a sample that has already left.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from anytime.calibrate.combine import Weights, check_weights, combined_cache, combined_costs, running_exits
from anytime.calibrate.criteria import Criterion, get_criterion
from anytime.calibrate.gates import ExitGates
from anytime.calibrate.one_sample import ROW_CLASSES, one_sample_path
from anytime.calibrate.policy_answers import EarlyExitOutput, ExitAnswers, ExitDecisions, PolicyResult
from anytime.errors import AnytimeError

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import Tensor

    from anytime.calibrate.sweeps import Scores
    from anytime.outputs import OutputCache


@dataclass(frozen=True)
class ExitPolicy:
    """Leave at the first exit whose criterion passes its threshold; the last exit answers the rest.

    ``thresholds`` holds one value per early exit in the criterion's units; ``None`` means nobody leaves at
    that exit. ``temperatures`` (one per exit, optional) divide the logits before scoring; they never change
    an exit's predicted class. ``combine`` (optional, row k holding k + 1 weights) makes every exit answer
    with the weighted geometric ensemble of itself and the earlier exits (:mod:`anytime.calibrate.combine`);
    the heads it weighs run even where nobody leaves. ``gates`` are the learned criterion's, and only its
    (:mod:`anytime.calibrate.gates`): every early exit's head runs, since each gate reads the exits before it.
    """

    criterion: str
    thresholds: tuple[float | None, ...]
    temperatures: tuple[float, ...] | None = None
    combine: Weights | None = None
    gates: ExitGates | None = None
    _limits: list[float] = field(init=False, repr=False, compare=False)
    _temps: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _heads: tuple[bool, ...] = field(init=False, repr=False, compare=False)
    _crit: Criterion = field(init=False, repr=False, compare=False)

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
        if crit.learned != (self.gates is not None):
            raise AnytimeError("the learned criterion needs its gates, and only it has gates: calibrate with "
                               "--criterion learned")  # fmt: skip
        if self.gates is not None and self.gates.num_steps != len(self.thresholds) + 1:
            raise AnytimeError(f"gates for {self.gates.num_steps} exits, thresholds for {len(self.thresholds) + 1}")
        if crit.learned and self.temperatures is not None:
            raise AnytimeError("learned gates read the exits' logits as they are; a learned policy has no temperatures")
        if self.combine is not None:
            check_weights(self.combine, len(self.thresholds) + 1)
            if self.temperatures is not None:
                raise AnytimeError("a policy that combines exits scales them with its weights; give it no temperatures")
            if crit.stateful:
                raise AnytimeError(f"the {self.criterion} criterion compares exits' classes; it does not combine exits")
            outside = [k for k, t in enumerate(self.thresholds) if t is not None and not any(self.combine[k])]
            if outside:
                raise AnytimeError(f"exit {outside[0]} has a threshold but no combination weights; give it weights "
                                   "or no threshold")  # fmt: skip
        signed = [-math.inf if t is None else (t if crit.low_is_confident else -t) for t in self.thresholds]
        # Plain floats, computed once: the batch-1 path compares against them with no tensor work.
        object.__setattr__(self, "_limits", signed)
        object.__setattr__(self, "_crit", crit)  # looked up once: the batch-1 path decides at every exit
        object.__setattr__(self, "_temps", tuple(self.temperatures or (1.0,) * (len(self.thresholds) + 1)))
        heads = (
            running_exits(self.combine) if self.combine is not None else (crit.stateful,) * (len(self.thresholds) + 1)
        )
        object.__setattr__(self, "_heads", tuple(h or t is not None for h, t in zip(heads, self.thresholds)) + (True,))

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

    def runs_head(self, k: int) -> bool:
        """Whether exit ``k``'s head runs under this policy: samples may leave there, or a combination weighs it."""
        return self._heads[k]

    def leave_costs(self, step: Tensor, cost: Tensor) -> Tensor:
        """Per exit, what a sample spends when it leaves there under this policy, ``[K]``: the backbone so far
        and every head on the way that :meth:`runs_head` (``step`` and ``cost`` per exit as the outputs cache
        holds them, in FLOPs or in measured ms)."""
        return combined_costs(step, cost, self._heads)

    def answers(self) -> ExitAnswers:
        """A fresh :class:`ExitAnswers` for one batch: pass each exit's logits through it before
        :meth:`confident` or :meth:`leaves`, and answer with what it returns."""
        return ExitAnswers(self.combine)

    def decisions(self) -> ExitDecisions:
        """Fresh :class:`ExitDecisions` for one request that runs every head in order."""
        return ExitDecisions(self)

    def signed_thresholds(self) -> Tensor:
        """Thresholds turned so that a sample leaves when its signed score is at most them; -inf: never."""
        import torch

        return torch.tensor(self._limits, dtype=torch.float64)

    def _per_exit(self) -> None:
        if self._crit.stateful:
            raise AnytimeError(f"the {self.criterion} criterion compares an exit with the earlier ones, which this "
                               "path does not keep; use a per-exit criterion (entropy, confidence, ...) here, or "
                               "`anytime evaluate` for real early exit with patience")  # fmt: skip

    def confident(self, k: int, logits: Tensor) -> Tensor | None:
        """Which samples may leave at early exit ``k`` given its answer (``None`` if nobody leaves there)."""
        self._per_exit()
        limit = self._limits[k]
        if limit == -math.inf:
            return None
        crit = self._crit
        return crit.signed(crit.score(logits, self._temps[k])) <= limit

    def leaves(self, k: int, logits: Tensor) -> bool:
        """Whether the one sample whose answer at early exit ``k`` is ``logits`` (``[1, C]``) leaves: a scalar
        decision, no per-sample bookkeeping (the batch-1 latency path)."""
        self._per_exit()
        limit = self._limits[k]
        if limit == -math.inf:
            return False
        if not logits.is_cuda and logits.shape[-1] <= ROW_CLASSES:
            return self._row_leaves(k, logits.tolist()[0])
        crit = self._crit
        score = float(crit.score(logits, self._temps[k]))
        return (score if crit.low_is_confident else -score) <= limit

    def _row_leaves(self, k: int, row: list[float]) -> bool:
        crit = self._crit
        score = crit.score_row(row, self._temps[k])
        return (score if crit.low_is_confident else -score) <= self._limits[k]

    def evaluate(self, cache: OutputCache) -> PolicyResult:
        """Accuracy, cost and exit shares of this policy on a cache (offline)."""
        from anytime.calibrate.sweeps import evaluate_settings

        self.check(cache.num_steps, cache.num_classes)
        scores = self._scores(cache)
        acc, cost, share = evaluate_settings(scores, self.signed_thresholds().view(1, -1), floor_disables=False)
        return PolicyResult(
            accuracy=float(acc[0]), mean_flops=float(cost[0]), flops_ratio=float(cost[0]) / cache.base_flops,
            exit_share=tuple(float(s) for s in share[0]),
        )  # fmt: skip

    def _scores(self, cache: OutputCache) -> Scores:
        from anytime.calibrate.sweeps import scores_of

        temps = None if self.temperatures is None else list(self.temperatures)
        return scores_of(self.seen_by(cache), self.criterion, temps, self.gates)

    def seen_by(self, cache: OutputCache) -> OutputCache:
        """The cache as this policy answers it: unchanged, or every exit's combined answer and the cost with
        the combined heads paid."""
        return cache if self.combine is None else combined_cache(cache, self.combine)

    def assign(self, cache: OutputCache) -> np.ndarray:
        """The exit every cached sample leaves at."""
        from anytime.calibrate.sweeps import assign_exits

        self.check(cache.num_steps, cache.num_classes)
        scores = self._scores(cache)
        return assign_exits(scores.signed, self.signed_thresholds().view(1, -1))[0].numpy()

    def run(self, model: torch.nn.Module, x: Tensor) -> EarlyExitOutput:
        """Real early exit of a multi-exit model on the batch ``x`` (in inference mode: the outputs carry
        no autograd history and cannot enter one). The logits come back in float32 whatever precision each
        step computes in: a converted model's heads answer in float32, its last segment in its own precision."""
        import torch

        # Looked up on the class: a missing attribute of a module raises inside nn.Module.__getattr__, a few us.
        program = model.exit_program(self) if hasattr(type(model), "exit_program") and x.device.type == "cpu" else None
        if program is not None:  # an ONNX export: the policy runs inside its graphs, on arrays
            answer = program(x.detach().numpy())
            return EarlyExitOutput(torch.from_numpy(answer.predictions), torch.from_numpy(answer.exits),
                                   torch.from_numpy(answer.logits))  # fmt: skip
        if torch.is_inference_mode_enabled():  # entering it again costs about 9 us, a share of a small network
            return self._run(model, x)
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
        crit = self._crit
        if crit.stateful:
            return self._run_stateful(segments, heads, x)
        if x.shape[0] == 1:
            return self._run_one(segments, heads, x)
        limits, temps = self._limits, self._temps
        batch, last = x.shape[0], self.num_steps - 1
        # The answer's tensors are made when the first sample leaves: a batch that leaves all at one exit (nobody
        # before the last, say) is answered by that exit's tensors directly, with no indexed writes.
        predictions: Tensor | None = None
        exits: Tensor | None = None
        out_logits: Tensor | None = None
        index: Tensor | None = None
        answers = self.answers()
        h = x
        for k, segment in enumerate(segments):
            h = segment(h)
            if not self._heads[k]:
                continue
            logits = answers.answer(k, h if k == last else heads[k](h))
            if k < last and limits[k] == -math.inf:
                continue  # a combined head that nobody leaves at
            leave = None if k == last else crit.signed(crit.score(logits, temps[k])) <= limits[k]
            leaving = 0 if leave is None else int(leave.sum())  # one operator and one read for both questions
            if leave is None or leaving == leave.shape[0]:
                if index is None:
                    everyone = torch.full((batch,), k, dtype=torch.long, device=x.device)
                    return EarlyExitOutput(predictions=logits.argmax(dim=1), exits=everyone, logits=logits.float())
                assert predictions is not None and exits is not None and out_logits is not None
                predictions[index] = logits.argmax(dim=1)
                exits[index] = k
                out_logits[index] = logits.float()
                break
            if leaving:
                if index is None:
                    predictions = torch.empty(batch, dtype=torch.long, device=x.device)
                    exits = torch.empty(batch, dtype=torch.long, device=x.device)
                    out_logits = torch.empty(batch, logits.shape[1], dtype=torch.float32, device=x.device)
                    index = torch.arange(batch, device=x.device)
                gone = index[leave]
                predictions[gone] = logits[leave].argmax(dim=1)
                exits[gone] = k
                out_logits[gone] = logits[leave].float()
                stay = ~leave
                index, h = index[stay], h[stay]
                answers.keep(stay)
        assert predictions is not None and exits is not None and out_logits is not None
        return EarlyExitOutput(predictions=predictions, exits=exits, logits=out_logits)

    def _run_stateful(
        self, segments: Sequence[torch.nn.Module], heads: list[torch.nn.Module], x: Tensor
    ) -> EarlyExitOutput:
        # Patience and learned gates: every early exit's head runs (the next exit's score reads its answer), a
        # sample leaves where the policy's decisions say so, and the samples that left are dropped from the batch
        # and from what the decisions keep of the exits before.
        import torch

        if self._crit.learned and x.shape[0] == 1 and x.device.type == "cpu":
            return self._run_learned_one(segments, heads, x)
        batch, last = x.shape[0], self.num_steps - 1
        predictions = torch.empty(batch, dtype=torch.long, device=x.device)
        exits = torch.full((batch,), last, dtype=torch.long, device=x.device)
        out_logits: Tensor | None = None
        index = torch.arange(batch, device=x.device)
        decisions = self.decisions()
        h = x
        for k, segment in enumerate(segments):
            h = segment(h)
            logits = h if k == last else heads[k](h)
            if out_logits is None:
                out_logits = torch.empty(batch, logits.shape[1], dtype=torch.float32, device=x.device)
            if k == last:
                leave: Tensor | None = torch.ones(logits.shape[0], dtype=torch.bool, device=x.device)
            else:
                leave = decisions.confident(k, logits)
            if leave is not None and bool(leave.any()):
                gone = index[leave]
                predictions[gone], exits[gone], out_logits[gone] = logits[leave].argmax(1), k, logits[leave].float()
                stay = ~leave
                if not bool(stay.any()):
                    break
                index, h = index[stay], h[stay]
                decisions.keep(stay)
        assert out_logits is not None
        return EarlyExitOutput(predictions=predictions, exits=exits, logits=out_logits)

    def _run_learned_one(
        self, segments: Sequence[torch.nn.Module], heads: list[torch.nn.Module], x: Tensor
    ) -> EarlyExitOutput:
        # One sample on the CPU: each exit's logits read once as Python floats, the gate scored in them (as
        # one_sample_path does for the per-exit criteria).
        import torch

        from anytime.calibrate.gates import row_features

        assert self.gates is not None
        score_row, limits, last, state = self.gates.score_row, self._limits, self.num_steps - 1, None
        h = x
        for k, segment in enumerate(segments):
            h = segment(h)
            if k == last:
                return EarlyExitOutput(h.argmax(dim=1), torch.full((1,), k, dtype=torch.long), h.float())
            logits = heads[k](h)
            row = logits.tolist()[0]
            features, state = row_features(row, state)
            if -score_row(k, features) <= limits[k]:
                return EarlyExitOutput(torch.full((1,), state.predicted, dtype=torch.long),
                                       torch.full((1,), k, dtype=torch.long), logits.float())  # fmt: skip
        raise AnytimeError("a multi-exit model needs at least one segment")

    def _run_one(
        self, segments: Sequence[torch.nn.Module], heads: Sequence[torch.nn.Module], x: Tensor
    ) -> EarlyExitOutput:
        answers = self.answers() if self.combine is not None else None
        return one_sample_path(segments, heads, self, x.device)(x, answers)

    def runner(self, model: torch.nn.Module) -> Callable[[Tensor], EarlyExitOutput]:
        """:meth:`run` bound to ``model``, for a caller that answers one sample at a time (a server, a latency
        measurement): the same answers, with the model's exits found and the policy's checks made once instead of
        on every call. Between a small network's stages those checks cost what an operator does (LeNet at batch
        1, 80% leaving at its first exit: 13 us less per answer than :meth:`run`, of 180-190 us). A batch of more
        than one sample, a tensor off the CPU, a call outside inference mode and a model put back in training mode
        take :meth:`run`'s way, as does every call for a policy that combines exits or counts a streak (patience),
        or a model that is an ONNX export."""
        import torch

        segments, heads = getattr(model, "segments", None), getattr(model, "heads", None)
        if (self.combine is not None or self._crit.stateful or hasattr(type(model), "exit_program")
                or not isinstance(segments, (tuple, list)) or not isinstance(heads, (tuple, list, torch.nn.ModuleList))
                or len(segments) != self.num_steps):  # fmt: skip
            return partial(self.run, model)  # which also says what is wrong with the model
        one = one_sample_path(segments, heads, self, torch.device("cpu"))
        run, inference = self.run, torch.is_inference_mode_enabled

        def answer(x: Tensor) -> EarlyExitOutput:
            if x.shape[0] != 1 or not x.is_cpu or model.training or not inference():
                return run(model, x)
            return one(x, None)

        return answer

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {"criterion": self.criterion, "thresholds": list(self.thresholds),
                "temperatures": None if self.temperatures is None else list(self.temperatures),
                "combine": None if self.combine is None else [list(row) for row in self.combine],
                **({"gates": self.gates.to_dict()} if self.gates is not None else {})}  # fmt: skip

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, where: str = "policy") -> ExitPolicy:
        """Rebuild from :meth:`to_dict`'s output; a clear error for anything malformed."""
        try:
            thresholds = tuple(None if t is None else float(t) for t in values["thresholds"])
            temps = values.get("temperatures")
            combine = values.get("combine")
            gates = values.get("gates")
            return cls(
                criterion=str(values["criterion"]), thresholds=thresholds,
                temperatures=None if temps is None else tuple(float(t) for t in temps),
                combine=None if combine is None else tuple(tuple(float(w) for w in row) for row in combine),
                gates=None if gates is None else ExitGates.from_dict(gates, where=where),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            raise AnytimeError(f"{where}: not a valid exit policy (needs criterion and thresholds)") from None
