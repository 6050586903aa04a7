"""The cheap baseline a practitioner tries first, fit beside every training run so that a neural recipe is never
reported without the floor it has to beat.

Text: TF-IDF of the token 1- and 2-grams (the WordPiece ids the network reads, so both see the same input) and a
linear SVM (scikit-learn's ``LinearSVC``). Images: a multinomial logistic regression on the pixels, average-pooled
to at most :data:`MAX_PIXEL_FEATURES` values per image (and at most one per four training images: more would only
be fit to noise) and standardised. The regularisation of either is chosen on the validation split from a short
grid (without a validation split, the grid's middle); the test split is only reported. Training samples are
capped (:data:`MAX_TRAIN_SAMPLES`, a seeded random subset) so the baseline stays cheap on any data set.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from anytime.data.base import DatasetInfo, DatasetSplits, ImageStore, Split
from anytime.data.text import PAD_ID
from anytime.utils.lbfgs import minimise
from anytime.utils.timer import monotonic

MAX_TRAIN_SAMPLES = 50_000
MAX_PIXEL_FEATURES = 256
MIN_PIXEL_FEATURES = 64
LBFGS_STEPS = 50
TEXT_C_GRID: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0)
PIXEL_L2_GRID: tuple[float, ...] = (1e-2, 1e-3, 1e-4)
_READ_CHUNK = 2048  # images read from a store at a time


@dataclass(frozen=True)
class Baseline:
    """A fitted baseline's accuracy on validation and test, what it is, and what it cost to fit."""

    kind: str  # "tfidf-linear-svm" or "pixel-logistic"
    description: str
    val_acc: float | None  # None without a validation split
    test_acc: float
    train_samples: int
    features: int
    regularisation: float  # the SVM's C, or the logistic regression's L2 weight, chosen on validation
    fit_time_s: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able copy."""
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Baseline:
        """Read back what :meth:`to_dict` wrote (a run's ``summary.json``)."""
        return cls(**{name: doc[name] for name in cls.__dataclass_fields__})


def fit_baseline(splits: DatasetSplits, *, seed: int = 0) -> Baseline:
    """Fit the baseline of ``splits``' modality on its training split (at most :data:`MAX_TRAIN_SAMPLES`), choose
    its regularisation on validation, and score it on test."""
    start = monotonic()
    train = _capped(splits.train, seed)
    if splits.info.modality == "text":
        kind, description, val_acc, test_acc, features, chosen = _fit_text(train, splits.val, splits.test)
    else:
        kind, description, val_acc, test_acc, features, chosen = _fit_pixels(train, splits.val, splits.test,
                                                                             splits.info, len(train))  # fmt: skip
    return Baseline(kind=kind, description=description, val_acc=val_acc, test_acc=test_acc,
                    train_samples=len(train), features=features, regularisation=chosen,
                    fit_time_s=monotonic() - start)  # fmt: skip


def _capped(split: Split, seed: int) -> Split:
    if len(split) <= MAX_TRAIN_SAMPLES:
        return split
    return split.sample(MAX_TRAIN_SAMPLES, seed=seed)


def _documents(split: Split) -> list[str]:
    ids = split.images.numpy()
    return [" ".join(map(str, row[row != PAD_ID].tolist())) for row in ids]


def _fit_text(train: Split, val: Split, test: Split) -> tuple[str, str, float | None, float, int, float]:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.svm import LinearSVC

    vectoriser = TfidfVectorizer(token_pattern=r"\S+", ngram_range=(1, 2), sublinear_tf=True, lowercase=False)
    x_train = vectoriser.fit_transform(_documents(train))
    x_test = vectoriser.transform(_documents(test))
    x_val = vectoriser.transform(_documents(val)) if len(val) else None
    y_train, y_val, y_test = train.labels.numpy(), val.labels.numpy(), test.labels.numpy()
    best: tuple[float | None, float, Any] | None = None
    for c in _grid(TEXT_C_GRID, len(y_val)):
        model = LinearSVC(C=c, random_state=0).fit(x_train, y_train)  # its solver shuffles: seeded, a rerun agrees
        accuracy = None if x_val is None else float((model.predict(x_val) == y_val).mean())
        if best is None or (accuracy or 0.0) > (best[0] or 0.0):
            best = (accuracy, c, model)
    assert best is not None
    val_acc, c, model = best
    test_acc = float((model.predict(x_test) == y_test).mean())
    description = f"TF-IDF of token 1-2-grams + linear SVM (C={c:g}, chosen on validation)"
    return "tfidf-linear-svm", description, val_acc, test_acc, x_train.shape[1], c


def _grid(grid: tuple[float, ...], val_samples: int) -> tuple[float, ...]:
    return grid if val_samples else (grid[len(grid) // 2],)


def _pooled_size(info: DatasetInfo, train_samples: int) -> tuple[int, int]:
    h, w = info.image_size
    features = max(MIN_PIXEL_FEATURES, min(MAX_PIXEL_FEATURES, train_samples // 4))
    scale = max(1.0, math.sqrt(info.in_channels * h * w / features))
    return max(1, int(h / scale)), max(1, int(w / scale))


def _pixels(split: Split, size: tuple[int, int]) -> torch.Tensor:
    """Every image of ``split`` average-pooled to ``size``, flattened, in [0, 1] (float32 [N, C*h*w])."""
    images = split.images
    chunks = []
    for start in range(0, len(split), _READ_CHUNK):
        stop = min(start + _READ_CHUNK, len(split))
        batch = images.read(np.arange(start, stop)) if isinstance(images, ImageStore) else images[start:stop]
        batch = batch.float().div_(255)
        if tuple(batch.shape[2:]) != size:
            batch = F.adaptive_avg_pool2d(batch, size)
        chunks.append(batch.flatten(1))
    return torch.cat(chunks) if chunks else torch.zeros(0, int(images.shape[1]) * size[0] * size[1])


def _fit_pixels(
    train: Split, val: Split, test: Split, info: DatasetInfo, samples: int
) -> tuple[str, str, float | None, float, int, float]:
    size = _pooled_size(info, samples)
    x_train = _pixels(train, size)
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-3)
    x_train = (x_train - mean) / std
    x_val, x_test = ((_pixels(s, size) - mean) / std for s in (val, test))
    y_train = train.labels
    best: tuple[float | None, float, torch.Tensor, torch.Tensor] | None = None
    weight, bias = torch.zeros(x_train.shape[1], info.num_classes), torch.zeros(info.num_classes)
    for l2 in _grid(PIXEL_L2_GRID, len(val)):  # strongest first, each fit starting from the previous one
        weight, bias = _logistic(x_train, y_train, l2, weight, bias)
        accuracy = _accuracy(x_val, val.labels, weight, bias) if len(val) else None
        if best is None or (accuracy or 0.0) > (best[0] or 0.0):
            best = (accuracy, l2, weight, bias)
    assert best is not None
    val_acc, l2, weight, bias = best
    test_acc = _accuracy(x_test, test.labels, weight, bias)
    pooled = "" if size == info.image_size else f", pooled to {size[0]}x{size[1]}"
    description = f"logistic regression on the pixels{pooled} (L2 {l2:g}, chosen on validation)"
    return "pixel-logistic", description, val_acc, test_acc, x_train.shape[1], l2


def _logistic(
    x: torch.Tensor, y: torch.Tensor, l2: float, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression (mean cross-entropy + ``l2`` / 2 times the squared weights) by full-batch
    L-BFGS from ``weight`` and ``bias``: deterministic, and near its optimum within :data:`LBFGS_STEPS`."""
    weight, bias = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    minimise([weight, bias], lambda: F.cross_entropy(x @ weight + bias, y) + 0.5 * l2 * weight.pow(2).sum(),
             steps=LBFGS_STEPS, tolerance=1e-5)  # fmt: skip
    return weight.detach(), bias.detach()


def _accuracy(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> float:
    if len(y) == 0:
        return float("nan")
    return float(((x @ weight + bias).argmax(1) == y).float().mean())
