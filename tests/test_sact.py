"""SACT: halting per position inside residual stages, sparse execution equal to dense, costs, training, maps."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from anytime.backbones import create_model
from anytime.cli import main
from anytime.errors import AnytimeError
from anytime.families.sact import SACTResNet, parse_thresholds
from anytime.train import TrainConfig, Trainer


def _with_varied_halting(model: SACTResNet, seed: int = 0) -> SACTResNet:
    """Halting scores that differ from position to position, and batch norms with non-trivial statistics."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stage in model.halting:
            for halt in stage:
                if halt.conv is not None:
                    halt.conv.weight.normal_(0, 0.3, generator=generator)
                halt.fc.weight.normal_(0, 0.3, generator=generator)
                halt.fc.bias.normal_(-0.5, 1.0, generator=generator)
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.1, generator=generator)
                module.running_var.uniform_(0.5, 1.5, generator=generator)
                module.weight.uniform_(0.5, 1.5, generator=generator)
                module.bias.normal_(0, 0.1, generator=generator)
    return model.eval()


def _constant_halting(model: SACTResNet, score: float) -> SACTResNet:
    with torch.no_grad():
        for stage in model.halting:
            for halt in stage:
                halt.fc.bias.fill_(math.log(score / (1 - score)))
    return model.eval()


