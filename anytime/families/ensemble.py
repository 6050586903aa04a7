"""An ensemble of different networks as an anytime ladder: step k is the fused answer of members 0..k."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from anytime.backbones.base import takes_tokens
from anytime.errors import AnytimeError
from anytime.families.exits import ExitInfo
from anytime.families.fusers import Fuser, is_fitted_kind, log_probs, make_fuser


@dataclass(frozen=True)
class MemberInfo:
    """One member as the ensemble uses it: ``step`` is the member's step it answers with (its last exit for a
    multi-exit run; None for a plain classifier, whose forward is its answer); FLOPs are its float graph's."""

    name: str
    step: int | None
    flops: int
    params: int
    precision: str = "fp32"


def member_logits(member: nn.Module, step: int | None, x: Tensor) -> Tensor:
    """A member's logits ``[B, C]``: its forward, or its step ``step`` (a multi-exit member)."""
    return member(x) if step is None else member.forward_until(x, step)  # type: ignore[operator]


def member_log_probs(member: nn.Module, step: int | None, x: Tensor) -> Tensor:
    """A member's log-probabilities ``[B, C]`` (what most fusers read)."""
    return log_probs(member_logits(member, step, x))


class FuserBank(nn.Module):
    """The fusers of an ensemble (what its weights file holds): the deployed fuser of every prefix and, for
    learned fusers, the cross-fitted ones with the fold of every held-out sample."""

    def __init__(self, kind: str, num_members: int, num_classes: int, *, folds: int = 0, heldout: int = 0,
                 hidden: int = 32, scale: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        self.kind = kind
        self.fusers = nn.ModuleList(make_fuser(kind, k + 1, num_classes, hidden=hidden, scale=scale)
                                    for k in range(num_members))  # fmt: skip
        fitted = is_fitted_kind(kind)
        self.fold_fusers = nn.ModuleList(
            nn.ModuleList(make_fuser(kind, k + 1, num_classes, hidden=hidden) for k in range(num_members))
            for _ in range(folds if fitted else 0)
        )  # fmt: skip
        self.register_buffer("folds", torch.zeros(heldout if fitted else 0, dtype=torch.int64))

    @classmethod
    def of(cls, fusers: Sequence[Fuser], fold_fusers: Sequence[Sequence[Fuser]], folds: Tensor) -> FuserBank:
        """A bank holding fusers already fit (see :func:`anytime.families.cross_fit`)."""
        first = fusers[0]
        bank = cls(first.kind, len(fusers), first.num_classes, hidden=getattr(first, "hidden", 32))
        bank.fusers = nn.ModuleList(fusers)
        bank.fold_fusers = nn.ModuleList(nn.ModuleList(f) for f in fold_fusers)
        bank.folds = folds.clone() if fold_fusers else torch.zeros(0, dtype=torch.int64)
        return bank.eval()


class EnsembleModel(nn.Module):
    """Members of any architecture and precision, in cost order, fused after each one (the step contract).

    ``steps(x)`` runs member k only when asked for step k; ``forward_until(x, k)`` runs members 0..k and the
    fuser of that prefix; ``forward_all`` / ``forward`` give ``[K, B, C]``. ``forward_heldout(x, folds)`` answers
    held-out samples with the cross-fitted fusers that did not see them (what the validation cache holds).
    """

    incremental = True

    def __init__(self, members: Sequence[nn.Module], infos: Sequence[MemberInfo], bank: FuserBank) -> None:
        super().__init__()
        if not members or len(members) != len(infos) or len(bank.fusers) != len(members):
            raise AnytimeError("an ensemble needs one member description and one fuser per member")
        self.members = nn.ModuleList(members)
        self.infos = tuple(infos)
        self.bank = bank
        fuser_flops = [int(f.flops()) for f in bank.fusers]
        flops = self.step_flops_from([i.flops for i in infos])
        paid = [sum(i.flops for i in infos[: k + 1]) + sum(fuser_flops[: k + 1]) for k in range(len(infos))]
        params = [sum(i.params for i in infos[: k + 1]) + sum(p.numel() for p in bank.fusers[k].parameters())
                  for k in range(len(infos))]  # fmt: skip
        self.exit_info = tuple(  # a step's "features" are the log-probabilities its fuser reads
            ExitInfo(k, self.step_name(k), (k + 1, bank.fusers[k].num_classes), flops[k], paid[k], params[k],
                     fuser_flops[k], sum(p.numel() for p in bank.fusers[k].parameters()))
            for k in range(len(infos))
        )  # fmt: skip
        self.step_flops = tuple(flops)
        self.member_precisions = tuple(i.precision for i in infos)
        self.backbone_flops = max(i.flops for i in infos)
        if any(takes_tokens(m) for m in members):  # members of one tokenizer read the same token ids
            self.modality = "text"

    def step_flops_from(self, member_flops: Sequence[int]) -> tuple[int, ...]:
        """FLOPs of each step given each member's FLOPs on one input (a sentence's depend on its length): the
        members of the prefix and the step's fuser."""
        return tuple(sum(member_flops[: k + 1]) + int(fuser.flops()) for k, fuser in enumerate(self.bank.fusers))

    @property
    def num_steps(self) -> int:
        """The number of members: step k fuses the first k+1."""
        return len(self.members)

    def step_name(self, k: int) -> str:
        """``1:resnet20``, ``2:+resnet18-int8``...: how many members answer, and the one step k adds."""
        return f"{k + 1}:{'' if k == 0 else '+'}{self.infos[k].name}"

    def _check_step(self, k: int) -> int:
        if not 0 <= k < self.num_steps:
            raise AnytimeError(f"step {k} is out of range: the ensemble has steps 0..{self.num_steps - 1}")
        return k

    def member_answer(self, x: Tensor, i: int) -> Tensor:
        """Member ``i``'s answer ``[B, C]`` as the fusers read it: log-probabilities (or raw logits for
        torchensemble's logit fusion)."""
        read = member_logits if self.bank.fusers[0].reads_logits else member_log_probs
        return read(self.members[i], self.infos[i].step, x)

    def steps(self, x: Tensor) -> Iterator[Tensor]:
        """Yield the fused logits after member 0, 1, ..., running each member only when asked for."""
        answers: list[Tensor] = []
        for k, fuser in enumerate(self.bank.fusers):
            answers.append(self.member_answer(x, k))
            yield fuser(torch.stack(answers))

    def forward_until(self, x: Tensor, k: int) -> Tensor:
        """Fused logits ``[B, C]`` of members 0..k: no later member runs."""
        k = self._check_step(k)
        answers = torch.stack([self.member_answer(x, i) for i in range(k + 1)])
        return self.bank.fusers[k](answers)

    def forward_all(self, x: Tensor) -> Tensor:
        """Fused logits of every prefix, ``[K, B, C]``."""
        return torch.stack(list(self.steps(x)))

    def forward(self, x: Tensor) -> Tensor:
        """Same as :meth:`forward_all`."""
        return self.forward_all(x)

    @property
    def segments(self) -> tuple[nn.Module, ...]:
        """Early exit by :class:`anytime.calibrate.ExitPolicy`: segment k runs member k on the samples still in,
        carrying the input and the answers so far in one tensor (the last segment also fuses, so it answers)."""
        carried = _Carried()
        return tuple(_MemberSegment(self, k, carried) for k in range(self.num_steps))

    @property
    def heads(self) -> list[nn.Module]:
        """Early exit: head k fuses the answers that segment k has carried so far."""
        return [_FuseHead(f) for f in self.bank.fusers[:-1]]

    def backbone(self, x: Tensor) -> Tensor:
        """The whole ensemble (every member, the last fuser): what answering without early exit costs."""
        return self.forward_until(x, self.num_steps - 1)

    def heldout_view(self) -> HeldoutView:
        """This ensemble as the validation cache must be collected (see :class:`HeldoutView`)."""
        return HeldoutView(self)

    def forward_heldout(self, x: Tensor, folds: Tensor) -> Tensor:
        """``[K, B, C]`` for held-out samples in folds ``folds`` ``[B]``: each answered by the cross-fitted fusers
        fit without its fold (the deployed fusers for fusers that learn nothing)."""
        if not len(self.bank.fold_fusers):
            return self.forward_all(x)
        answers = torch.stack([self.member_answer(x, i) for i in range(self.num_steps)])
        out = torch.empty(self.num_steps, x.shape[0], answers.shape[-1], device=x.device)
        for fold, fusers in enumerate(self.bank.fold_fusers):
            rows = folds == fold
            if rows.any():
                for k, fuser in enumerate(fusers):  # type: ignore[var-annotated]
                    out[k, rows] = fuser(answers[: k + 1, rows])
        return out


class HeldoutView(nn.Module):
    """An ensemble as its validation cache must see it: ``forward_all`` answers the held-out samples, fed in
    their split's order, with the cross-fitted fusers that did not see each of them."""

    def __init__(self, ensemble: EnsembleModel) -> None:
        super().__init__()
        self.ensemble = ensemble
        self.exit_info = ensemble.exit_info
        self.backbone_flops = ensemble.backbone_flops
        self.seen = 0

    def forward_all(self, x: Tensor) -> Tensor:
        """``[K, B, C]`` for the next ``B`` held-out samples."""
        folds = self.ensemble.bank.folds
        if len(folds) and self.seen + x.shape[0] > len(folds):
            raise AnytimeError(f"the ensemble's fusers were fit on {len(folds)} validation images but more are "
                               "being collected; the data changed: build the ensemble again")  # fmt: skip
        mine = folds[self.seen : self.seen + x.shape[0]].to(x.device)
        self.seen += x.shape[0]
        return self.ensemble.forward_heldout(x, mine)


class _Carried:
    """What the segments of one pass share: one sample's input shape and the input's dtype. Under early exit the
    input rides along with the answers in one float tensor; token ids below 2**24 survive the trip exactly."""

    def __init__(self) -> None:
        self.shape: tuple[int, ...] = ()
        self.dtype = torch.float32


class _MemberSegment(nn.Module):
    """Segment k of an ensemble under early exit (see :attr:`EnsembleModel.segments`)."""

    def __init__(self, ensemble: EnsembleModel, k: int, carried: _Carried) -> None:
        super().__init__()
        object.__setattr__(self, "ensemble", ensemble)  # not a submodule: the members are registered once
        self.k = k
        self.carried = carried  # the input's shape and dtype, shared by the segments of one pass (set by the first)

    def forward(self, h: Tensor) -> Tensor:
        if self.k == 0:
            self.carried.shape, self.carried.dtype = tuple(h.shape[1:]), h.dtype
            x, answers = h, h.new_zeros(h.shape[0], 0, dtype=torch.float32)
        else:
            size = int(torch.Size(self.carried.shape).numel())
            x = h[:, :size].reshape(h.shape[0], *self.carried.shape).to(self.carried.dtype)  # token ids come back whole
            answers = h[:, size:]
        mine = self.ensemble.member_answer(x, self.k)
        answers = torch.cat([answers, mine.float()], dim=1)
        if self.k == self.ensemble.num_steps - 1:
            return _FuseHead(self.ensemble.bank.fusers[self.k])(answers)
        return torch.cat([x.flatten(1).float(), answers], dim=1)


class _FuseHead(nn.Module):
    """Head k of an ensemble under early exit: fuser k on the answers carried so far."""

    def __init__(self, fuser: Fuser) -> None:
        super().__init__()
        object.__setattr__(self, "fuser", fuser)

    def forward(self, h: Tensor) -> Tensor:
        """Fused logits from the last ``members x classes`` columns of the carried state."""
        count, classes = self.fuser.members, self.fuser.num_classes
        answers = h[:, h.shape[1] - count * classes :].reshape(h.shape[0], count, classes)
        return self.fuser(answers.transpose(0, 1))
