"""Loading a finished run: its recipe, its dataset's description and its trained model."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anytime.backbones.base import example_input
from anytime.contract import step_count
from anytime.errors import AnytimeError
from anytime.train.channels import run_channel_plan, shrink
from anytime.train.checkpoint import load_weights
from anytime.train.config import TrainConfig
from anytime.train.multi_exit import build_model
from anytime.train.records import (
    QUANT_STATE,
    WEIGHTS,
    baseline_record,
    ensemble_record,
    precision_record,
    read_record,
    run_weights_fingerprint,
    unfinished,
)  # fmt: skip
from anytime.utils.machine import resolve_device


@dataclass
class LoadedRun:
    """A trained run: ``model`` is in eval mode on ``device``; ``fingerprint`` names its weights."""

    run_dir: Path
    config: TrainConfig
    dataset: dict[str, Any]
    model: nn.Module
    fingerprint: str
    device: torch.device
    label: str | None = None
    form: str = "eager"

    @property
    def num_steps(self) -> int:
        """Steps of the model (1 for a plain classifier)."""
        return step_count(self.model)

    @property
    def name(self) -> str:
        """What the model is, for profiles and tables: the zoo name, or an ensemble's members."""
        return self.label or self.config.model


def dataset_input_shape(dataset: dict[str, Any]) -> tuple[int, ...]:
    """One sample's input shape from a run's recorded dataset: ``(C, H, W)``, or ``(T,)`` for text."""
    if dataset.get("modality") == "text":
        return (int(dataset["max_length"]),)
    size = dataset.get("image_size") or [32, 32]
    return int(dataset["in_channels"]), int(size[0]), int(size[1])


def require_images(run: LoadedRun, what: str) -> None:
    """Refuse a text run where only image runs are supported yet (``what``: the command, e.g. ``anytime quantize``)."""
    if run.dataset.get("modality") == "text":
        raise AnytimeError(f"{run.run_dir} is a text run; {what} supports image runs only so far (text runs take "
                           "train, quantize, ensemble, collect, sweep, calibrate, evaluate, profile, schedule and serve)")  # fmt: skip


def run_config(run_dir: str | Path) -> tuple[TrainConfig, dict[str, Any]]:
    """The recipe and dataset description recorded in a run's ``config.json``."""
    record = read_record(run_dir)
    return TrainConfig.from_dict(record["train"], where=str(Path(run_dir) / "config.json")), dict(record["dataset"])


def load_run(
    run_dir: str | Path, device: str | torch.device = "cpu", *, converted: bool = True, form: str = "eager"
) -> LoadedRun:
    """Rebuild a finished run's model from its recipe and load its final weights (``model.safetensors``); a
    converted run's model is converted to its precision unless ``converted=False`` (its float weights).
    ``form`` is the inference form it runs in (:class:`~anytime.deploy.inference.InferenceForm`: ``eager``, or e.g.
    ``fold+channels-last``), checked against the eager model on a probe batch."""
    loaded = _load_run(run_dir, device, converted)
    if form == "eager":
        return loaded
    from anytime.deploy.inference import InferenceForm, inference_form

    probe = example_input(
        dataset_input_shape(loaded.dataset),
        2,
        tokens=loaded.dataset.get("modality") == "text",
        generator=torch.Generator().manual_seed(0),
    )
    probe = probe.to(loaded.device)
    parsed = InferenceForm.parse(form)
    loaded.model = inference_form(loaded.model, parsed, probe=probe)
    loaded.form = parsed.name
    return loaded


def _load_run(run_dir: str | Path, device: str | torch.device, converted: bool) -> LoadedRun:
    run = Path(run_dir)
    config, dataset = run_config(run)
    weights = run / WEIGHTS
    if not weights.is_file():
        raise AnytimeError(unfinished(run))
    try:
        size = dataset.get("image_size") or [32, 32]
        shape = {"num_classes": int(dataset["num_classes"]), "in_channels": int(dataset["in_channels"]),
                 "image_size": (int(size[0]), int(size[1]))}  # fmt: skip
        text = (int(dataset["vocab_size"]), int(dataset["max_length"])) if dataset.get("modality") == "text" else None
    except (KeyError, TypeError, ValueError, IndexError):
        raise AnytimeError(f"{run / 'config.json'} does not describe its dataset; was it edited?") from None
    target = resolve_device(str(device))
    members = ensemble_record(run)
    if members is not None:
        if not converted:
            raise AnytimeError(f"{run} is an ensemble, which has no float form of its own; quantize or export its "
                               "members and build an ensemble of those")  # fmt: skip
        model, label = _ensemble(run, members, int(shape["num_classes"]), target)
        return LoadedRun(run, config, dataset, model.eval(), run_weights_fingerprint(run), target, label)
    baseline = baseline_record(run)
    if baseline is not None:
        if not converted:
            raise AnytimeError(f"{run} is a torchensemble baseline, which has no single float model to convert or "
                               "export; quantize or export a run of one member")  # fmt: skip
        model = _baseline(config, baseline, int(shape["num_classes"]), int(shape["in_channels"]))
        load_weights(model, weights)
        label = f"{baseline.get('method')}({len(model.members)} x {config.model})"
        return LoadedRun(run, config, dataset, model.to(target).eval(), run_weights_fingerprint(run), target, label)
    model = build_model(config, load_init=False, text=text, hf_config=read_record(run).get("hf_config"), **shape)  # type: ignore[arg-type]
    plan = run_channel_plan(run)
    if plan is not None:  # a structured ticket: the dense network cut to its channels
        shrink(model, plan)
    load_weights(model, weights)
    record = precision_record(run)
    if record is not None and converted:
        model = _converted(run, model.eval(), record, dataset_input_shape(dataset), target)
    return LoadedRun(run, config, dataset, model.to(target).eval(), run_weights_fingerprint(run), target)


