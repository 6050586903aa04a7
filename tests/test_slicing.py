"""Sliced networks: width and cardinality slices as a ladder of steps."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from anytime import AnytimeError, create_model, slice_model
from anytime.cli import main
from anytime.train import TrainConfig, Trainer


def _randomised(name: str) -> nn.Module:
    """A zoo model in eval mode with batch-norm statistics that are not the identity."""
    torch.manual_seed(0)
    model = create_model(name)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize(
    "name, kind, ratios",
    [("resnet20", "width", "0.25,0.5,1.0"), ("resnet18", "width", "0.5,1.0"), ("preact_resnet18", "width", "0.5,1"),
     ("mobilenetv2", "width", "0.5,1.0"), ("vgg11", "width", "0.25,1.0"), ("resnext29_2x64d", "cardinality", "0.5,1.0"),
     ("tv:resnet18", "width", "0.5,1.0")],
)  # fmt: skip
def test_the_full_slice_equals_the_dense_model(name, kind, ratios):
    dense = _randomised(name)
    sliced = slice_model(copy.deepcopy(dense), ratios, kind=kind).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(sliced.forward_until(x, -1), dense(x))
        logits = sliced.forward_all(x)
    assert logits.shape == (sliced.num_steps, 2, 10) and torch.isfinite(logits).all()


def test_narrower_slices_run_fewer_flops_and_read_fewer_weights():
    sliced = slice_model(create_model("resnet20"), "0.25,0.5,0.75,1.0")
    flops = [e.flops for e in sliced.exit_info]
    params = [e.params for e in sliced.exit_info]
    assert flops == sorted(flops) and params == sorted(params) and flops[-1] == sliced.backbone_flops
    # Convolutions cost (width)^2: half the width is about a quarter of the FLOPs, not a masked full pass.
    assert 0.2 < flops[1] / flops[-1] < 0.3 and flops[0] / flops[-1] < 0.08
    assert [e.cost_flops for e in sliced.exit_info] == [sum(flops[: k + 1]) for k in range(4)]
    shapes = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, inp, out: shapes.append(out.shape[1]) if isinstance(m, nn.Conv2d) else None
    )
    try:
        with torch.no_grad():
            sliced.eval().forward_until(torch.randn(1, 3, 32, 32), 1)
    finally:
        hook.remove()
    assert max(shapes) == 32  # ResNet-20's widest layer (64) at half width


def test_cardinality_slices_run_the_first_groups_only():
    sliced = slice_model(create_model("resnext29_8x16d"), "0.25,0.5,1.0", kind="cardinality")
    assert [e.name for e in sliced.exit_info] == ["2g", "4g", "8g"]
    flops = [e.flops for e in sliced.exit_info]
    assert flops[0] < flops[1] < flops[2]
    grouped = [m for m in sliced.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    seen = []
    handles = [
        m.register_forward_hook(lambda m, inp, out: seen.append((inp[0].shape[1], out.shape[1]))) for m in grouped
    ]
    with torch.no_grad():
        sliced.eval().forward_until(torch.randn(1, 3, 32, 32), 0)
    for h in handles:
        h.remove()
    # 2 of 8 groups of 16 (then 32, 64) channels in, as many out: a quarter of each grouped layer.
    assert {s for s in seen} == {(32, 32), (64, 64), (128, 128)}


def test_slicing_refuses_what_it_cannot_slice():
    with pytest.raises(AnytimeError, match="cardinality"):
        slice_model(create_model("resnext29_2x64d"), "0.5,1.0", kind="width")
    with pytest.raises(AnytimeError, match="whole number of the 8 groups"):
        slice_model(create_model("resnext29_8x16d"), "0.3,1.0", kind="cardinality")
    with pytest.raises(AnytimeError, match="needs a ResNeXt"):
        slice_model(create_model("resnet20"), "0.5,1.0", kind="cardinality")
    with pytest.raises(AnytimeError, match="linear layers"):
        slice_model(create_model("lenet", in_channels=1), "0.5,1.0")
    with pytest.raises(AnytimeError, match="concatenated"):
        slice_model(create_model("tv:densenet121", num_classes=10), "0.5,1.0")
    for bad in ("0,1", "0.5,1.5", "a,b", "", "0.5,0.5", "1.0"):
        with pytest.raises(AnytimeError):
            slice_model(create_model("resnet20"), bad)
    sliced = slice_model(create_model("resnet20"), "0.5,1.0")
    with pytest.raises(AnytimeError, match="steps 0..1"):
        sliced.forward_until(torch.randn(1, 3, 32, 32), 2)


def test_an_untrained_width_gets_its_own_recomputed_statistics():
    sliced = slice_model(_randomised("resnet20"), "0.5,1.0").eval()
    with pytest.raises(AnytimeError, match="was not trained .* add_step"):
        sliced.step_for(0.75)
    before = copy.deepcopy(sliced.state_dict())
    with pytest.raises(AnytimeError, match="no batches"):
        sliced.add_step(0.75, [])
    assert sliced.ratios == (0.5, 1.0) and all(torch.equal(before[k], v) for k, v in sliced.state_dict().items())
    with pytest.raises(AnytimeError, match="narrower than the widest"):
        sliced.add_step(1.0 + 1e-3, [torch.randn(2, 3, 32, 32)])
    with pytest.raises(AnytimeError, match="3 input channels got 5"):
        sliced.add_step(0.75, [torch.randn(2, 5, 32, 32)])
    assert sliced.ratios == (0.5, 1.0) and all(torch.equal(before[k], v) for k, v in sliced.state_dict().items())
    torch.manual_seed(1)
    batches = [torch.randn(16, 3, 32, 32) * 2 + 1 for _ in range(4)]
    k = sliced.add_step(0.75, batches)
    assert k == 1 == sliced.step_for(0.75) and sliced.ratios == (0.5, 0.75, 1.0) and sliced.num_steps == 3
    norm = sliced.backbone.stem[1].norms[1]
    assert norm.num_features == 12 and norm.momentum == 0.1
    # The statistics are this width's own: those of its stem activations over the batches given.
    with torch.no_grad():
        stem_conv = sliced.backbone.stem[0]
        sliced._context.ratio = 0.75
        acts = torch.cat([stem_conv(b) for b in batches])
    assert torch.allclose(norm.running_mean, acts.mean(dim=(0, 2, 3)), atol=1e-4)
    assert [e.name for e in sliced.exit_info] == ["x0.5", "x0.75", "x1"]
    with torch.no_grad():  # the trained widths are untouched
        assert torch.equal(
            sliced.backbone.stem[1].norms[2].running_mean, before["backbone.stem.1.norms.1.running_mean"]
        )


def test_the_sandwich_rule_trains_the_ends_and_one_other():
    sliced = slice_model(create_model("resnet20"), "0.25,0.5,0.75,1.0", sandwich=True)
    torch.manual_seed(0)
    picks = [sliced.training_steps() for _ in range(40)]
    assert all(p[0] == 0 and p[-1] == 3 and len(p) == 3 for p in picks)
    assert {p[1] for p in picks} == {1, 2}
    assert slice_model(create_model("resnet20"), "0.5,1.0", sandwich=True).training_steps() == [0, 1]


def test_a_sliced_run_trains_and_goes_through_the_pipeline(tmp_path, capsys):
    from anytime.scheduler.runs import runner_for_run
    from anytime.tasks.collect import collect_run
    from anytime.tasks.profiling import ProfileSettings, profile_run
    from anytime.tasks.sweep import sweep_run

    config = TrainConfig(model="resnet20", data="digits", epochs=1, batch_size=64, lr=0.05, limit_train=300,
                         slices="0.25,0.5,1.0", sandwich=True, distill=1.0, device="cpu")  # fmt: skip
    run = tmp_path / "sliced"
    summary = Trainer(config, run).fit()
    assert [e.name for e in summary.steps] == ["x0.25", "x0.5", "x1"]
    assert all(0 <= e["val_acc"] <= 1 and e["params"] > 0 for e in summary.record["exits"])
    header = (run / "metrics.csv").read_text().splitlines()[0]
    assert "val_acc_exit0" in header and "val_acc_exit2" in header
    cache = collect_run(run, "val")
    assert cache.num_steps == 3 and cache.step_names == ("x0.25", "x0.5", "x1")
    sweep_run(run, ["entropy"], settings=20)
    profile, _ = profile_run(run, ProfileSettings(batch_sizes=(1,), repeats=10, warmup=1, memory=False))
    assert not profile.incremental and profile.num_steps == 3
    runner, _ = runner_for_run(run, quantile=0.9)
    answer = runner.predict(torch.randn(1, 1, 8, 8), 1e4)
    assert answer.reason == "chosen"
    assert main(["schedule", str(run), "--deadline-ms", "1000", "--quantile", "0.9"]) == 0
    assert json.loads(capsys.readouterr().out)["option"] == profile.step_names[int(answer.step)]


def test_slicing_options_are_checked(cli_error):
    with pytest.raises(AnytimeError, match="--sandwich"):
        TrainConfig(sandwich=True)
    with pytest.raises(AnytimeError, match="choose one family"):
        TrainConfig(exits="auto", slices="0.5,1")
    with pytest.raises(AnytimeError, match="stochastic-depth"):
        TrainConfig(stochastic_depth=1.0)
    cli_error(["train", "--model", "resnet20", "--slices", "0.5,2", "--epochs", "1"], "(0, 1]")
