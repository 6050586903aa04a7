"""Structured lottery tickets: channel plans from Torch-Pruning's dependency graph, the cut network, ticket runs
that are really smaller, and their place beside the dense run in one scheduler frontier."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from anytime.backbones.registry import create_model
from anytime.cli import main
from anytime.errors import AnytimeError
from anytime.families import attach_exits
from anytime.train import TrainConfig, Trainer
from anytime.train.channels import CHANNELS_FILE, ChannelPlan, plan_channels, run_channel_plan, shrink

DENSE = TrainConfig(model="resnet8", data="digits", epochs=3, batch_size=64, lr=0.05, exits="auto",
                    keep_checkpoints=(0, 1))  # fmt: skip


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _without_pruned_inputs(model: nn.Module, plan: ChannelPlan) -> nn.Module:
    """The dense model with every pruned channel's outgoing weights zeroed: what the cut network must compute."""
    ref = copy.deepcopy(model)
    modules = dict(ref.named_modules())
    with torch.no_grad():
        for name, (_, keep_in) in plan.keep.items():
            module = modules[name]
            if keep_in is None or (isinstance(module, nn.Conv2d) and module.groups > 1):
                continue
            gone = torch.ones(module.weight.shape[1], dtype=torch.bool)
            gone[list(keep_in)] = False
            module.weight[:, gone] = 0
    return ref


@pytest.mark.parametrize("name,exits,shape", [
    ("resnet20", "auto", (3, 32, 32)), ("vgg11", None, (3, 32, 32)), ("mobilenetv2", None, (3, 32, 32)),
])  # fmt: skip
def test_the_cut_network_computes_what_the_dense_one_does_without_the_pruned_channels(name, exits, shape):
    torch.manual_seed(0)
    model = create_model(name, in_channels=shape[0])
    model = (attach_exits(model, exits) if exits else model).eval()
    plan = plan_channels(model, shape, 0.5, num_classes=10)
    assert plan.sparsity == pytest.approx(0.5, abs=0.02)
    small = shrink(copy.deepcopy(model), plan)
    assert _params(small) < 0.75 * _params(model)
    x = torch.randn(3, *shape)
    with torch.no_grad():
        assert torch.allclose(small(x), _without_pruned_inputs(model, plan)(x), atol=1e-5)


