"""The outputs cache: the logits of every step for every sample of a split, computed once.

Sweeps, calibration and plots read this cache instead of running the network again ("logits once,
metrics many"). A cache names the model (the fingerprint of its weights) and the split it came from,
so a cache from another model or split is refused instead of silently mixed in.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable, Sized
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anytime.errors import AnytimeError
from anytime.utils.io import atomic_open

CACHE_FORMAT = "anytime-outputs-v1"
SPLITS: tuple[str, ...] = ("val", "test", "dev")  # dev: text datasets that have one


@dataclass(frozen=True)
class OutputCache:
    """Logits ``[K, N, C]`` (float32) of K steps on N samples, their labels and what each step costs.

    ``step_flops[k]``: FLOPs of step k alone (one sample). ``cost_flops[k]``: FLOPs a sample has spent
    when it leaves at step k under early exit (for exits, every head on the way is paid for).
    ``base_flops``: the plain backbone's FLOPs, the reference of every cost ratio.
    """

    logits: np.ndarray
    labels: np.ndarray
    step_names: tuple[str, ...]
    step_flops: np.ndarray
    cost_flops: np.ndarray
    base_flops: int
    split: str
    model_fingerprint: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.logits.ndim != 3:
            raise AnytimeError(f"an outputs cache needs logits [K, N, C] (got shape {list(self.logits.shape)})")
        k, n, c = self.logits.shape
        shapes_ok = (self.labels.shape == (n,) and len(self.step_names) == k and self.step_flops.shape == (k,)
                     and self.cost_flops.shape == (k,))  # fmt: skip
        if not shapes_ok:
            raise AnytimeError("an outputs cache needs logits [K, N, C], N labels and K step names and costs")
        if n and (self.labels.min() < 0 or self.labels.max() >= c):
            raise AnytimeError(f"an outputs cache's labels must be classes 0..{c - 1}")
        if self.base_flops <= 0 or (self.step_flops <= 0).any() or (self.cost_flops < self.step_flops).any():
            raise AnytimeError("an outputs cache needs positive FLOPs, with cost_flops >= step_flops")

    @property
    def num_steps(self) -> int:
        """K, the number of steps."""
        return int(self.logits.shape[0])

    @property
    def num_samples(self) -> int:
        """N, the number of samples."""
        return int(self.logits.shape[1])

    @property
    def num_classes(self) -> int:
        """C, the number of classes."""
        return int(self.logits.shape[2])

    def correct(self) -> np.ndarray:
        """``[K, N]`` booleans: is step k right on sample n."""
        return self.logits.argmax(axis=2) == self.labels[None, :]

    def step_accuracy(self) -> np.ndarray:
        """Accuracy of every step on its own, ``[K]``."""
        return self.correct().mean(axis=1)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the cache as one ``.npz`` file, atomically."""
        meta = {
            "format": CACHE_FORMAT, "step_names": list(self.step_names), "base_flops": int(self.base_flops),
            "split": self.split, "model_fingerprint": self.model_fingerprint, **self.meta,
        }  # fmt: skip
        with atomic_open(path, "wb") as handle:
            np.savez(
                handle, logits=self.logits.astype(np.float32), labels=self.labels.astype(np.int64),
                step_flops=self.step_flops.astype(np.int64), cost_flops=self.cost_flops.astype(np.int64),
                meta=np.array(json.dumps(meta)),
            )  # fmt: skip
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> OutputCache:
        """Read a cache written by :meth:`save` (no pickle is ever loaded)."""
        target = Path(path)
        if not target.is_file():
            raise AnytimeError(f"no outputs cache at {target}")
        try:
            with np.load(target, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                arrays = {k: data[k] for k in ("logits", "labels", "step_flops", "cost_flops")}
            if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT:
                raise AnytimeError(f"{target} is not an anytime outputs cache (no '{CACHE_FORMAT}' tag)")
            known = {"format", "step_names", "base_flops", "split", "model_fingerprint"}
            cache = cls(
                logits=arrays["logits"], labels=arrays["labels"], step_names=tuple(meta["step_names"]),
                step_flops=arrays["step_flops"], cost_flops=arrays["cost_flops"], base_flops=int(meta["base_flops"]),
                split=str(meta["split"]), model_fingerprint=str(meta["model_fingerprint"]),
                meta={k: v for k, v in meta.items() if k not in known},
            )  # fmt: skip
        except AnytimeError as exc:
            raise AnytimeError(f"{target}: {exc}; collect it again") from None
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
            raise AnytimeError(
                f"{target} is not a readable outputs cache ({type(exc).__name__}); collect it again"
            ) from None
        if not np.isfinite(cache.logits).all():
            raise AnytimeError(f"{target} holds NaN or infinite logits; the model is broken or diverged")
        return cache


def cache_path(run_dir: str | os.PathLike[str], split: str) -> Path:
    """Where a run's cache of ``split`` lives: ``RUN/outputs/SPLIT.npz``."""
    return Path(run_dir) / "outputs" / f"{split}.npz"


def step_costs(model: torch.nn.Module) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, int]:
    """Names, FLOPs alone, FLOPs under early exit, and the base FLOPs of a model's steps."""
    info = getattr(model, "exit_info", None)
    if info is not None:
        names = tuple(e.name for e in info)
        return (names, np.array([e.flops for e in info], dtype=np.int64),
                np.array([e.cost_flops for e in info], dtype=np.int64), int(model.backbone_flops))  # fmt: skip
    raise AnytimeError(f"{type(model).__name__} has no steps; train it with --exits to make it an anytime model")


