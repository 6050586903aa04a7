"""Split computing for a finished run: its validation tables, its plan, its server and its device."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from anytime.errors import AnytimeError
from anytime.profile.store import DeviceProfile
from anytime.split.plan import Link, PlanSettings, SplitPlan, SplitPlanner
from anytime.split.tables import SplitTables, compute_tables, load_tables, tables_path

if TYPE_CHECKING:
    from anytime.train.folder import RunFolder


def _segmented(model: Any, run_dir: str | Path) -> None:
    segments = getattr(model, "segments", None)
    if not isinstance(segments, (tuple, list)) or len(segments) < 2 or getattr(model, "heads", None) is None:
        raise AnytimeError(f"{run_dir} has no exits to split at: split computing needs a run with exits "
                           "(anytime train --exits) or an ensemble (anytime ensemble)")  # fmt: skip


def split_tables(
    run_dir: RunFolder | str | Path, codecs: tuple[str, ...], *, device: str = "cpu", batch_size: int = 256
) -> SplitTables:
    """The run's split tables with at least ``codecs``: read from ``RUN/outputs/split-val.npz``, or computed from
    the validation split (one pass per partition point and codec) and saved there."""
    from anytime.data import make_loader
    from anytime.families import EnsembleModel
    from anytime.train.folder import open_run
    from anytime.train.runs import require_images
    from anytime.train.splits import run_splits
    from anytime.utils.outputs import check_output_file, output_lock

    opened = open_run(run_dir)
    run_dir, fingerprint = opened.path, opened.fingerprint
    tables = load_tables(run_dir, fingerprint)
    if tables is not None and all(c in tables.codecs for c in codecs):
        return tables
    run = opened.load(device)
    require_images(run, "split computing")
    _segmented(run.model, run_dir)
    if isinstance(run.model, EnsembleModel) and any(c != "fp32" for c in codecs):
        raise AnytimeError("an ensemble's validation answers are cross-fitted, so a compressed activation's effect "
                           "cannot be measured on them; plan an ensemble with --codecs fp32")  # fmt: skip
    wanted = tuple(dict.fromkeys(("fp32", *(tables.codecs if tables else ()), *codecs)))
    if all(c == "fp32" for c in wanted):
        from anytime.outputs import load_cache

        return _fp32_only(run.model, load_cache(run_dir, "val", fingerprint=fingerprint), run_dir)
    target = check_output_file(tables_path(run_dir), what="split tables", flag="")
    with output_lock(target):
        from anytime.outputs import load_cache

        cache = load_cache(run_dir, "val", fingerprint=fingerprint)
        splits = run_splits(run)
        loader = make_loader(splits.val, splits.info, batch_size=batch_size, train=False, seed=run.config.seed)
        batches = ((x.to(run.device), y) for x, y in loader)
        tables = compute_tables(run.model, batches, cache, wanted)
        tables.save(target)
    return tables


def _fp32_only(model: Any, cache: Any, run_dir: str | Path) -> SplitTables:
    """Tables for fp32 alone need no pass over the data, only each partition's activation shape."""
    import torch

    from anytime.train.runs import run_config

    _, dataset = run_config(run_dir)
    size = dataset.get("image_size") or [32, 32]
    shape = (int(dataset["in_channels"]), int(size[0]), int(size[1]))
    shapes: dict[int, tuple[int, ...]] = {-1: shape}
    segments = list(model.segments)
    with torch.inference_mode():
        h = torch.zeros(1, *shape, device=next(iter(model.parameters())).device)
        for k, segment in enumerate(segments[:-1]):
            h = segment(h)
            shapes[k] = tuple(int(s) for s in h.shape[1:])
    return SplitTables(cache, shapes, {}, ("fp32",))


def load_profile_pair(device_profile: str | Path, server_profile: str | Path) -> tuple[DeviceProfile, DeviceProfile]:
    """Both profiles, each checked as a profile; whether they fit the run is the planner's check."""
    return DeviceProfile.load(device_profile), DeviceProfile.load(server_profile)


def parse_partitions(text: str | None, num_steps: int) -> list[int] | None:
    """``server,1,device`` -> [-1, 1, K-1]; None: every partition."""
    if text is None:
        return None
    named = {"server": -1, "device": num_steps - 1}
    out = []
    for item in (t.strip() for t in text.split(",")):
        if item in named:
            out.append(named[item])
        elif item.lstrip("-").isdigit() and -1 <= int(item) < num_steps:
            out.append(int(item))
        else:
            raise AnytimeError(f"--partitions item {item!r} is not server, device or an exit 0..{num_steps - 1}")
    return out


def planner_for_run(run_dir: str | Path, device_profile: str | Path, server_profile: str | Path,
                    settings: PlanSettings | None = None, *, device: str = "cpu") -> SplitPlanner:  # fmt: skip
    """A planner over the run's validation tables and the two machines' profiles (refused when either profile
    is of another model, or they are of different models), for the codecs, criterion and partitions of
    ``settings`` (default :class:`PlanSettings`; partitions as :func:`parse_partitions` reads)."""
    from anytime.scheduler.query import run_fingerprint

    settings = settings or PlanSettings()
    fingerprint = run_fingerprint(run_dir)
    dev, srv = load_profile_pair(device_profile, server_profile)
    for profile, path in ((dev, device_profile), (srv, server_profile)):
        profile.check_model(fingerprint, where=str(path))
    if dev.model_fingerprint != srv.model_fingerprint:
        raise AnytimeError(f"{device_profile} and {server_profile} were measured on different models; profile "
                           f"{run_dir} on both machines")  # fmt: skip
    tables = split_tables(run_dir, settings.codecs, device=device)
    chosen = parse_partitions(settings.partitions, tables.num_steps)
    return SplitPlanner(tables, dev, srv, criterion=settings.criterion, codecs=settings.codecs, partitions=chosen)


def plan_run(run_dir: str | Path, device_profile: str | Path, server_profile: str | Path, link: Link,
             deadline_ms: float, settings: PlanSettings | None = None) -> SplitPlan:  # fmt: skip
    """``anytime split``: the plan for one link and deadline, as ``settings`` say (default :class:`PlanSettings`)."""
    settings = settings or PlanSettings()
    planner = planner_for_run(run_dir, device_profile, server_profile, settings)
    return planner.plan(link, deadline_ms, settings.quantile)