def test_thresholds_parse_and_refuse():
    assert parse_thresholds("0.5, 0.9,0.99") == (0.5, 0.9, 0.99)
    for bad, words in (("0.5", "at least two"), ("0.9,0.5", "rising"), ("0,0.5", "outside (0, 1]"),
                       ("0.5,1.2", "outside"), ("0.5,x", "halting thresholds"), ("0.5,nan", "outside")):  # fmt: skip
        with pytest.raises(AnytimeError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            parse_thresholds(bad)


@pytest.mark.parametrize("name", ["resnet20", "resnet29_bottleneck", "tv:resnet18"])
@pytest.mark.parametrize("mode", ["spatial", "image"])
def test_sparse_execution_gives_the_dense_outputs(name, mode):
    model = _with_varied_halting(SACTResNet(create_model(name), (0.3, 0.6, 0.99), input_shape=(3, 32, 32), mode=mode))
    x = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    seen = set()
    with torch.no_grad():
        for k in range(model.num_steps):
            model.execution = "dense"
            dense = model.forward_until(x, k)
            dense_units = [h.units for h in model.halting_maps(x, k)]
            model.execution = "sparse"
            sparse = model.forward_until(x, k)
            sparse_units = [h.units for h in model.halting_maps(x, k)]
            torch.testing.assert_close(sparse, dense, atol=1e-4, rtol=1e-4)
            for a, b in zip(sparse_units, dense_units):
                assert torch.equal(a.float(), b.float())
                seen.update(a.flatten().tolist())
    assert min(seen) >= 1 and len(seen) > 1  # positions (or images) did halt at different units


def test_halting_follows_the_accumulated_scores():
    model = _constant_halting(SACTResNet(create_model("resnet32"), (0.3, 0.99), input_shape=(3, 32, 32)), 0.4)
    x = torch.randn(2, 3, 32, 32)
    for execution in ("dense", "sparse"):
        model.execution = execution
        # 0.4 reaches 0.3 at once: one unit, remainder 1
        assert all(torch.allclose(h.units, torch.ones_like(h.units)) and torch.allclose(h.ponder, 2 * torch.ones_like(h.ponder))
                   for h in model.halting_maps(x, 0))  # fmt: skip
        # 0.4, 0.8, then 1.2 >= 0.99: three units, remainder 1 - 0.8
        for h in model.halting_maps(x, 1):
            assert torch.allclose(h.units, torch.full_like(h.units, 3.0))
            assert torch.allclose(h.ponder, torch.full_like(h.ponder, 3.2))


def test_no_position_halts_with_the_papers_initial_bias():
    model = SACTResNet(create_model("resnet20"), (0.5, 0.99), input_shape=(3, 32, 32)).eval()
    for h in model.halting_maps(torch.randn(2, 3, 32, 32), 1):
        assert torch.equal(h.units, torch.full_like(h.units, 3.0))


def test_measured_costs_rise_with_the_threshold_and_travel_with_the_weights():
    model = _with_varied_halting(SACTResNet(create_model("resnet20"), (0.2, 0.6, 0.99), input_shape=(3, 32, 32)))
    assert not model.cost_measured and model.step_flops == (model.dense_flops,) * 3
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    costs = model.measure_cost([(x[:4], None), (x[4:], None)])
    flops = [c.flops for c in costs]
    assert flops == sorted(flops) and flops[0] < flops[-1] < model.dense_flops
    assert [c.units for c in costs] == sorted(c.units for c in costs)
    assert model.step_flops == tuple(flops) and [e.flops for e in model.exit_info] == flops
    assert model.costs is not None and [c.flops for c in model.costs] == flops
    with pytest.raises(AnytimeError, match="sparse"):
        model.execution = "sprase"
    again = SACTResNet(create_model("resnet20"), (0.2, 0.6, 0.99), input_shape=(3, 32, 32)).eval()
    again.execution = "sparse"
    with torch.no_grad():
        again.forward_until(x, 1)  # keeps its folded weights, which the new state must replace
        again.load_state_dict(model.state_dict())
        model.execution = "dense"
        torch.testing.assert_close(again.forward_until(x, 1), model.forward_until(x, 1), atol=1e-4, rtol=1e-4)
    assert again.cost_measured and again.step_flops == tuple(flops)
    with pytest.raises(AnytimeError, match="needs images"):
        model.measure_cost([])


def test_the_ponder_cost_trains_the_halting_units():
    model = SACTResNet(create_model("resnet20"), (0.5, 0.99), input_shape=(3, 32, 32), ponder_cost=0.01).train()
    assert model.training_steps() == [1]
    logits = model.forward_until(torch.randn(4, 3, 32, 32), 1)
    loss = model.auxiliary_loss()
    start = 1 / (1 + math.exp(3))  # every score at first: the bias of -3
    assert loss.item() == pytest.approx(0.01 * 3 * (3 + 1 - 2 * start), rel=1e-4)  # 3 units and the remainder, 3 stages
    (logits.sum() * 0 + loss).backward()
    bias = model.halting[0][0].fc.bias.grad
    assert bias is not None and bias.item() < 0  # raising the scores would lower the ponder cost
    with pytest.raises(AnytimeError, match="no training forward"):
        model.auxiliary_loss()


def test_training_runs_every_unit_even_when_all_positions_halt_early():
    # data-parallel training needs a gradient for every parameter on every process, halted or not
    model = _constant_halting(SACTResNet(create_model("resnet20"), (0.5, 0.99), input_shape=(3, 32, 32)), 0.999).train()
    (model.forward_until(torch.randn(2, 3, 32, 32), 1).sum() + model.auxiliary_loss()).backward()
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    assert all(torch.equal(h.units, torch.ones_like(h.units)) for h in model.halting_maps(torch.randn(2, 3, 32, 32), 1))


def test_backbones_without_residual_stages_are_refused():
    for name in ("lenet", "vgg11", "mobilenetv2"):
        with pytest.raises(AnytimeError, match="resnet20") as error:
            SACTResNet(create_model(name, in_channels=1 if name == "lenet" else 3), (0.5, 0.99),
                       input_shape=(1, 28, 28) if name == "lenet" else (3, 32, 32))  # fmt: skip
        assert "\n" not in str(error.value)
    with pytest.raises(AnytimeError, match="a family of its own"):
        TrainConfig(model="resnet20", sact="0.5,0.99", exits="auto")
    with pytest.raises(AnytimeError, match="ponder-cost"):
        TrainConfig(model="resnet20", sact="0.5,0.99", ponder_cost=-1)
    with pytest.raises(AnytimeError, match="sact-mode"):
        TrainConfig(model="resnet20", sact="0.5,0.99", sact_mode="pixel")
    with pytest.raises(AnytimeError, match="give its halting thresholds with --sact"):
        TrainConfig(model="resnet20", ponder_cost=0.1)
    with pytest.raises(AnytimeError, match="rising"):
        TrainConfig(model="resnet20", sact="0.9,0.5")


def test_a_sact_run_goes_through_the_pipeline(tmp_path, capsys, cli_error, exit_run):
    from anytime.tasks.collect import collect_run
    from anytime.tasks.profiling import ProfileSettings, profile_run

    run = tmp_path / "sact"
    config = TrainConfig(model="resnet20", data="digits", epochs=2, batch_size=64, lr=0.05, limit_train=400,
                         sact="0.3,0.7,0.99", ponder_cost=0.05)  # fmt: skip
    summary = Trainer(config, run).fit()
    assert [e.name for e in summary.steps] == ["halt0.3", "halt0.7", "halt0.99"]
    flops = [e.flops for e in summary.steps]
    assert flops == sorted(flops)
    cache = collect_run(run, "val")
    assert cache.num_steps == 3 and list(cache.step_flops) == flops
    profile, _ = profile_run(
        run, ProfileSettings(batch_sizes=(1, 4), repeats=10, warmup=1, memory=False, execution="sparse")
    )
    assert profile.settings["execution"] == "sparse" and "validation images" in profile.settings["inputs"]
    assert list(profile.step_flops) == flops and not profile.incremental
    assert main(["schedule", str(run), "--deadline-ms", "1e6", "--quantile", "0.9"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"]

    assert main(["ponder", str(run), "--split", "test", "--count", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in report["steps"]] == ["halt0.3", "halt0.7", "halt0.99"]
    with np.load(run / "ponder" / "ponder.npz") as arrays:
        assert arrays["units"].shape == (3, 3, 32, 32) and arrays["stage0"].shape == (3, 3, 32, 32)
        assert arrays["units"].min() >= 3 and arrays["units"].max() <= 9
    assert (run / "ponder" / "ponder.png").is_file()
    cli_error(["ponder", str(exit_run), "--split", "test"], "not a SACT run", "--sact")
    cli_error(["ponder", str(run), "--split", "test", "--steps", "5"], "--steps", "0..2")
    cli_error(["profile", str(exit_run), "--execution", "sparse", "--no-memory"], "--execution", "SACT")
    cli_error(["train", "--model", "vgg11", "--data", "digits", "--sact", "0.5,0.99", "--out", str(tmp_path / "v")],
              "residual stages", "resnet20")  # fmt: skip


@pytest.mark.parametrize("name", ["resnet20", "tv:resnet18"])
def test_sparse_execution_sees_batch_norm_folded_by_an_inference_form(name):
    from anytime.deploy.inference import InferenceForm, inference_form

    model = _with_varied_halting(SACTResNet(create_model(name), (0.3, 0.99), input_shape=(3, 32, 32)))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    folded = inference_form(model, InferenceForm.parse("fold"), probe=x)
    folded.execution = "sparse"
    with torch.no_grad():
        torch.testing.assert_close(folded.forward_until(x, 0), model.forward_until(x, 0), atol=1e-4, rtol=1e-4)
