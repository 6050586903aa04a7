"""Input resolution as a knob: parsing the steps, batch-norm statistics per resolution, the ladder through the
pipeline (train, collect, profile, schedule) and its refusals."""

from __future__ import annotations

import json

import pytest
import torch

from anytime.backbones.registry import create_model
from anytime.cli import main
from anytime.errors import AnytimeError
from anytime.families.resolution import Resolution, ResolutionBatchNorm, ResolutionLadder, parse_resolutions
from anytime.train import TrainConfig, Trainer


def test_resolutions_parse_and_refuse():
    steps = parse_resolutions("16, 24,c24,32", (32, 32))
    assert steps == (Resolution(16), Resolution(24), Resolution(24, crop=True), Resolution(32))
    assert [s.label for s in steps] == ["16px", "24px", "crop24", "32px"]
    for bad, words in (("16", "at least two"), ("16,16", "at least two"), ("16,x", "cN crops"), ("16,48", "from 4 to 32"),
                       ("2,32", "from 4 to 32")):  # fmt: skip
        with pytest.raises(AnytimeError, match=words):
            parse_resolutions(bad, (32, 32))


def test_a_resize_and_a_crop_see_what_they_should():
    x = torch.arange(64.0).reshape(1, 1, 8, 8)
    assert torch.equal(Resolution(4, crop=True).apply(x), x[..., 2:6, 2:6])
    assert Resolution(4).apply(x).shape == (1, 1, 4, 4) and torch.equal(Resolution(8).apply(x), x)


def test_every_resolution_keeps_its_own_batch_norm_statistics():
    ladder = ResolutionLadder(
        create_model("resnet20"), parse_resolutions("16,24,32", (32, 32)), input_shape=(3, 32, 32)
    )
    norms = [m for m in ladder.modules() if isinstance(m, ResolutionBatchNorm)]
    assert norms and all(len(n.norms) == 3 for n in norms)
    assert [e.name for e in ladder.exit_info] == ["16px", "24px", "32px"]
    flops = [e.flops for e in ladder.exit_info]
    assert flops == sorted(flops) and flops[0] < 0.3 * flops[-1]
    ladder.train()
    ladder.forward_until(torch.randn(4, 3, 32, 32) + 5.0, 1)  # only step 1's statistics see this batch
    first = norms[0].norms
    assert first[1].num_batches_tracked == 1 and first[0].num_batches_tracked == 0 == first[2].num_batches_tracked
    assert ladder.step == 2  # the bare backbone computes the full resolution afterwards
    ladder.eval()
    assert ladder.forward_all(torch.randn(2, 3, 32, 32)).shape == (3, 2, 10)


def test_ladders_that_cannot_work_are_refused():
    with pytest.raises(AnytimeError, match="no batch norm"):
        ResolutionLadder(
            create_model("lenet", in_channels=1), parse_resolutions("16,28", (28, 28)), input_shape=(1, 28, 28)
        )
    with pytest.raises(AnytimeError, match="cheapest first"):
        ResolutionLadder(create_model("resnet20"), parse_resolutions("32,16", (32, 32)), input_shape=(3, 32, 32))
    with pytest.raises(AnytimeError, match="a family of its own"):
        TrainConfig(model="resnet20", resolutions="16,32", exits="auto")


def test_a_resolution_ladder_goes_through_the_pipeline(tmp_path, capsys):
    from anytime.tasks.collect import collect_run
    from anytime.tasks.profiling import ProfileSettings, profile_run

    run = tmp_path / "ladder"
    config = TrainConfig(model="resnet20", data="digits", epochs=2, batch_size=64, lr=0.05, limit_train=400,
                         resolutions="16,c24,32")  # fmt: skip
    summary = Trainer(config, run).fit()
    assert [e.name for e in summary.steps] == ["16px", "crop24", "32px"]
    assert all(0 <= e.test_acc <= 1 for e in summary.steps)
    cache = collect_run(run, "val")
    assert cache.num_steps == 3
    profile, _ = profile_run(run, ProfileSettings(batch_sizes=(1,), repeats=20, warmup=2, memory=False))
    assert profile.step_names == ("16px", "crop24", "32px") and not profile.incremental
    assert main(["schedule", str(run), "--deadline-ms", "1e6", "--quantile", "0.9"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["fits"] and answer["option"] in {"16px", "crop24", "32px"}