@torch.no_grad()
def collect(
    model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, split: str,
    model_fingerprint: str, device: torch.device | str = "cpu", meta: dict[str, Any] | None = None,
    progress: bool = False,
) -> OutputCache:  # fmt: skip
    """Run ``model`` once over ``batches`` (normalised images and labels, e.g. an evaluation loader) and
    cache every step's logits (with a progress bar on stderr if ``progress``)."""
    from anytime.utils.progress import progress_bar

    if split not in SPLITS:
        raise AnytimeError(f"unknown split '{split}'; choose one of {', '.join(SPLITS)}")
    names, step_flops, cost_flops, base = step_costs(model)
    model.eval()
    chunks, targets = [], []
    bar = progress_bar(len(batches) if isinstance(batches, Sized) else None, f"collect {split}", enabled=progress,
                       unit="batch")  # fmt: skip
    for images, labels in batches:
        chunks.append(model.forward_all(images.to(device)).float().cpu())  # type: ignore[operator]
        targets.append(labels.cpu())
        bar.update(1)
    bar.close()
    if not chunks:
        raise AnytimeError(f"the {split} split is empty; nothing to collect")
    logits = torch.cat(chunks, dim=1).numpy()
    labels = torch.cat(targets)
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return OutputCache(
        logits=logits, labels=labels.numpy().astype(np.int64), step_names=names, step_flops=step_flops,
        cost_flops=cost_flops, base_flops=base, split=split, model_fingerprint=model_fingerprint,
        meta={"created": created, **(meta or {})},
    )  # fmt: skip


def load_cache(run_dir: str | os.PathLike[str], split: str, *, fingerprint: str | None = None) -> OutputCache:
    """A run's cache of ``split``, refused if it was collected from another model or split."""
    path = cache_path(run_dir, split)
    if not path.is_file():
        raise AnytimeError(f"{run_dir} has no {split} outputs yet; run `anytime collect {run_dir} --split {split}`")
    cache = OutputCache.load(path)
    if cache.split != split:
        raise AnytimeError(f"{path} holds the {cache.split} split, not {split}; collect it again")
    if fingerprint is not None and cache.model_fingerprint != fingerprint:
        raise AnytimeError(
            f"{path} was collected from another model (weights {cache.model_fingerprint}, the run's are "
            f"{fingerprint}); run `anytime collect {run_dir} --split {split}` again"
        )
    return cache
