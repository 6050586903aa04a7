"""Model cards: a declarative training recipe in TOML, with the results measured with it.

A card has the tables ``[card]`` (name, description), ``[model]`` (``name``), ``[data]`` (``name``,
optional ``root``, ``image_size``, ``val_fraction``, ``limit_train``; for text ``vocab_size`` and ``max_length``),
``[train]`` (the rest of :class:`TrainConfig`) and ``[results]`` (what a run of the card measured: accuracy, time, device,
date). ``[results]`` is the card's last table so that :func:`record_results` can rewrite it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anytime.errors import AnytimeError
from anytime.train.config import TrainConfig
from anytime.utils.io import read_toml, write_text

_TABLES = ("card", "model", "data", "train", "results")
_RESULTS_HEADER = re.compile(r"^\s*\[results\]\s*(#.*)?$")
_DATA_KEYS = {"name": "data", "root": "data_root", "image_size": "image_size", "val_fraction": "val_fraction",
              "limit_train": "limit_train", "vocab_size": "vocab_size", "max_length": "max_length"}  # fmt: skip


@dataclass(frozen=True)
class ModelCard:
    """A parsed card: its recipe as a :class:`TrainConfig` and the results recorded so far."""

    path: Path
    name: str
    description: str
    config: TrainConfig
    results: dict[str, Any]


def _card_folders() -> list[Path]:
    """Where the shipped cards are: ``models/`` of a source checkout, then the installed package's copy."""
    root = Path(__file__).resolve().parents[2]
    folders = [root / "models"] if (root / "setup.cfg").is_file() else []
    try:  # the cards are data, not code: a namespace package, found by its search locations
        spec = importlib.util.find_spec("anytime.cards")
    except ImportError:
        spec = None
    if spec is not None and spec.submodule_search_locations is not None:
        folders += [Path(location) for location in spec.submodule_search_locations]
    return [f for f in folders if f.is_dir()]


def card_names() -> list[str]:
    """The names of the cards shipped with the package (``anytime train --card NAME``)."""
    return sorted({p.stem for folder in _card_folders() for p in folder.glob("*.toml")})


def find_card(name_or_path: str | os.PathLike[str]) -> Path:
    """A card file: a path to one, or the name of a shipped card (``cifar10-resnet20``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.suffix == "" and len(path.parts) == 1:
        for folder in _card_folders():
            if (folder / f"{path.name}.toml").is_file():
                return folder / f"{path.name}.toml"
    names = card_names()
    shipped = f"; shipped cards: {', '.join(names)}" if names else ""
    raise AnytimeError(
        f"no model card at {path}: give a card file (models/NAME.toml) or a shipped card's name{shipped}"
    )


def is_shipped(path: Path) -> bool:
    """Whether ``path`` is the installed package's own copy of a card (not a file of the user's or a checkout's)."""
    return any(folder.name == "cards" and path.resolve().parent == folder.resolve() for folder in _card_folders())


def load_card(path: str | os.PathLike[str]) -> ModelCard:
    """Read and validate a card (a file, or a shipped card's name); every problem is a one-line
    :class:`AnytimeError`."""
    card_path = find_card(path)
    raw = read_toml(card_path)
    unknown = sorted(set(raw) - set(_TABLES))
    if unknown:
        raise AnytimeError(f"{card_path}: unknown table(s) {', '.join(unknown)}; a card has {', '.join(_TABLES)}")
    not_tables = sorted(key for key in _TABLES if key in raw and not isinstance(raw[key], dict))
    if not_tables:
        raise AnytimeError(f'{card_path}: {", ".join(not_tables)} must be [tables], e.g. [model] then name = "lenet"')
    model = raw.get("model", {})
    data = raw.get("data", {})
    if "name" not in model or "name" not in data:
        raise AnytimeError(f"{card_path}: a card needs [model] name and [data] name")
    values: dict[str, Any] = {"model": model["name"]}
    extra_model = sorted(set(model) - {"name"})
    if extra_model:
        raise AnytimeError(f"{card_path}: [model] takes only 'name' for now (got {', '.join(extra_model)})")
    for key, value in data.items():
        if key not in _DATA_KEYS:
            raise AnytimeError(f"{card_path}: unknown [data] key '{key}'; valid: {', '.join(_DATA_KEYS)}")
        values[_DATA_KEYS[key]] = value
    misplaced = sorted({"model", *_DATA_KEYS.values()} & set(raw.get("train", {})))
    if misplaced:
        raise AnytimeError(f"{card_path}: {', '.join(misplaced)} belong in [model] / [data], not [train]")
    values.update(raw.get("train", {}))
    config = TrainConfig.from_dict(values, where=str(card_path))
    meta = raw.get("card", {})
    return ModelCard(
        path=card_path,
        name=str(meta.get("name", card_path.stem)),
        description=str(meta.get("description", "")),
        config=config,
        results=dict(raw.get("results", {})),
    )


def check_recordable(card: ModelCard) -> None:
    """Refuse to record results into the installed package's own copy of a card."""
    if is_shipped(card.path):
        raise AnytimeError(f"{card.path} is the installed package's copy of the card; copy it (cp {card.path} "
                           f"{card.path.name}) and train with --card {card.path.name} --update-card")  # fmt: skip


def record_results(card: ModelCard, results: dict[str, Any]) -> Path:
    """Rewrite the card's ``[results]`` table with ``results`` (atomically), keeping the rest verbatim."""
    check_recordable(card)
    text = card.path.read_text(encoding="utf-8")
    lines = text.splitlines()
    cut = next((i for i, line in enumerate(lines) if _RESULTS_HEADER.match(line)), None)
    if cut is not None and any(line.strip().startswith("[") for line in lines[cut + 1 :]):
        raise AnytimeError(f"{card.path}: [results] must be the last table for results to be recorded")
    head = lines if cut is None else lines[:cut]
    while head and not head[-1].strip():
        head.pop()
    body = ["[results]", *(f"{key} = {_toml_value(key, value)}" for key, value in results.items())]
    return write_text(card.path.resolve(), "\n".join([*head, "", *body]) + "\n")  # through a link, the link kept


def _toml_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise AnytimeError(f"result '{key}' is {value}; cards record finite numbers only")
        return repr(round(value, 6))
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    raise AnytimeError(f"result '{key}' has type {type(value).__name__}; cards record numbers, text and booleans")
