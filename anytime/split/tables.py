"""What compressing the activation at each partition point does to the exits after it, on the validation split.

For a run with K exits, partition ``k`` (-1: the input) and codec ``c``, the exits after ``k`` see the activation
after a round trip through ``c``; the exits up to ``k`` run on the device untouched. ``RUN/outputs/split-val.npz``
keeps, per (k, c != fp32), those exits' validation logits, and per partition one sample's activation shape (what
prices the transfer). fp32 sends the activation bit for bit, so its exits are the run's validation cache itself.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from anytime.errors import AnytimeError
from anytime.outputs import OutputCache, load_cache
from anytime.split.codec import CODECS, roundtrip
from anytime.utils.io import atomic_open

TABLES_FORMAT = "anytime-split-tables-v1"


def tables_path(run_dir: str | Path) -> Path:
    """``RUN/outputs/split-val.npz``."""
    return Path(run_dir) / "outputs" / "split-val.npz"


@dataclass(frozen=True)
class SplitTables:
    """The validation cache, each partition's activation shape (one sample) and the compressed exits' logits."""

    cache: OutputCache
    shapes: dict[int, tuple[int, ...]]  # partition -1..K-2 -> one sample's shape
    compressed: dict[tuple[int, str], np.ndarray]  # (partition, codec) -> [K-1-k, N, C] logits of exits k+1..K-1
    codecs: tuple[str, ...]

    @property
    def num_steps(self) -> int:
        """K, the run's exits."""
        return self.cache.num_steps

    @property
    def num_classes(self) -> int:
        """C."""
        return self.cache.num_classes

    @property
    def model_fingerprint(self) -> str:
        """The weights these tables were computed with."""
        return self.cache.model_fingerprint

    def shape_at(self, k: int) -> tuple[int, ...]:
        """One sample's activation after segment ``k`` (``-1``: the input)."""
        return self.shapes[k]

    def cache_for(self, k: int, codec: str) -> OutputCache:
        """The validation logits as partition ``k`` under ``codec`` delivers them."""
        if codec == "fp32" or k >= self.num_steps - 1:
            return self.cache
        logits = self.cache.logits.copy()
        logits[k + 1 :] = self.compressed[(k, codec)]
        return replace(self.cache, logits=logits)

    def save(self, path: str | Path) -> Path:
        """One ``.npz``, written atomically."""
        meta = {"format": TABLES_FORMAT, "model_fingerprint": self.model_fingerprint, "codecs": list(self.codecs),
                "shapes": {str(k): list(s) for k, s in self.shapes.items()}}  # fmt: skip
        arrays = {f"logits_{k}_{c}": v.astype(np.float32) for (k, c), v in self.compressed.items()}
        with atomic_open(path, "wb") as handle:
            np.savez(handle, meta=np.array(json.dumps(meta)), **arrays)
        return Path(path)


def load_tables(run_dir: str | Path, fingerprint: str) -> SplitTables | None:
    """The run's split tables, None when there are none yet or they belong to other weights (rebuilt then)."""
    path = tables_path(run_dir)
    if not path.is_file():
        return None
    cache = load_cache(run_dir, "val", fingerprint=fingerprint)
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if not isinstance(meta, dict) or meta.get("format") != TABLES_FORMAT:
                raise AnytimeError(f"{path} is not anytime split tables (no '{TABLES_FORMAT}' tag); delete it")
            if meta.get("model_fingerprint") != fingerprint:
                return None
            codecs = tuple(str(c) for c in meta["codecs"])
            shapes = {int(k): tuple(int(v) for v in s) for k, s in meta["shapes"].items()}
            compressed = {}
            for k in range(-1, cache.num_steps - 1):
                for c in codecs:
                    if c != "fp32":
                        compressed[(k, c)] = data[f"logits_{k}_{c}"]
    except AnytimeError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
        raise AnytimeError(
            f"{path} is not readable split tables ({type(exc).__name__}); delete it to rebuild"
        ) from None
    for (k, _), v in compressed.items():
        if v.shape != (cache.num_steps - 1 - k, *cache.logits.shape[1:]) or not np.isfinite(v).all():
            raise AnytimeError(f"{path} does not match the run's validation cache; delete it to rebuild")
    return SplitTables(cache, shapes, compressed, codecs)


def compute_tables(model, batches, cache: OutputCache, codecs: tuple[str, ...]) -> SplitTables:  # type: ignore[no-untyped-def]
    """Run ``model``'s segments over the validation ``batches`` (normalised images, labels, in the cache's order),
    compressing the activation at every partition point with every codec and finishing the exits after it."""
    import torch

    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        raise AnytimeError(f"unknown codec {unknown[0]!r}; choose from {', '.join(CODECS)}")
    segments = list(model.segments)
    heads = list(model.heads)
    last = len(segments) - 1
    if last + 1 != cache.num_steps:
        raise AnytimeError(f"the model has {last + 1} segments but the validation cache {cache.num_steps} exits; "
                           "collect it again")  # fmt: skip

    def finish(h: torch.Tensor, k: int) -> torch.Tensor:
        out = []
        for j in range(k + 1, last + 1):
            h = segments[j](h)
            out.append(h if j == last else heads[j](h))
        return torch.stack(out).float()

    lossy = tuple(c for c in codecs if c != "fp32")
    shapes: dict[int, tuple[int, ...]] = {}
    parts: dict[tuple[int, str], list[torch.Tensor]] = {(k, c): [] for k in range(-1, last) for c in lossy}
    model.eval()
    with torch.inference_mode():
        for images, _ in batches:
            h = images
            for k in range(-1, last):
                if k >= 0:
                    h = segments[k](h)
                shapes[k] = tuple(int(s) for s in h.shape[1:])
                for c in lossy:
                    parts[(k, c)].append(finish(roundtrip(h, c), k).cpu())
    compressed = {key: torch.cat(v, dim=1).numpy() for key, v in parts.items()}
    if compressed and next(iter(compressed.values())).shape[1] != cache.num_samples:
        raise AnytimeError("the validation split changed since its outputs were collected; collect it again")
    return SplitTables(cache, shapes, compressed, ("fp32", *lossy))
