"""Lottery tickets: magnitude masks, rewinding to a kept checkpoint, masked training, iterative rounds."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from anytime.cli import main
from anytime.errors import AnytimeError
from anytime.train import TrainConfig, Trainer, load_checkpoint
from anytime.train.pruning import MASK_FILE, Mask, kept_checkpoint, magnitude_mask, round_sparsities

DENSE = TrainConfig(model="lenet", data="digits", epochs=3, batch_size=64, lr=0.05, keep_checkpoints=(0, 1))


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("dense") / "run"
    Trainer(DENSE, run).fit()
    return run


def _ticket(dense_run, **changes):
    return DENSE.replace(keep_checkpoints=(), prune_from=str(dense_run), **changes)


def test_global_mask_keeps_the_largest_weights_over_all_layers():
    weights = {"a.weight": torch.tensor([[0.1, -3.0], [2.0, 0.2]]), "b.weight": torch.tensor([[-0.5, 4.0, 0.05]])}
    mask = magnitude_mask(weights, ["a.weight", "b.weight"], 4 / 7)
    assert mask.keep["a.weight"].tolist() == [[False, True], [True, False]]
    assert mask.keep["b.weight"].tolist() == [[False, True, False]]
    assert mask.sparsity == pytest.approx(4 / 7)
    layer = magnitude_mask(weights, ["a.weight", "b.weight"], 0.5, scope="layer")
    assert layer.layer_sparsity()["a.weight"] == pytest.approx(0.5)


def test_a_later_round_prunes_only_among_the_survivors():
    weights = {"w.weight": torch.arange(1.0, 11.0).reshape(2, 5)}
    first = Mask({"w.weight": torch.tensor([[True] * 5, [False] * 5])})  # the largest five were pruned before
    second = magnitude_mask(weights, ["w.weight"], 0.7, previous=first)
    assert second.keep["w.weight"].tolist() == [[False, False, True, True, True], [False] * 5]
    with pytest.raises(AnytimeError, match="below the 0.5"):
        magnitude_mask(weights, ["w.weight"], 0.3, previous=first)
    with pytest.raises(AnytimeError, match="unknown pruning scope"):
        magnitude_mask(weights, ["w.weight"], 0.3, scope="channel")


def test_rounds_prune_the_same_share_of_what_is_left():
    steps = round_sparsities(0.936, 3)
    assert steps[-1] == pytest.approx(0.936)
    kept = [1.0] + [1 - s for s in steps]
    assert [kept[i + 1] / kept[i] for i in range(3)] == pytest.approx([0.4] * 3)


def test_a_ticket_is_rewound_masked_and_trained_with_its_zeros_kept(dense_run, tmp_path):
    assert {p.name for p in dense_run.glob("checkpoint-epoch*.pt")} == {"checkpoint-epoch0.pt", "checkpoint-epoch1.pt"}
    assert load_checkpoint(kept_checkpoint(dense_run, 0))["epoch"] == -1
    summary = Trainer(_ticket(dense_run, sparsity=0.8, reset_epoch=1), tmp_path / "t").fit()
    mask = Mask.load(tmp_path / "t" / MASK_FILE)
    assert mask.sparsity == pytest.approx(0.8, abs=1e-4)
    weights = load_file(str(tmp_path / "t" / "model.safetensors"))
    for name, keep in mask.keep.items():
        assert torch.all(weights[name][~keep] == 0), name
        assert torch.count_nonzero(weights[name][keep]) > 0.9 * int(keep.sum())
    assert summary.epochs == 2 and summary.record["ticket"]["reset_epoch"] == 1
    assert summary.record["ticket"]["dense_run"] == str(dense_run)
    with open(tmp_path / "t" / "metrics.csv") as handle:
        assert [line.split(",")[0] for line in handle.read().splitlines()[1:]] == ["1", "2"]


def test_an_interrupted_ticket_resumes_exactly(dense_run, resumes_exactly):
    resumes_exactly(_ticket(dense_run, sparsity=0.6, reset_epoch=0))


def test_ticket_refusals_say_what_to_do(dense_run, tmp_path):
    with pytest.raises(AnytimeError, match="kept no checkpoint after epoch 2: train it with --keep-checkpoints 2"):
        Trainer(_ticket(dense_run, sparsity=0.5, reset_epoch=2), tmp_path / "a").fit()
    with pytest.raises(AnytimeError, match=r"recipe of its dense run .* lr=0.1 \(dense run has 0.05\)"):
        Trainer(_ticket(dense_run, sparsity=0.5, lr=0.1), tmp_path / "b").fit()
    with pytest.raises(AnytimeError, match="not a finished run"):
        Trainer(_ticket(tmp_path / "nowhere", sparsity=0.5), tmp_path / "c").fit()
    with pytest.raises(AnytimeError, match="give the run to prune with --prune-from"):
        TrainConfig(sparsity=0.5)
    with pytest.raises(AnytimeError, match="--reset-epoch must be in 0..2"):
        _ticket(dense_run, reset_epoch=3)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_ticket_command_prunes_in_rounds_and_skips_finished_ones(dense_run, tmp_path, capsys):
    out = tmp_path / "tickets"
    argv = ["ticket", str(dense_run), "--sparsity", "0.9", "--rounds", "2", "--reset-epoch", "1", "--out", str(out)]
    assert main(argv) == 0
    first, second = (Mask.load(out / f"round-{r}" / MASK_FILE) for r in (1, 2))
    assert first.sparsity == pytest.approx(1 - 0.1**0.5, abs=1e-3) and second.sparsity == pytest.approx(0.9, abs=1e-3)
    assert all(torch.all(first.keep[n] | ~second.keep[n]) for n in first.keep)  # pruned once, pruned for good
    config = json.loads((out / "round-2" / "config.json").read_text())["train"]
    assert config["prune_from"] == str(out / "round-1")
    capsys.readouterr()
    assert main(argv) == 0
    assert capsys.readouterr().out.count("finished, test") == 2
    assert main(["ticket", str(out / "round-1"), "--sparsity", "0.95", "--out", str(tmp_path / "x")]) == 2