def test_residual_streams_and_classifiers_stay_whole():
    model = attach_exits(create_model("resnet20"), "auto").eval()
    plan = plan_channels(model, (3, 32, 32), 0.7, num_classes=10)
    # Only every block's inner channels: its first convolution's outputs, their batch norm, the second's inputs.
    assert set(plan.groups) == {f"backbone.stages.{s}.{b}.branch.0.0" for s in range(3) for b in range(3)}
    assert not any(name.startswith(("heads", "backbone.stem", "backbone.head")) for name in plan.keep)
    layer = plan_channels(model, (3, 32, 32), 0.5, scope="layer", num_classes=10)
    assert all(len(layer.keep[root][0]) == count // 2 for root, count in layer.groups.items())


def test_a_second_round_prunes_among_the_survivors_and_counts_from_the_dense_network():
    model = attach_exits(create_model("resnet20"), "auto").eval()
    first = plan_channels(model, (3, 32, 32), 0.5, num_classes=10)
    smaller = shrink(copy.deepcopy(model), first)
    second = plan_channels(smaller, (3, 32, 32), 0.75, num_classes=10, previous=first)
    assert second.sparsity == pytest.approx(0.75, abs=0.02)
    for module, (out_keep, _) in second.keep.items():
        if out_keep is not None and first.keep[module][0] is not None:
            assert set(out_keep) <= set(first.keep[module][0]), module
    with pytest.raises(AnytimeError, match="must be in"):
        plan_channels(smaller, (3, 32, 32), 0.3, num_classes=10, previous=first)
    assert ChannelPlan.from_dict(json.loads(json.dumps(second.to_dict())), "x") == second


def test_bad_plans_are_refused(tmp_path):
    with pytest.raises(AnytimeError, match="not a readable channel plan"):
        ChannelPlan.from_dict(
            {"format": "anytime-channels-v1", "keep": {"a": {"out": [1, 1], "in": None}}, "groups": {}}, "p"
        )
    plan = ChannelPlan({"nowhere.conv": ((0,), None)}, {"nowhere.conv": 4})
    with pytest.raises(AnytimeError, match="another architecture"):
        shrink(create_model("lenet"), plan)
    (tmp_path / CHANNELS_FILE).write_text("{not json")
    with pytest.raises(AnytimeError):
        run_channel_plan(tmp_path)


@pytest.fixture(scope="module")
def dense_and_ticket(tmp_path_factory):
    root = tmp_path_factory.mktemp("channels")
    dense = root / "dense"
    Trainer(DENSE, dense).fit()
    ticket = root / "ticket"
    summary = Trainer(DENSE.replace(keep_checkpoints=(), prune_from=str(dense), sparsity=0.5, reset_epoch=1,
                                    prune_unit="channels"), ticket).fit()  # fmt: skip
    return dense, ticket, summary


def test_a_structured_ticket_is_a_smaller_run_that_loads_and_resumes(dense_and_ticket, resumes_exactly):
    from anytime.train.runs import load_run

    dense, ticket, summary = dense_and_ticket
    info = summary.record["ticket"]
    assert info["unit"] == "channels" and info["sparsity"] == pytest.approx(0.5, abs=0.02)
    assert info["parameters"] < 0.8 * info["dense_parameters"] and summary.epochs == 2
    loaded = load_run(ticket, "cpu")
    assert _params(loaded.model) == info["parameters"] and (ticket / CHANNELS_FILE).is_file()
    assert loaded.model(torch.randn(2, 1, 8, 8)).shape[-1] == 10

    resumes_exactly(DENSE.replace(keep_checkpoints=(), prune_from=str(dense), sparsity=0.5, reset_epoch=0,
                                  prune_unit="channels"))  # fmt: skip


def test_structured_ticket_refusals(dense_and_ticket, tmp_path):
    dense, _, _ = dense_and_ticket
    with pytest.raises(AnytimeError, match="--prune-unit channels makes a structured lottery ticket"):
        TrainConfig(prune_unit="channels")
    with pytest.raises(AnytimeError, match="unknown --prune-unit"):
        TrainConfig(prune_from=str(dense), prune_unit="filters")
    masked = tmp_path / "masked"
    Trainer(DENSE.replace(keep_checkpoints=(), prune_from=str(dense), sparsity=0.5), masked).fit()
    with pytest.raises(AnytimeError, match="ticket of masked weights"):
        Trainer(DENSE.replace(keep_checkpoints=(), prune_from=str(masked), sparsity=0.6, prune_unit="channels"),
                tmp_path / "x").fit()  # fmt: skip
    assert not (tmp_path / "x").exists()


def test_tickets_join_the_dense_run_in_one_frontier(dense_and_ticket, tmp_path, capsys):
    import shutil

    from anytime.tasks.profiling import ProfileSettings, profile_run

    dense, ticket, _ = dense_and_ticket
    unrelated = tmp_path / "unrelated"
    shutil.copytree(dense, unrelated)
    profile_run(
        dense,
        ProfileSettings(batch_sizes=(1,), repeats=20, warmup=2, memory=False),
        out=tmp_path / "dense-profile.json",
    )
    profile_run(ticket, ProfileSettings(batch_sizes=(1,), repeats=20, warmup=2, memory=False))
    assert main(["schedule", str(dense), "--profile", str(tmp_path / "dense-profile.json"), "--with", str(ticket),
                 "--deadline-ms", "1000", "--quantile", "0.9"]) == 0  # fmt: skip
    answer = json.loads(capsys.readouterr().out)
    variants = {point["option"].split(" ")[0] for point in answer["frontier"]} | {answer["variant"]}
    assert variants <= {"fp32", "channels-0.5"} and answer["precision"] == "fp32"
    assert main(["schedule", str(dense), "--profile", str(tmp_path / "dense-profile.json"), "--with", str(unrelated),
                 "--deadline-ms", "1000", "--quantile", "0.9"]) == 2  # fmt: skip
    assert "neither a converted form" in capsys.readouterr().err


def test_the_ticket_command_prunes_channels(dense_and_ticket, tmp_path):
    dense, _, _ = dense_and_ticket
    out = tmp_path / "t"
    assert main(["ticket", str(dense), "--sparsity", "0.6", "--unit", "channels", "--rounds", "2", "--reset-epoch", "1",
                 "--out", str(out)]) == 0  # fmt: skip
    first, second = (run_channel_plan(out / f"round-{r}") for r in (1, 2))
    assert first is not None and second is not None
    assert first.sparsity == pytest.approx(1 - 0.4**0.5, abs=0.03) and second.sparsity == pytest.approx(0.6, abs=0.03)