def _recorded_flops(run: Path) -> list[int] | None:
    """The FLOPs per step counted when the run was converted (``summary.json``), so a load does not count again."""
    try:
        flops = json.loads((run / "summary.json").read_text())["step_flops"]
        return [int(f) for f in flops] if all(isinstance(f, int) and f >= 0 for f in flops) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _converted(
    run: Path, model: nn.Module, record: dict[str, Any], shape: tuple[int, ...], device: torch.device
) -> nn.Module:
    from anytime.precision import Int8Recipe, PrecisionSpec, convert

    spec = PrecisionSpec.from_dict(record, where=str(run / "config.json"))
    state = None
    if spec.precision == "int8":
        from anytime.train.checkpoint import read_weights

        if not (run / QUANT_STATE).is_file():
            raise AnytimeError(f"{run} has no {QUANT_STATE} (its int8 statistics); quantize the parent run again")
        state = read_weights(run / QUANT_STATE)
    recipe = Int8Recipe(state=state, qat=bool(record.get("qat_epochs")),
                        backend=spec.backend if spec.precision == "int8" else None,
                        float_layers=spec.float_layers)  # fmt: skip
    converted, _ = convert(model, spec.precision, input_shape=shape, int8=recipe, compile=spec.compile, device=device,
                           step_flops=_recorded_flops(run))  # fmt: skip
    return converted


def _ensemble(run: Path, record: dict[str, Any], num_classes: int, device: torch.device) -> tuple[nn.Module, str]:
    """An ensemble run's model: every member loaded from its own run (refused if it changed since the ensemble
    was built) and the fusers from the ensemble's weights."""
    from anytime.families import EnsembleModel, FuserBank, MemberInfo

    try:
        entries = list(record["members"])
        infos = [MemberInfo(str(m["name"]), None if m["step"] is None else int(m["step"]), int(m["flops"]),
                            int(m["params"]), str(m.get("precision", "fp32"))) for m in entries]  # fmt: skip
        bank = FuserBank(str(record["fuser"]), len(entries), num_classes, folds=int(record["folds"]),
                         heldout=int(record["heldout"]), hidden=int(record["hidden"]))  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise AnytimeError(f"{run / 'config.json'} does not describe its ensemble ({exc}); was it edited?") from None
    members = []
    for entry in entries:
        # where it was, seen from the ensemble (so a tree moved whole keeps working), else where it was built
        relative = Path(os.path.normpath(run / str(entry.get("relative", ""))))
        member = relative if entry.get("relative") and relative.is_dir() else Path(entry["run"])
        if not member.is_dir():
            raise AnytimeError(f"member {member} of the ensemble {run} is gone; restore it or build the ensemble again")
        loaded = load_run(member, device)
        if loaded.fingerprint != entry.get("fingerprint"):
            raise AnytimeError(
                f"member {member} changed after the ensemble {run} was built (weights {loaded.fingerprint}, the "
                f"ensemble was fit on {entry.get('fingerprint')}); build the ensemble again with `anytime ensemble`"
            )  # fmt: skip
        members.append(loaded.model)
    try:
        load_weights(bank, run / WEIGHTS)
    except AnytimeError as exc:
        if record["fuser"] != "mlp":
            raise
        raise AnytimeError(
            f"{exc}; MLP fusers built before 2026-11-27 lack their pool's weights: build the "
            f"ensemble again with `anytime ensemble`"
        ) from None
    label = f"ensemble {record['fuser']}({' + '.join(i.name for i in infos)})"
    return EnsembleModel(members, infos, bank).to(device), label


def _baseline(config: TrainConfig, record: dict[str, Any], num_classes: int, in_channels: int) -> nn.Module:
    """A torchensemble baseline run's model (``anytime ensemble-baseline``): its members rebuilt from the recipe,
    fused as its method fuses them; the caller loads the weights."""
    from anytime.backbones import create_model
    from anytime.families import EnsembleModel, FuserBank, MemberInfo

    try:
        count, kind, scale = int(record["estimators"]), str(record["fuser"]), float(record["scale"])
        flops, params = int(record["member_flops"]), int(record["member_params"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AnytimeError(f"the run's baseline record is incomplete ({exc}); was config.json edited?") from None
    members = [create_model(config.model, num_classes=num_classes, in_channels=in_channels) for _ in range(count)]
    infos = [MemberInfo(f"{config.model}#{i}", None, flops, params) for i in range(count)]
    return EnsembleModel(members, infos, FuserBank(kind, count, num_classes, scale=scale))
