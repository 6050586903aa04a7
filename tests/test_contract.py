"""The step contract (anytime.contract), checked the same way on every family of steps in the package."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from anytime.calibrate import ExitPolicy
from anytime.contract import is_anytime, is_incremental, is_segmented, run_step, step_count
from anytime.errors import AnytimeError
from anytime.families.registry import Family, get_family, list_families
from anytime.precision import convert
from anytime.profile import StepTiming, profile_model

PRECISION_FORMS = {  # family: precision (eager: compiling takes 30 s per batch size here; the compiled form is test_precision's)
    "exits-bf16": ("exits", "bf16"),
}


def _build(case: str) -> tuple[nn.Module, torch.Tensor, Family]:
    family = get_family(PRECISION_FORMS.get(case, (case,))[0])
    model, x = family.example()
    if case in PRECISION_FORMS:
        model = convert(model.eval(), PRECISION_FORMS[case][1], input_shape=tuple(x.shape[1:]), compile=False)[0]
    return model, x, family


@pytest.mark.parametrize("case", [*list_families(), *PRECISION_FORMS])
def test_every_family_keeps_the_step_contract(case):
    torch.manual_seed(0)
    model, x, family = _build(case)
    model = model.eval()
    assert is_anytime(model) and is_incremental(model) == family.incremental
    assert is_segmented(model) == family.segmented
    k_steps = step_count(model)
    assert k_steps >= 2
    with torch.inference_mode():
        everything = model.forward_all(x).float()
        one_by_one = torch.stack([run_step(model, x, k).float() for k in range(k_steps)])
        streamed = torch.stack([s.float() for s in model.steps(x)])
    assert everything.shape == (k_steps, x.shape[0], 10)
    tolerance = 5e-2 if case in PRECISION_FORMS else 1e-5
    torch.testing.assert_close(one_by_one, everything, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(streamed, everything, atol=tolerance, rtol=tolerance)
    if family.segmented:  # real early exit with nobody leaving early answers as the last step does
        policy = ExitPolicy("confidence", (None,) * (k_steps - 1))
        out = policy.run(model, x)
        assert torch.equal(out.predictions, everything[-1].argmax(dim=1)) and bool((out.exits == k_steps - 1).all())
    profile = profile_model(model, tuple(x.shape[1:]), StepTiming(batch_sizes=(1,), repeats=2, warmup=0))
    assert profile.num_steps == k_steps and profile.incremental == family.incremental


def test_the_registry_names_every_family_the_package_builds():
    assert set(list_families()) >= {"exits", "slices", "cuts", "resolution", "sact", "ensemble", "text"}
    with pytest.raises(AnytimeError, match="unknown family 'nope'; registered: cuts"):
        get_family("nope")


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
    from anytime.precision.parts import layout_of

    assert layout_of(Exits()) == "exits"
