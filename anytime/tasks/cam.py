"""Class activation maps per step: which regions each exit or step used for its answer.

For every step the feature map is the last spatial one its forward computes (a convolution's, a block's or a
stage's output; pooling outputs are skipped). Where the step's head is global average pooling and a linear layer,
the map is CAM (Zhou et al., CVPR 2016): the class's linear weights over the channels of that feature map. Any other
head gets Grad-CAM (Selvaraju et al., ICCV 2017): the channels weighted by the class score's mean gradient, and
only the positive part kept. For a global-pooled linear head Grad-CAM is CAM's positive part divided by the map's
area, so the two agree where both apply. Each map is scaled to [0, 1] per image and resized (bilinear) to the input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anytime.contract import run_step, step_count
from anytime.errors import AnytimeError

if TYPE_CHECKING:
    from anytime.train.folder import RunFolder

_POOLS = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.AvgPool2d, nn.MaxPool2d)


@dataclass(frozen=True)
class StepMaps:
    """One step's maps for a batch: ``maps`` ``[N, H, W]`` in [0, 1] at the input's size, the class each one
    explains (``target``), what the step predicted and with what softmax confidence, the method and the module
    whose feature map was used."""

    step: int
    method: str
    layer: str
    maps: np.ndarray
    target: np.ndarray
    predicted: np.ndarray
    confidence: np.ndarray


def step_maps(model: nn.Module, x: Tensor, *, steps: Sequence[int] | None = None,
              labels: Tensor | None = None) -> list[StepMaps]:  # fmt: skip
    """CAM or Grad-CAM of ``steps`` (default: all) for the batch ``x``, each explaining the step's own predicted
    class, or ``labels`` when given (the true class: where the step looked for it)."""
    if getattr(model, "spec", None) is not None:
        raise AnytimeError("class activation maps need gradients through the float model; give the float run, "
                           "not its quantized or exported form")  # fmt: skip
    count = step_count(model)
    chosen = list(range(count)) if steps is None else list(steps)
    bad = [k for k in chosen if not 0 <= k < count]
    if bad:
        raise AnytimeError(f"step {bad[0]} does not exist; this model has steps 0..{count - 1}")
    was_training = model.training
    model.eval()
    try:
        return [_one_step(model, x, k, labels) for k in chosen]
    finally:
        model.train(was_training)


def _one_step(model: nn.Module, x: Tensor, k: int, labels: Tensor | None) -> StepMaps:
    names = {m: n for n, m in model.named_modules()}
    done: list[tuple[str, nn.Module, object]] = []

    def record(module: nn.Module, _inputs: object, output: object) -> None:
        done.append((names.get(module, "?"), module, output))

    handles = [m.register_forward_hook(record) for m in model.modules() if m is not model]
    try:
        with torch.enable_grad():
            logits = run_step(model, x.detach().requires_grad_(True), k)
            spatial = [i for i, (_, module, out) in enumerate(done)
                       if isinstance(out, Tensor) and out.dim() == 4 and out.shape[-1] * out.shape[-2] > 1
                       and not isinstance(module, _POOLS)]  # fmt: skip
            if not spatial:
                raise AnytimeError(f"step {k} computes no spatial feature map (its input is flat or its layers are not "
                                   "convolutions); class activation maps need a convolutional network, e.g. a ResNet or VGG run")  # fmt: skip
            where = spatial[-1]
            name, _, features = done[where]
            assert isinstance(features, Tensor)
            probabilities = logits.detach().softmax(dim=1)
            confidence, predicted = probabilities.max(dim=1)
            target = predicted if labels is None else labels.to(predicted.device)
            after = [module for _, module, _ in done[where + 1 :] if not list(module.children())]
            linear = _global_pooled_linear(after)
            if linear is not None:
                method = "CAM"
                weights = linear.weight.detach()[target]  # [N, C]
                maps = torch.einsum("nchw,nc->nhw", features.detach(), weights)
            else:
                method = "Grad-CAM"
                score = logits.gather(1, target[:, None]).sum()
                (grad,) = torch.autograd.grad(score, features)
                alpha = grad.mean(dim=(2, 3), keepdim=True)
                maps = F.relu((alpha * features.detach()).sum(dim=1))
    finally:
        for handle in handles:
            handle.remove()
    return StepMaps(k, method, name, _scaled(maps, x.shape[-2:]), target.cpu().numpy(), predicted.cpu().numpy(),
                    confidence.cpu().numpy())  # fmt: skip


def _global_pooled_linear(after: list[nn.Module]) -> nn.Linear | None:
    """The linear layer when the leaf modules run after the feature map are global average pooling, a flatten and
    a linear layer (nothing else): the head CAM is defined for."""
    kinds = [m for m in after if not isinstance(m, (nn.Flatten, nn.Identity, nn.Dropout))]
    if len(kinds) != 2 or not isinstance(kinds[0], nn.AdaptiveAvgPool2d) or not isinstance(kinds[1], nn.Linear):
        return None
    size = kinds[0].output_size
    return kinds[1] if size in (1, (1, 1)) else None


def _scaled(maps: Tensor, size: torch.Size) -> np.ndarray:
    """Per image, to [0, 1] (a constant map is all zeros), then bilinear to the input's height and width."""
    flat = maps.reshape(maps.shape[0], -1)
    low = flat.min(dim=1, keepdim=True).values
    span = (flat.max(dim=1, keepdim=True).values - low).clamp_min(1e-12)
    scaled = ((flat - low) / span).reshape(maps.shape)
    resized = F.interpolate(scaled[:, None].float(), size=tuple(size), mode="bilinear", align_corners=False)[:, 0]
    return resized.clamp(0, 1).cpu().numpy()


