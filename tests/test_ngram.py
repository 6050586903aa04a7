"""The small-data text network: a TF-IDF n-gram bag fit in closed form under an encoder with exits."""

from __future__ import annotations

import json

import numpy as np
import torch
from test_text import _sentences, _write

from anytime.backbones import create_model
from anytime.backbones.ngram import BagHead, NgramBag, bucket_count
from anytime.families import attach_exits


def _ids(rows: int, length: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids whose label is which of two marker tokens (3 or 4) they hold, padded with 0 at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (rows, length), generator=g)
    labels = torch.arange(rows) % 2
    ids[torch.arange(rows), torch.randint(1, length, (rows,), generator=g)] = 3 + labels
    ids[:, 0] = 2
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    ids[torch.arange(length).unsqueeze(0) >= lengths.unsqueeze(1)] = 0
    ids[torch.arange(rows), torch.randint(1, length // 2, (rows,), generator=g)] = 3 + labels
    return ids, labels


def test_the_bag_is_a_tf_idf_linear_model_fit_in_closed_form():
    ids, labels = _ids(400, 12, 60, 0)
    bag = NgramBag(60, 2, bucket_count(2))
    assert not bag(ids).any()  # unfitted: no opinion
    bag.init_from_text(ids, labels)
    test, truth = _ids(200, 12, 60, 1)
    assert (bag(test).argmax(1) == truth).float().mean() > 0.95
    assert float(bag.l2) > 0
    w = bag.weights(bag.grams(test), bag.idf)
    grams = bag.grams(test)
    for row in range(5):  # each row's TF-IDF vector (the positions' shares summed per gram) has unit length
        vector = torch.zeros(bag.idf.numel()).index_add_(0, grams[row], w[row])
        assert torch.isclose(vector[1:].norm(), torch.tensor(1.0), atol=1e-5)
    assert bag.idf[3] < bag.idf[10]  # a marker in every other row is less informative than a rare token by IDF


def test_buckets_fit_the_budget_and_are_prime():
    for classes in (2, 6, 100, 5000):
        n = bucket_count(classes)
        assert all(n % d for d in range(2, int(n**0.5) + 1))
        assert n * classes <= 4_000_000 or n == 1009


def test_every_exit_starts_as_the_bag_and_the_first_costs_almost_nothing():
    torch.manual_seed(0)
    model = attach_exits(create_model("ngram_encoder", num_classes=2, vocab_size=60, max_length=12), "auto").eval()
    ids, labels = _ids(200, 12, 60, 0)
    model.backbone.stem.bag.init_from_text(ids, labels)
    assert model.num_steps == 5 and all(isinstance(h, BagHead) for h in model.heads)
    with torch.no_grad():
        bag = model.backbone.stem.bag(ids)
        outputs = model(ids)
    for k in range(model.num_steps):
        assert torch.allclose(outputs[k], bag, atol=1e-5)  # corrections start at zero
    flops = [e.flops for e in model.exit_info]
    assert flops[0] < 0.05 * flops[-1]


def test_a_text_folder_without_a_model_trains_the_small_data_recipe(tmp_path, capsys):
    from anytime.cli import main

    root = tmp_path / "data"
    root.mkdir()
    _write(root / "train.tsv", _sentences(300, 0))
    _write(root / "test.tsv", _sentences(80, 2))
    out = tmp_path / "run"
    assert main(["train", "--data", "textfolder", "--data-root", str(root), "--epochs", "1", "--vocab-size", "200",
                 "--max-length", "16", "--out", str(out), "--no-progress"]) == 0  # fmt: skip
    assert "text-ngram-exits" in capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())["train"]
    assert config["model"] == "ngram_encoder" and config["exits"] == "auto"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exits"][0]["test_acc"] > 0.9  # the bag alone tells the marker words apart
    assert np.isfinite(summary["baseline"]["test_acc"])


def test_a_correction_that_hurts_on_validation_is_weighed_out():
    torch.manual_seed(0)
    model = attach_exits(create_model("ngram_encoder", num_classes=2, vocab_size=60, max_length=12), "auto").eval()
    ids, labels = _ids(300, 12, 60, 0)
    backbone = model.backbone
    backbone.stem.bag.init_from_text(ids, labels)
    heads = [*model.heads, backbone.head]
    for head in heads[1:]:
        torch.nn.init.normal_(head.correction.weight, std=50.0)  # noise far louder than the bag
    val, truth = _ids(200, 12, 60, 1)
    backbone.fit_to_validation(model, val, truth)
    assert [float(h.mix) for h in heads[1:]] == [0.0] * 4
    with torch.no_grad():
        outputs, bag = model(val), backbone.stem.bag(val)
    for k in range(model.num_steps):
        assert torch.allclose(outputs[k], bag, atol=1e-5)
    for head in heads[1:]:  # a correction of zero changes no answer: every weight ties
        torch.nn.init.zeros_(head.correction.weight)
    backbone.fit_to_validation(model, val, truth)
    assert [float(h.mix) for h in heads[1:]] == [0.0] * 4  # no gain: the smaller weight on a tie


def test_a_correction_is_kept_only_when_it_helps_beyond_chance():
    from anytime.backbones.ngram import _helpful_mix

    truth = torch.zeros(400, dtype=torch.long)
    bag = torch.tensor([[1.0, 0.0]]).repeat(400, 1)
    bag[:100] = torch.tensor([0.0, 1.0])  # the bag gets the first 100 wrong
    correction = torch.zeros(400, 2)
    correction[:100] = torch.tensor([4.0, 0.0])  # fixes all 100 at any weight
    assert _helpful_mix(bag, correction, truth) == 0.25  # the smallest weight with the largest gain
    marginal = torch.zeros(400, 2)
    marginal[:3] = torch.tensor([4.0, 0.0])  # fixes 3 ...
    marginal[300] = torch.tensor([0.0, 4.0])  # ... and breaks 1: a gain of 2 against a spread of 2 x sqrt(4)
    assert _helpful_mix(bag, marginal, truth) == 0.0
