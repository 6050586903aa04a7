"""Build an ensemble run (``anytime ensemble``): trained runs of any architecture and precision as members, put
in an order, fused after each one, written as a run that collect, sweep, calibrate, profile, schedule and the
runtime take unchanged.

Every member answers with its last step (a multi-exit member's last exit). Members must share the dataset and
its split (same data, validation fraction and seed), so the validation images the fusers are fit on were held
out of every member's training. Fusers are fit on the validation split only and cross-fitted over its folds; the
run's validation cache holds the cross-fitted answers, so thresholds calibrated on it are not calibrated on the
fuser's own training data. The test split is only reported.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from anytime.backbones.base import example_input, takes_tokens
from anytime.data import make_loader
from anytime.data.base import DatasetSplits
from anytime.data.text import TOKENIZER_FILE
from anytime.errors import AnytimeError
from anytime.families import FUSERS, EnsembleModel, FitSettings, FuserBank, MemberInfo, cross_fit, member_log_probs
from anytime.families.fusers import CrossFit
from anytime.outputs.cache import OutputCache, cache_path
from anytime.precision.model import float_flops
from anytime.tasks.profiling import default_profile_path
from anytime.train.checkpoint import save_weights
from anytime.train.records import WEIGHTS, baseline_record, ensemble_record, precision_record, run_weights_fingerprint
from anytime.train.runs import LoadedRun, dataset_input_shape, load_run, run_config
from anytime.train.splits import run_splits
from anytime.utils.io import atomic_path, write_json
from anytime.utils.machine import describe_machine, device_label, git_sha, resolve_device
from anytime.utils.outputs import RUN, RUN_ENTRIES, check_replaceable, staged_dir

ORDERS: tuple[str, ...] = ("cost", "greedy", "given")
FIT_SPLITS: tuple[str, ...] = ("val",)
_SPLIT_KEYS = ("data", "image_size", "val_fraction", "seed", "limit_train")  # the data itself: its fingerprint
_DATASET_KEYS = ("name", "num_classes", "in_channels", "image_size", "fingerprint")
_COST_SAMPLES = 60  # batch-1 timings per member when no profile says what a member costs


@dataclass(frozen=True)
class MemberReport:
    """One member: its run, name, precision, accuracy alone and cost at batch 1 (p50, ms)."""

    run: str
    name: str
    precision: str
    val_acc: float
    test_acc: float
    cost_ms: float | None


@dataclass(frozen=True)
class EnsembleReport:
    """What ``anytime ensemble`` built: the members in ladder order, every fuser's accuracy per step (validation
    cross-fitted, test) and the run it wrote with the chosen fuser."""

    out: Path
    fuser: str
    order: str
    members: tuple[MemberReport, ...]
    val_acc: dict[str, tuple[float, ...]]
    test_acc: dict[str, tuple[float, ...]]
    cost_source: str
    stacking: tuple[float, float] | None = None  # scikit-learn's cross-check, all members: (validation, test)

    @property
    def best_member(self) -> MemberReport:
        """The member most accurate on validation (test is only reported)."""
        return max(self.members, key=lambda m: m.val_acc)


@dataclass(frozen=True)
class EnsembleSettings:
    """How an ensemble's members are put in order and fused (:func:`build_ensemble`).

    ``order``: ``cost`` (batch-1 latency, cheapest first), ``greedy`` (most validation accuracy gained per
    millisecond first) or ``given``. ``fuser`` is the one the run deploys (``mlp``, ``mean``, ``vote`` or
    ``weighted``); all four are fit and reported. Fusers are fit on ``fit_split`` (only ``val``, held out of every
    member's training), cross-fitted over ``folds`` folds (at least 2), the learned ones as ``fit`` says."""

    order: str = "cost"
    fuser: str = "mlp"
    folds: int = 5
    fit_split: str = "val"
    fit: FitSettings = FitSettings()

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise AnytimeError(f"unknown order '{self.order}'; choose one of {', '.join(ORDERS)}")
        if self.fuser not in FUSERS:
            raise AnytimeError(f"unknown fuser '{self.fuser}'; choose one of {', '.join(FUSERS)}")
        if self.fit_split == "test":
            raise AnytimeError("fusers are never fit on the test split (it is only reported); fit them on val")
        if self.fit_split not in FIT_SPLITS:
            raise AnytimeError(f"fusers are fit on the validation split, held out of every member's training (got "
                               f"'{self.fit_split}'); use --fit-split val")  # fmt: skip
        if self.folds < 2:
            raise AnytimeError(f"--folds must be at least 2 for cross-fitting (got {self.folds})")


def _check_compatible(paths: Sequence[Path]) -> None:
    """Members must answer the same question on the same images (or the same token ids of the same sentences),
    and share the held-out split."""
    records = [(p, *run_config(p)) for p in paths]
    first, first_config, first_data = records[0]
    for path, config, data in records[1:]:
        if (data.get("modality") == "text") != (first_data.get("modality") == "text"):
            raise AnytimeError(f"{first} and {path} read different inputs (text and images); an ensemble's members "
                               "must be trained on the same data")  # fmt: skip
        if data.get("modality") == "text" and (_tokenizer_of(first) != _tokenizer_of(path)
                                                or data.get("max_length") != first_data.get("max_length")):  # fmt: skip
            raise AnytimeError(f"{first} and {path} encode sentences differently (another tokenizer or maximum "
                               f"length); train the members with one tokenizer: --tokenizer {first}/{TOKENIZER_FILE} "
                               f"--max-length {first_data.get('max_length')}")  # fmt: skip
        for key in _DATASET_KEYS:
            if first_data.get(key) != data.get(key):
                what = {"num_classes": "label sets", "in_channels": "input shapes", "image_size": "input shapes"}.get(
                    key, "datasets"
                )
                raise AnytimeError(
                    f"{first} and {path} have different {what} ({key} {first_data.get(key)} vs {data.get(key)}); "
                    "an ensemble's members must be trained on the same data"
                )  # fmt: skip
        for key in _SPLIT_KEYS:
            if getattr(first_config, key) != getattr(config, key):
                raise AnytimeError(
                    f"{first} and {path} split their data differently ({key} {getattr(first_config, key)} vs "
                    f"{getattr(config, key)}): one's validation images may be the other's training images, so no "
                    "fuser can be fit honestly; train the members with the same split"
                )  # fmt: skip


def _tokenizer_of(run: Path) -> bytes:
    try:
        return (run / TOKENIZER_FILE).read_bytes()
    except OSError:
        raise AnytimeError(
            f"{run} has no readable {TOKENIZER_FILE}, which its token ids were made with; restore it "
            "from a copy of the run, or train again"
        ) from None


def _member_info(run: LoadedRun, shape: tuple[int, ...]) -> tuple[MemberInfo, str]:
    record = precision_record(run.run_dir)
    precision = str(record["precision"]) if record else "fp32"
    steps = run.num_steps
    # a quantized graph counts as zero FLOPs; a converted model carries its float graph's
    flops = getattr(run.model, "step_flops", None) or float_flops(run.model, shape, steps)
    float_model = getattr(run.model, "float_model", run.model)
    params = sum(p.numel() for p in float_model.parameters())
    name = run.config.model + ("" if precision == "fp32" else f"-{precision}")
    return MemberInfo(name, steps - 1 if steps > 1 else None, int(flops[-1]), int(params), precision), precision


def _profiled_cost(run: LoadedRun) -> float | None:
    from anytime.profile.store import DeviceProfile

    path = default_profile_path(run.run_dir, run.device)
    if not path.is_file():
        return None
    profile = DeviceProfile.load(path, fingerprint=run.fingerprint)
    if 1 not in profile.latency:
        return None
    return float(np.median(profile.at(1).steps[-1]))


def _costs(runs: Sequence[LoadedRun], infos: Sequence[MemberInfo], shape: tuple[int, ...]) -> tuple[list[float], str]:
    """Each member's batch-1 latency (p50, ms): from the members' profiles on this device when every member has
    one, else measured here, interleaved, on random inputs."""
    profiled = [_profiled_cost(r) for r in runs]
    if all(c is not None for c in profiled):
        return [float(c) for c in profiled], "profiles (batch 1, p50)"  # type: ignore[arg-type]
    from anytime.profile.latency import per_sample_latency

    seeded = torch.Generator().manual_seed(0)
    inputs = example_input(shape, _COST_SAMPLES, tokens=takes_tokens(runs[0].model), generator=seeded)
    inputs = inputs.to(runs[0].device)
    calls = {str(i): (lambda x, r=r, info=info: member_log_probs(r.model, info.step, x))
             for i, (r, info) in enumerate(zip(runs, infos))}  # fmt: skip
    with torch.inference_mode():
        times = per_sample_latency(calls, inputs)
    return [float(np.median(times[str(i)]) * 1000) for i in range(len(runs))], "measured here (batch 1, p50)"


@torch.no_grad()  # not inference mode: the fusers are then fit on these tensors
def _member_outputs(runs: Sequence[LoadedRun], infos: Sequence[MemberInfo], splits: DatasetSplits, split: str,
                    batch_size: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Every member's log-probabilities ``[M, N, C]`` on ``split`` and its labels."""
    loader = make_loader(
        getattr(splits, split), splits.info, batch_size=batch_size, train=False, seed=runs[0].config.seed
    )
    chunks: list[Tensor] = []
    labels: list[Tensor] = []
    for images, targets in loader:
        x = images.to(runs[0].device)
        chunks.append(torch.stack([member_log_probs(r.model, info.step, x).cpu() for r, info in zip(runs, infos)]))
        labels.append(targets.cpu())
    if not chunks:
        raise AnytimeError(f"the {split} split is empty; an ensemble needs held-out images")
    return torch.cat(chunks, dim=1), torch.cat(labels)


def _accuracy(logits: Tensor | np.ndarray, labels: Tensor) -> float:
    predicted = torch.as_tensor(logits).argmax(dim=-1)
    return float((predicted == labels).float().mean())


def stacking_check(val_logps: Tensor, val_labels: Tensor, test_logps: Tensor, test_labels: Tensor, *,
                   folds: int, seed: int) -> tuple[float, float]:  # fmt: skip
    """scikit-learn's cross-check of the learned fusers: a multinomial ``LogisticRegression`` on every member's
    log-probabilities (a stacking meta-learner over members trained already, which ``StackingClassifier`` would
    retrain). Its validation accuracy is cross-fitted over the same number of folds (``cross_val_predict``); its
    test accuracy comes from the fit on the whole validation split."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import KFold, StratifiedKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    def features(logps: Tensor) -> np.ndarray:
        return logps.permute(1, 0, 2).reshape(logps.shape[1], -1).numpy()

    x, y = features(val_logps), val_labels.numpy()
    # standardised: log-probabilities reach -20, and unscaled they left L-BFGS unconverged after 1,000 iterations
    learner = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
    splitter = StratifiedKFold if np.bincount(y).min() >= folds else KFold  # a rare class: folds need not hold it
    cv = splitter(n_splits=folds, shuffle=True, random_state=seed)
    heldout = cross_val_predict(learner, x, y, cv=cv)
    learner.fit(x, y)
    return float((heldout == y).mean()), float((learner.predict(features(test_logps)) == test_labels.numpy()).mean())


def greedy_order(logps: Tensor, labels: Tensor, costs: Sequence[float]) -> list[int]:
    """Members in the order that adds the most validation accuracy per millisecond at each step (accuracy of the
    prefix fused by the mean of probabilities; a first member is measured against chance)."""
    left = list(range(logps.shape[0]))
    chosen: list[int] = []
    current = 1.0 / logps.shape[-1]
    while left:

        def gain(i: int) -> float:
            fused = torch.logsumexp(logps[chosen + [i]], dim=0)
            return (_accuracy(fused, labels) - current) / max(costs[i], 1e-6)

        best = max(left, key=gain)
        chosen.append(best)
        left.remove(best)
        current = _accuracy(torch.logsumexp(logps[chosen], dim=0), labels)
    return chosen


@dataclass(frozen=True)
class _Fits:
    """Every fuser cross-fitted on the validation split, its accuracy per step (validation cross-fitted, test) and
    its answers on the test split."""

    fits: dict[str, CrossFit]
    val_acc: dict[str, tuple[float, ...]]
    test_acc: dict[str, tuple[float, ...]]
    test_fused: dict[str, Tensor]


def _check_members(members: Sequence[str | Path], out: str | Path, *,
                   overwrite: bool) -> tuple[list[Path], Path]:  # fmt: skip
    """One-line errors for members or an output ``build_ensemble`` cannot take, before any work; returns the
    members' folders and the output folder."""
    paths = [Path(m) for m in members]
    if len(paths) < 2:
        raise AnytimeError("an ensemble needs at least two member runs, e.g. --members runs/a,runs/b")
    if len({p.resolve() for p in paths}) != len(paths):
        raise AnytimeError("a member run is named twice in --members; give each run once")
    target = Path(out)
    if any(target.resolve() == p.resolve() for p in paths):
        raise AnytimeError(f"--out {target} is one of the members; give the ensemble a folder of its own")
    check_replaceable(target, RUN, overwrite=overwrite, create_parents=False)
    for path in paths:
        if ensemble_record(path) is not None or baseline_record(path) is not None:
            raise AnytimeError(f"{path} is itself an ensemble; give its members instead")
    _check_compatible(paths)
    return paths, target


def _fit_fusers(val_logps: Tensor, val_labels: Tensor, test_logps: Tensor, test_labels: Tensor, *, folds: int,
                settings: FitSettings) -> _Fits:  # fmt: skip
    """Every fuser cross-fitted on the validation answers and scored, step by step, on both splits."""
    steps = val_logps.shape[0]
    fits = {kind: cross_fit(kind, val_logps, val_labels, folds=folds, settings=settings) for kind in FUSERS}
    val_acc: dict[str, tuple[float, ...]] = {}
    test_acc: dict[str, tuple[float, ...]] = {}
    test_fused: dict[str, Tensor] = {}
    with torch.no_grad():
        for kind, fit in fits.items():
            test_fused[kind] = torch.stack([f(test_logps[: k + 1]) for k, f in enumerate(fit.fusers)])
            val_acc[kind] = tuple(_accuracy(fit.heldout[k], val_labels) for k in range(steps))
            test_acc[kind] = tuple(_accuracy(test_fused[kind][k], test_labels) for k in range(steps))
    return _Fits(fits, val_acc, test_acc, test_fused)


def _ensemble_record(report: EnsembleReport, runs: Sequence[LoadedRun], described: Sequence[tuple[MemberInfo, str]],
                     *, heldout: int, settings: EnsembleSettings) -> dict[str, Any]:  # fmt: skip
    """The ensemble record the run's config holds: how the fuser was fit and every member, in ladder order."""
    target = report.out
    fit = settings.fit
    return {
        "fuser": report.fuser, "order": report.order, "folds": settings.folds, "heldout": heldout, "hidden": fit.hidden,
        "fit_split": settings.fit_split, "fit": {"epochs": fit.epochs, "lr": fit.lr,
                                                 "weight_decay": fit.weight_decay, "seed": fit.seed},
        "cost_source": report.cost_source,
        "members": [{"run": str(r.run_dir.resolve()), "relative": os.path.relpath(r.run_dir.resolve(), target.resolve()),
                     "fingerprint": r.fingerprint, "name": info.name,
                     "precision": precision, "step": info.step, "flops": info.flops, "params": info.params,
                     "cost_ms": rep.cost_ms} for r, (info, precision), rep in zip(runs, described, report.members)],
    }  # fmt: skip


def build_ensemble(
    members: Sequence[str | Path], out: str | Path, settings: EnsembleSettings | None = None, *, device: str = "cpu",
    batch_size: int = 256, overwrite: bool = False, progress: Callable[[str], None] | None = None,
) -> EnsembleReport:  # fmt: skip
    """Write ``out``, an ensemble run of ``members`` (trained runs), ordered and fused as ``settings`` say (default
    :class:`EnsembleSettings`), and report every fuser's accuracy.

    ``order``: ``cost`` (batch-1 latency, cheapest first), ``greedy`` (most validation accuracy gained per
    millisecond first) or ``given``. ``fuser`` is the one the run deploys (``mlp``, ``mean``, ``vote`` or
    ``weighted``); all four are fit and reported. Fitting uses the validation split only, in ``folds`` folds.
    """
    settings = settings or EnsembleSettings()
    order, fuser, folds = settings.order, settings.fuser, settings.folds
    say = progress or (lambda _: None)
    paths, target = _check_members(members, out, overwrite=overwrite)
    target_device = resolve_device(device)
    runs = [load_run(p, target_device) for p in paths]
    shape = dataset_input_shape(runs[0].dataset)
    text = runs[0].dataset.get("modality") == "text"
    described = [_member_info(r, shape) for r in runs]
    infos = [d[0] for d in described]
    costs, cost_source = (
        _costs(runs, infos, shape) if order != "given" else ([float("nan")] * len(runs), "not measured")
    )
    say("running every member over the validation and test splits...")
    splits = run_splits(runs[0])
    val_logps, val_labels = _member_outputs(runs, infos, splits, "val", batch_size)
    test_logps, test_labels = _member_outputs(runs, infos, splits, "test", batch_size)
    ranked = {"given": lambda: list(range(len(runs))),
              "cost": lambda: sorted(range(len(runs)), key=lambda i: costs[i]),
              "greedy": lambda: greedy_order(val_logps, val_labels, costs)}[order]()  # fmt: skip
    runs = [runs[i] for i in ranked]
    described = [described[i] for i in ranked]
    infos = [infos[i] for i in ranked]
    costs = [costs[i] for i in ranked]
    val_logps, test_logps = val_logps[ranked], test_logps[ranked]
    say(f"fitting fusers on {val_labels.numel()} validation images in {folds} folds...")
    fitted = _fit_fusers(val_logps, val_labels, test_logps, test_labels, folds=folds, settings=settings.fit)
    reports = tuple(
        MemberReport(str(r.run_dir), info.name, precision, _accuracy(val_logps[i], val_labels),
                     _accuracy(test_logps[i], test_labels), None if np.isnan(costs[i]) else costs[i])
        for i, (r, (info, precision)) in enumerate(zip(runs, described))
    )  # fmt: skip
    chosen = fitted.fits[fuser]
    bank = FuserBank.of(chosen.fusers, chosen.fold_fusers, torch.from_numpy(chosen.folds))
    model = EnsembleModel([r.model for r in runs], infos, bank)
    stacking = stacking_check(val_logps, val_labels, test_logps, test_labels, folds=folds, seed=settings.fit.seed)
    report = EnsembleReport(target, fuser, order, reports, fitted.val_acc, fitted.test_acc, cost_source, stacking)
    record = _ensemble_record(report, runs, described, heldout=int(val_labels.numel()), settings=settings)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with staged_dir(target, RUN, overwrite=overwrite, create_parents=False, entries=RUN_ENTRIES) as work:
        write_json(work / "config.json", {
            "train": runs[0].config.to_dict(), "dataset": runs[0].dataset, "ensemble": record,
            "device": str(target_device), "machine": describe_machine(), "git_sha": git_sha(), "created": now,
        })  # fmt: skip
        save_weights(bank, work / WEIGHTS)
        if text:  # the run's token ids are its members' (one tokenizer, checked above)
            with atomic_path(work / TOKENIZER_FILE) as tmp:
                shutil.copyfile(paths[0] / TOKENIZER_FILE, tmp)
        fingerprint = run_weights_fingerprint(work)
        _write_caches(work, model, fingerprint, torch.from_numpy(chosen.heldout), val_labels, fitted.test_fused[fuser],
                      test_labels, splits.info.fingerprint)  # fmt: skip
        write_json(work / "summary.json", _summary(report, model, target, runs[0], target_device, now))
    return report


def _write_caches(folder: Path, model: EnsembleModel, fingerprint: str, val: Tensor, val_labels: Tensor, test: Tensor,
                  test_labels: Tensor, dataset_fingerprint: str) -> None:  # fmt: skip
    """The run's output caches, written now (the members have just run over both splits): validation holds
    the cross-fitted answers, test the deployed fusers'."""
    info = model.exit_info
    names = tuple(e.name for e in info)
    step_flops = np.array([e.flops for e in info], dtype=np.int64)
    cost_flops = np.array([e.cost_flops for e in info], dtype=np.int64)
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for split, logits, labels in (("val", val, val_labels), ("test", test, test_labels)):
        cache = OutputCache(
            logits=logits.numpy(), labels=labels.numpy().astype(np.int64), step_names=names, step_flops=step_flops,
            cost_flops=cost_flops, base_flops=model.backbone_flops, split=split, model_fingerprint=fingerprint,
            meta={"created": created, "dataset_fingerprint": dataset_fingerprint, "model": "ensemble",
                  "run": str(folder), "cross_fitted": split == "val"},
        )  # fmt: skip
        path = cache_path(folder, split)
        path.parent.mkdir(exist_ok=True)
        cache.save(path)


def _summary(report: EnsembleReport, model: EnsembleModel, target: Path, first: LoadedRun, device: torch.device,
             now: str) -> dict[str, Any]:  # fmt: skip
    fuser = report.fuser
    return {
        "run_dir": str(target), "model": "ensemble", "data": first.config.data, "fuser": fuser, "order": report.order,
        "dataset": {k: first.dataset.get(k) for k in ("name", "num_classes", "in_channels", "image_size", "source",
                                                      "modality", "max_length") if k in first.dataset},
        "members": [vars(m) for m in report.members],
        "final": {"val_acc": report.val_acc[fuser][-1], "test_acc": report.test_acc[fuser][-1]},
        "exits": [{**e.to_dict(), "val_acc": report.val_acc[fuser][e.index], "test_acc": report.test_acc[fuser][e.index]}
                  for e in model.exit_info],
        "fusers": {k: {"val_acc": list(report.val_acc[k]), "test_acc": list(report.test_acc[k])} for k in FUSERS},
        "stacking_check": None if report.stacking is None else {
            "learner": "sklearn LogisticRegression on all members' log-probabilities",
            "val_acc": report.stacking[0], "test_acc": report.stacking[1]},
        "validation": "cross-fitted: each validation image answered by fusers fit without its fold",
        "backbone_flops": model.backbone_flops, "cost_source": report.cost_source,
        "device": device_label(device), "created": now,
    }  # fmt: skip
