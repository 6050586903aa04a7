"""The registry of families of steps: every ladder the package builds, each with a small example of itself.

The step-contract test runs every registered family, so a new family is tested by being registered here (as timm
tests each registered model): add its :class:`Family` with an example builder to :data:`FAMILIES`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from anytime.backbones import create_model
from anytime.errors import AnytimeError
from anytime.families import EnsembleModel, FuserBank, MemberInfo, cross_fit
from anytime.families.exits import attach_exits
from anytime.families.residual import BlockDropLadder
from anytime.families.resolution import ResolutionLadder, parse_resolutions
from anytime.families.sact import SACTResNet
from anytime.families.slicing import slice_model

IMAGE = (3, 32, 32)
BATCH = 4


@dataclass(frozen=True)
class Family:
    """A family of steps: its name, what it is, whether its steps build on each other (``incremental``: one pass
    answers at every step) and whether it is built of segments and exit heads (``segmented``), and ``example``, a
    builder of a small untrained instance with a batch of inputs it takes."""

    name: str
    description: str
    incremental: bool
    segmented: bool
    example: Callable[[], tuple[nn.Module, Tensor]]


def _images() -> Tensor:
    return torch.randn(BATCH, *IMAGE, generator=torch.Generator().manual_seed(3))


def _exits() -> tuple[nn.Module, Tensor]:
    return attach_exits(create_model("resnet20", num_classes=10), "auto", num_classes=10, input_shape=IMAGE), _images()


def _slices() -> tuple[nn.Module, Tensor]:
    return slice_model(create_model("resnet20", num_classes=10), (0.5, 1.0), input_shape=IMAGE), _images()


def _cuts() -> tuple[nn.Module, Tensor]:
    return BlockDropLadder(create_model("resnet20", num_classes=10), input_shape=IMAGE), _images()


def _resolution() -> tuple[nn.Module, Tensor]:
    rungs = parse_resolutions("16,24,32", IMAGE[1:])
    return ResolutionLadder(create_model("resnet20", num_classes=10), rungs, input_shape=IMAGE), _images()


def _sact() -> tuple[nn.Module, Tensor]:
    return SACTResNet(create_model("resnet20", num_classes=10), (0.5, 0.99), input_shape=IMAGE), _images()


def _ensemble() -> tuple[nn.Module, Tensor]:
    members = [nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10)) for _ in range(3)]
    infos = [MemberInfo(f"m{i}", None, 1000 * (i + 1), 30730) for i in range(3)]
    x = torch.randn(60, *IMAGE, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 10, (60,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logps = torch.stack([m(x).log_softmax(-1) for m in members])
    fit = cross_fit("mean", logps, labels, folds=3)
    bank = FuserBank.of(fit.fusers, fit.fold_fusers, torch.from_numpy(fit.folds))
    return EnsembleModel(members, infos, bank), _images()


def _text() -> tuple[nn.Module, Tensor]:
    encoder = create_model("bert_mini", num_classes=10, vocab_size=200, max_length=12)
    tokens = torch.randint(1, 200, (BATCH, 12), generator=torch.Generator().manual_seed(3))
    return attach_exits(encoder, "auto", num_classes=10), tokens


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("exits", "early exits: heads attached along a backbone (BranchyNet, SDN)", True, True, _exits),
    Family("slices", "nested widths of one network (slimmable)", False, False, _slices),
    Family("cuts", "residual-link cutting and block skipping, one set of weights", False, False, _cuts),
    Family("resolution", "one network at a ladder of input resolutions", False, False, _resolution),
    Family("sact", "spatially adaptive computation time, halting per position", False, False, _sact),
    Family("ensemble", "a heterogeneous ensemble fused after each member", True, True, _ensemble),
    Family("text", "a text encoder with exits after its layers", True, True, _text),
)}  # fmt: skip


def list_families() -> list[str]:
    """Every registered family's name, sorted."""
    return sorted(FAMILIES)


def get_family(name: str) -> Family:
    """The registered family ``name``."""
    if name not in FAMILIES:
        raise AnytimeError(f"unknown family '{name}'; registered: {', '.join(list_families())}")
    return FAMILIES[name]