@dataclass(frozen=True)
class CamReport:
    """What ``anytime cam`` wrote: the figure, the arrays (``cam.npz``) and the summary (``cam.json``)."""

    paths: list[Path]
    steps: list[dict[str, object]]


def cam_run(
    run_dir: RunFolder | str | Path, *, images: Sequence[str | Path] = (), split: str | None = None, count: int = 8,
    steps: Sequence[int] | None = None, explain: str = "predicted", out: str | Path | None = None,
    device: str = "auto",
) -> CamReport:  # fmt: skip
    """The maps of a run's steps for image files (``images``) or ``count`` images of a split drawn at random
    (seeded), written to ``out`` (default ``RUN/cam``) together or not at all. ``explain``: ``predicted`` (each
    step's own answer) or ``label`` (the true class; images of a split only)."""
    from anytime.train.folder import open_run
    from anytime.train.records import class_names, run_title
    from anytime.train.runs import require_images
    from anytime.utils.outputs import check_figure_folder, output_lock, staged_files

    check_image_source(images, split)
    if explain not in ("predicted", "label"):
        raise AnytimeError(f"--explain is 'predicted' or 'label' (got {explain!r})")
    if explain == "label" and split is None:
        raise AnytimeError("--explain label needs the images' true classes: draw them from a split (--split test)")
    opened = open_run(run_dir)
    run_dir, run = opened.path, opened.load(device)
    require_images(run, "anytime cam")
    folder = Path(out) if out is not None else Path(run_dir) / "cam"
    check_figure_folder(folder, "cam.npz", kind="class activation maps", given=out is not None)
    x, labels, sources, shown = chosen_images(run, images, split, count)
    maps = step_maps(run.model, x, steps=steps, labels=labels if explain == "label" else None)
    from anytime.profile.steps import step_names

    names = step_names(run.model, step_count(run.model))
    summary = [{"step": m.step, "name": names[m.step], "method": m.method, "layer": m.layer} for m in maps]
    with output_lock(folder), staged_files(folder, "class activation maps" if out is not None else None) as work:
        from anytime.plotting.cam import plot_step_maps
        from anytime.utils.io import atomic_path, write_json

        with atomic_path(work / "cam.npz") as tmp:
            with open(tmp, "wb") as handle:
                np.savez_compressed(handle, images=shown, steps=np.array([m.step for m in maps]),
                                    maps=np.stack([m.maps for m in maps]), target=np.stack([m.target for m in maps]),
                                    predicted=np.stack([m.predicted for m in maps]),
                                    confidence=np.stack([m.confidence for m in maps]),
                                    labels=np.full(x.shape[0], -1) if labels is None else labels.cpu().numpy())  # fmt: skip
        write_json(work / "cam.json", {"run": str(run_dir), "model_fingerprint": run.fingerprint, "explain": explain,
                                       "images": sources, "steps": summary})  # fmt: skip
        figures = plot_step_maps(shown, maps, names, work / "cam", run_title(run_dir), class_names=class_names(run_dir),
                                 labels=None if labels is None else labels.cpu().numpy())  # fmt: skip
        written = [work / "cam.npz", work / "cam.json", *figures]
    return CamReport([folder / p.name for p in written], summary)


def check_image_source(images: Sequence[str | Path], split: str | None) -> None:
    """Refuse both image files and a split, or neither."""
    if bool(images) == (split is not None):
        raise AnytimeError(
            "give image files (--images A.png B.png) or a split to draw from (--split test), one of them"
        )


def chosen_images(run: Any, images: Sequence[str | Path], split: str | None,
                  count: int) -> tuple[Tensor, Tensor | None, list[str], np.ndarray]:  # fmt: skip
    """The images a figure of ``run`` shows: files (``images``) or ``count`` of a ``split`` drawn at random (seeded),
    on the run's device; their true classes (None for files), where each came from, and how they look
    (``[N, H, W, C]`` in [0, 1])."""
    from anytime.data.inputs import InputSpec

    check_image_source(images, split)
    spec = InputSpec.from_dataset(run.dataset)
    if split is not None:
        x, labels, sources = _split_images(run, split, count)
    else:
        x, labels, sources = _file_images(spec, images), None, [str(p) for p in images]
    mean = torch.tensor(spec.mean).view(1, -1, 1, 1)
    std = torch.tensor(spec.std).view(1, -1, 1, 1)
    shown = (x * std + mean).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    return x.to(run.device), labels, sources, shown


def _split_images(run: Any, split: str, count: int) -> tuple[Tensor, Tensor, list[str]]:
    from anytime.data.augment import normalize
    from anytime.train import load_splits

    splits = load_splits(run.config)
    data = {"train": splits.train, "val": splits.val, "test": splits.test}.get(split)
    if data is None:
        raise AnytimeError(f"--split is train, val or test (got {split!r})")
    total = len(data)
    if not 1 <= count <= min(total, 64):
        raise AnytimeError(f"--count {count}: draw between 1 and {min(total, 64)} images of the {split} split")
    picked = torch.from_numpy(np.sort(np.random.default_rng(0).choice(total, size=count, replace=False)))
    x = normalize(data.images[picked], splits.info.mean, splits.info.std)  # a store reads just these
    return x, data.labels[picked], [f"{split}[{int(i)}]" for i in picked]


def _file_images(spec: Any, paths: Sequence[str | Path]) -> Tensor:
    decoded = []
    for path in paths:
        try:
            body = Path(path).read_bytes()
        except OSError as exc:
            raise AnytimeError(f"cannot read image {path} ({exc.strerror}); check the path") from None
        try:
            decoded.append(spec.decode(body))
        except AnytimeError as exc:
            raise AnytimeError(f"{path}: {exc}") from None
    return torch.stack(decoded)
