"""Model cards: every shipped card is valid, bad cards are refused, results are recorded in place."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from anytime.backbones import list_models
from anytime.data import DATASETS
from anytime.errors import AnytimeError
from anytime.tasks.demo import DEMO_CONFIG
from anytime.train import load_card, record_results

CARDS = sorted((Path(__file__).resolve().parents[1] / "models").glob("*.toml"))


@pytest.mark.parametrize("path", CARDS, ids=[p.stem for p in CARDS])
def test_shipped_cards_are_valid(path):
    card = load_card(path)
    assert card.name == path.stem
    assert card.config.model in list_models(include_torchvision=False)
    assert card.config.data in DATASETS
    assert card.description


def test_the_demo_trains_its_card():
    assert (
        load_card(Path(__file__).resolve().parents[1] / "models" / "digits-resnet20-exits.toml").config == DEMO_CONFIG
    )


def _card(tmp_path, text):
    path = tmp_path / "card.toml"
    path.write_text(text)
    return path


def test_bad_cards_are_refused_in_one_line(tmp_path):
    cases = {
        "[model]\nname = 'lenet'\n[data]\nname = 'digits'\n[train]\nlearning_rate = 0.1\n": "unknown setting",
        "[model]\nname = 'lenet'\n": "needs",
        "[model\nname = 'lenet'": "not valid TOML",
        "[model]\nname = 'lenet'\n[data]\nname = 'digits'\n[optimizer]\n": "unknown table",
        "[model]\nname = 'lenet'\n[data]\nname = 'digits'\nsize = 3\n": "unknown \\[data\\] key",
        "[model]\nname = 'lenet'\n[data]\nname = 'digits'\n[train]\nepochs = 'ten'\n": "epochs must be int",
        "model = 'lenet'\n[data]\nname = 'digits'\n": "must be \\[tables\\]",
        "[model]\nname = 'lenet'\n[data]\nname = 'digits'\n[train]\nmodel = 'vgg11'\n": "belong in",
        "[model]\nname = 'lenet'\n[data]\nname = 'digits'\n[train]\nstep_milestones = ['a']\n": "fractions",
    }
    for text, message in cases.items():
        with pytest.raises(AnytimeError, match=message) as info:
            load_card(_card(tmp_path, text))
        assert "\n" not in str(info.value)
    with pytest.raises(AnytimeError, match="no model card"):
        load_card(tmp_path / "missing.toml")


def test_results_are_recorded_and_the_recipe_kept(tmp_path):
    path = tmp_path / "c.toml"
    shutil.copy(CARDS[0], path)
    card = load_card(path)
    path.write_text(path.read_text().replace("[results]", "[results]  # measured"))
    odd = 'cpu "x"\nline\ttab \\ ü'
    record_results(card, {"test_acc": 0.9712345678, "device": odd, "epochs": 3, "ok": True})
    again = load_card(path)
    assert again.config == card.config
    assert again.results == {"test_acc": 0.971235, "device": odd, "epochs": 3, "ok": True}
    assert path.read_text().count("[results]") == 1
    record_results(again, {"test_acc": 0.5})
    assert load_card(path).results == {"test_acc": 0.5}
    with pytest.raises(AnytimeError, match="finite"):
        record_results(again, {"test_acc": float("nan")})
    assert load_card(path).results == {"test_acc": 0.5}
