"""The step contract (anytime.contract), checked the same way on every family of steps in the package."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from anytime.backbones import create_model
from anytime.calibrate import ExitPolicy
from anytime.contract import is_anytime, is_incremental, is_segmented, run_step, step_count
from anytime.ensembles import EnsembleModel, FuserBank, MemberInfo, cross_fit
from anytime.precision import convert
from anytime.profile import profile_model
from anytime.wrappers import BlockDropLadder, attach_exits, slice_model

SHAPE = (3, 32, 32)


def _ensemble() -> nn.Module:
    members = [nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10)) for _ in range(3)]
    infos = [MemberInfo(f"m{i}", None, 1000 * (i + 1), 30730) for i in range(3)]
    x = torch.randn(60, *SHAPE, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 10, (60,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logps = torch.stack([m(x).log_softmax(-1) for m in members])
    fit = cross_fit("mean", logps, labels, folds=3)
    return EnsembleModel(members, infos, FuserBank.of(fit.fusers, fit.fold_fusers, torch.from_numpy(fit.folds)))


def _exits() -> nn.Module:
    return attach_exits(create_model("resnet20", num_classes=10), "auto", num_classes=10, input_shape=SHAPE)


FAMILIES = {  # name: (builder, incremental, segmented)
    "exits": (_exits, True, True),
    "slices": (lambda: slice_model(create_model("resnet20", num_classes=10), (0.5, 1.0), input_shape=SHAPE), False, False),
    "ladder": (lambda: BlockDropLadder(create_model("resnet20", num_classes=10), input_shape=SHAPE), False, False),
    "ensemble": (_ensemble, True, True),
    # eager: compiling takes 30 s per batch size here, and the compiled form is test_precision's
    "exits-bf16": (lambda: convert(_exits().eval(), "bf16", input_shape=SHAPE, compile=False)[0], True, True),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_keeps_the_step_contract(family):
    build, incremental, segmented = FAMILIES[family]
    torch.manual_seed(0)
    model = build().eval()
    assert is_anytime(model) and is_incremental(model) == incremental
    assert is_segmented(model) == segmented
    k_steps = step_count(model)
    assert k_steps >= 2
    x = torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        everything = model.forward_all(x).float()
        one_by_one = torch.stack([run_step(model, x, k).float() for k in range(k_steps)])
        streamed = torch.stack([s.float() for s in model.steps(x)])
    assert everything.shape == (k_steps, 4, 10)
    tolerance = 5e-2 if "bf16" in family else 1e-5
    torch.testing.assert_close(one_by_one, everything, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(streamed, everything, atol=tolerance, rtol=tolerance)
    if segmented:  # real early exit with nobody leaving early answers as the last step does
        policy = ExitPolicy("confidence", (None,) * (k_steps - 1))
        out = policy.run(model, x)
        assert torch.equal(out.predictions, everything[-1].argmax(dim=1)) and bool((out.exits == k_steps - 1).all())
    profile = profile_model(model, SHAPE, batch_sizes=(1,), repeats=2, warmup=0)
    assert profile.num_steps == k_steps and profile.incremental == incremental


def test_a_plain_module_is_one_step():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5)).eval()
    x = torch.randn(2, 3, 2, 2)
    assert not is_anytime(model) and step_count(model) == 1 and not is_incremental(model)
    torch.testing.assert_close(run_step(model, x, 0), model(x))


def test_exit_heads_kept_as_a_submodule_make_a_segmented_model():
    """Python 3.12's isinstance on a protocol looks attributes up statically and misses an nn.Module's submodules
    (it took every multi-exit network for separate steps there); the contract's checks look them up as Python does."""

    class Exits(nn.Module):
        num_steps = 2

        def __init__(self) -> None:
            super().__init__()
            self.segments = nn.ModuleList([nn.Identity(), nn.Identity()])
            self.heads = nn.ModuleList([nn.Flatten()])

        def forward_until(self, x, k):
            return x.flatten(1)

        def forward_all(self, x):
            return torch.stack([x.flatten(1)] * 2)

        def steps(self, x):
            yield from self.forward_all(x)

    assert "heads" not in vars(Exits()) and is_segmented(Exits()) and is_anytime(Exits())
    from anytime.precision.model import layout_of

    assert layout_of(Exits()) == "exits"
