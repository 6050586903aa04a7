"""Ponder-cost maps of a SACT run: how many residual units every position of an image ran, at each step.

A stage's map (units run per position at its resolution) is upsampled to the input (nearest) and the stages are
added, so a pixel reads "units of the whole network spent here". ``anytime ponder`` writes the figure, the arrays
(``ponder.npz``: the total maps and every stage's own) and the mean units per stage of each step (``ponder.json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch.nn.functional as F

from anytime.errors import AnytimeError

if TYPE_CHECKING:
    from anytime.train.folder import RunFolder


@dataclass(frozen=True)
class StepPonder:
    """One step of the maps: the mean units run per position in each stage, over the images shown."""

    step: int
    name: str
    threshold: float
    units: tuple[float, ...]


@dataclass(frozen=True)
class PonderReport:
    """What ``anytime ponder`` wrote, and the mean units of every step mapped."""

    paths: list[Path]
    steps: list[StepPonder]


def ponder_run(
    run_dir: RunFolder | str | Path, *, images: Sequence[str | Path] = (), split: str | None = None, count: int = 8,
    steps: Sequence[int] | None = None, out: str | Path | None = None, device: str = "auto",
) -> PonderReport:  # fmt: skip
    """Maps of units run per position for image files (``images``) or ``count`` images of a split drawn at random
    (seeded), at ``steps`` (default all), written to ``out`` (default ``RUN/ponder``) together or not at all."""
    from anytime.families.sact import SACTResNet
    from anytime.tasks.cam import check_image_source, chosen_images
    from anytime.train.folder import open_run
    from anytime.train.records import run_title
    from anytime.train.runs import require_images
    from anytime.utils.outputs import check_figure_folder, output_lock, staged_files

    check_image_source(images, split)
    opened = open_run(run_dir)
    run_dir, run = opened.path, opened.load(device)
    require_images(run, "anytime ponder")
    model = run.model
    if not isinstance(model, SACTResNet):
        raise AnytimeError(f"{run_dir} is not a SACT run, so it has no ponder cost to map; train one with --sact "
                           "(or map where any run looks with `anytime cam`)")  # fmt: skip
    chosen = list(range(model.num_steps)) if steps is None else list(steps)
    bad = [k for k in chosen if not 0 <= k < model.num_steps]
    if bad or not chosen:
        raise AnytimeError(f"--steps {bad or 'none'}: this SACT run has steps 0..{model.num_steps - 1}")
    folder = Path(out) if out is not None else Path(run_dir) / "ponder"
    check_figure_folder(folder, "ponder.npz", kind="ponder maps", given=out is not None)
    x, _, sources, shown = chosen_images(run, images, split, count)
    totals, stages, summary = [], [], []
    for k in chosen:
        halting = model.halting_maps(x, k)
        maps = [h.units.float() for h in halting]  # [N, h, w] per stage ([N, 1, 1] when halting per image)
        totals.append(
            sum(F.interpolate(m[:, None], size=x.shape[-2:], mode="nearest")[:, 0] for m in maps).cpu().numpy()
        )
        stages.append([m.cpu().numpy() for m in maps])
        summary.append(
            StepPonder(k, model.exit_info[k].name, model.thresholds[k], tuple(float(m.mean()) for m in maps))
        )
    with output_lock(folder), staged_files(folder, "ponder maps" if out is not None else None) as work:
        from anytime.plotting.ponder import plot_ponder_maps
        from anytime.utils.io import atomic_path, write_json

        with atomic_path(work / "ponder.npz") as tmp:
            with open(tmp, "wb") as handle:
                per_stage = {f"stage{s}": np.stack([step[s] for step in stages]) for s in range(len(stages[0]))}
                np.savez_compressed(handle, images=shown, steps=np.array(chosen), units=np.stack(totals), **per_stage)
        write_json(work / "ponder.json", {"run": str(run_dir), "model_fingerprint": run.fingerprint, "images": sources,
                                          "units_per_stage": list(model.units_per_stage), "mode": model.mode,
                                          "steps": [asdict(s) for s in summary]})  # fmt: skip
        figures = plot_ponder_maps(shown, np.stack(totals), [s.name for s in summary], work / "ponder", run_title(run_dir),
                                   least=len(model.units_per_stage), most=max(float(np.max(totals)), len(model.units_per_stage) + 1))  # fmt: skip
        written = [work / "ponder.npz", work / "ponder.json", *figures]
    return PonderReport([folder / p.name for p in written], summary)
