"""``anytime report RUN``: one self-contained HTML page per run (``RUN/report.html``), figures embedded, no network.

The page reads what the pipeline left in the run folder and draws only the training curves itself; every other
figure is the one ``anytime plot`` made. A section whose inputs are missing says which command fills it, so a run
with no outputs yet still gets a page. Accuracies carry 95% Wilson intervals (a proportion of n test images).
"""

from __future__ import annotations

import base64
import html
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from anytime.errors import AnytimeError
from anytime.train.records import ensemble_record, precision_record, require_run, run_title
from anytime.utils.io import write_text
from anytime.utils.outputs import check_output_file
from anytime.utils.stats import expected_calibration_error, softmax, wilson

REPORT = "report.html"
REPORT_TAG = "anytime-report-v1"  # the page's generator tag: what marks a file anytime may replace
SECTIONS = ("recipe", "training", "steps", "pareto", "reliability", "classes", "calibration", "exits", "latency",
            "deadlines", "precision", "ensemble")  # fmt: skip
_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; margin-bottom: .2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; } .missing { color: #8a5a00; background: #fff6e0; padding: .5em .8em; }
code { background: #f4f4f4; padding: 0 .25em; } .meta { color: #666; }
"""


@dataclass(frozen=True)
class ReportResult:
    """The page written and the sections it could not fill, each with the command that fills it."""

    path: Path
    missing: tuple[str, ...]


class _Page:
    def __init__(self, run: Path) -> None:
        self.run = run
        self.parts: list[str] = []
        self.missing: list[str] = []

    def section(self, key: str, title: str, body: str | None, fill: str | None = None) -> None:
        if body is None:
            body = f'<p class="missing">Not in this run yet: {html.escape(fill or "")}</p>'
            self.missing.append(f"{title}: {fill}")
        self.parts.append(f'<section id="{key}"><h2>{html.escape(title)}</h2>{body}</section>')

    def figure(self, name: str, alt: str) -> str | None:
        path = self.run / "plots" / f"{name}.png"
        if not path.is_file():
            return None
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pct(value: float) -> str:
    return f"{100 * value:.2f}%"


def _interval(correct: int, n: int) -> str:
    lo, hi = wilson(correct, n)
    return f"{100 * correct / n:.2f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def _recipe(page: _Page, config: dict[str, Any]) -> None:
    train = config.get("train", {})
    dataset = config.get("dataset", {})
    machine = config.get("machine") or {}
    rows = [("model", train.get("model")), ("data", f"{dataset.get('name')} ({dataset.get('num_classes')} classes, "
            f"{dataset.get('in_channels')}x{'x'.join(str(s) for s in dataset.get('image_size') or [])})"),
            ("epochs, batch, lr", f"{train.get('epochs')}, {train.get('batch_size')}, {train.get('lr')} ({train.get('schedule')})"),
            ("exits / slices", train.get("exits") or train.get("slices") or "none"),
            ("card", config.get("card") or "none"), ("git SHA", config.get("git_sha")), ("created", config.get("created")),
            ("machine", f"{machine.get('cpu_model')} ({machine.get('cpu_count')} cores, {machine.get('torch_threads')} "
             f"threads), {machine.get('gpu') or 'no GPU'}"), ("torch", machine.get("torch"))]  # fmt: skip
    page.section("recipe", "Recipe and machine", _table(("", "value"), rows))


def _training(page: _Page, title: str) -> None:
    metrics = page.run / "metrics.csv"
    parent = (precision_record(page.run) or {}).get("parent_run")
    if not metrics.is_file() and (parent or ensemble_record(page.run)):
        made = f"converted from {parent} (its report has the curves)" if parent else "assembled from trained members"
        page.section("training", "Training curves", f'<p class="meta">Not trained here: {html.escape(made)}.</p>')
        return
    if not metrics.is_file():
        page.section("training", "Training curves", None, f"train the run (`anytime train --out {page.run}`)")
        return
    try:
        from anytime.plotting import plot_training_curves
    except ImportError:
        page.section("training", "Training curves", None, "install matplotlib (`pip install 'anytime[plot]'`)")
        return
    from anytime.utils.io import read_csv

    with tempfile.TemporaryDirectory() as folder:
        paths = plot_training_curves(read_csv(metrics), title, Path(folder) / "training")
        data = base64.b64encode(next(p for p in paths if p.suffix == ".png").read_bytes()).decode("ascii")
    page.section("training", "Training curves", f'<img alt="training curves" src="data:image/png;base64,{data}">')


def _steps(page: _Page, summary: dict[str, Any] | None) -> None:
    from anytime.outputs import OutputCache

    caches = {split: page.run / "outputs" / f"{split}.npz" for split in ("val", "test")}
    if summary is None:
        page.section("steps", "Steps: accuracy and cost", None, f"finish training (`anytime train --out {page.run}`)")
        return
    exits = summary.get("exits") or [{"index": 0, "name": "model", **summary.get("final", {}), "flops": None}]
    base = summary.get("backbone_flops")
    figures: dict[str, Any] = {}
    for split, path in caches.items():
        if path.is_file():
            try:
                cache = OutputCache.load(path)
            except AnytimeError as exc:  # a damaged cache leaves its column to the summary's figures
                page.missing.append(str(exc))
                continue
            figures[split] = (cache.logits, cache.labels)
    header = ["step", "point", "FLOPs (% of backbone)", "validation [95% CI]", "test [95% CI]", "test ECE"]
    rows = []
    for e in exits:
        k = int(e.get("index", 0))
        cells: list[Any] = [
            f"exit{k}",
            e.get("name"),
            f"{100 * e['flops'] / base:.1f}%" if e.get("flops") and base else "-",
        ]
        for split in ("val", "test"):
            if split in figures and k < figures[split][0].shape[0]:
                logits, labels = figures[split]
                cells.append(_interval(int((logits[k].argmax(axis=1) == labels).sum()), len(labels)))
            else:
                value = e.get(f"{split}_acc")
                cells.append(_pct(value) if value is not None else "-")
        if "test" in figures and k < figures["test"][0].shape[0]:
            ece = expected_calibration_error(softmax(figures["test"][0][k]), figures["test"][1])
            cells.append(f"{100 * ece:.2f}%")
        else:
            cells.append("-")
        rows.append(cells)
    baseline = summary.get("baseline")
    if baseline:
        rows.append(["baseline", baseline["description"], "-",
                     _pct(baseline["val_acc"]) if baseline.get("val_acc") is not None else "-",
                     _pct(baseline["test_acc"]), "-"])  # fmt: skip
    note = _baseline_note(baseline, summary.get("final", {}).get("test_acc"))
    note += "" if figures else (f'<p class="missing">Intervals and calibration error need the cached outputs: '
                               f"<code>anytime collect {page.run} --split val</code> and <code>--split test</code>.</p>")  # fmt: skip
    if not figures:
        page.missing.append(f"intervals: anytime collect {page.run} --split val / test")
    page.section("steps", "Steps: accuracy and cost", _table(header, rows) + note)


def _baseline_note(baseline: dict[str, Any] | None, last_exit: float | None) -> str:
    """A warning when the network's last exit loses to the cheap baseline on test."""
    if not baseline or last_exit is None or last_exit >= baseline["test_acc"]:
        return ""
    gap = 100 * (baseline["test_acc"] - last_exit)
    return (
        f'<p class="missing">The last exit is {gap:.2f} points below the baseline on test: this recipe does '
        "not pay on this data yet (train longer, or choose another recipe).</p>"
    )


def _calibration(page: _Page) -> None:
    report = _json(page.run / "calibration.json")
    if report is None:
        page.section("calibration", "Calibration: validation vs test", None,
                     f"`anytime calibrate {page.run} --max-drop 1` (after `anytime collect`)")  # fmt: skip
        return
    evaluation = _json(page.run / "evaluation-test.json")
    rows = []
    for name, figures in (("validation (fit)", report.get("validation")), ("test (cache)", report.get("test")),
                          ("test (real early exit)", evaluation)):  # fmt: skip
        if isinstance(figures, dict) and "accuracy" in figures:
            rows.append((name, _pct(float(figures["accuracy"])), f"{float(figures.get('flops_ratio', float('nan'))):.3f}",
                         " / ".join(f"{100 * float(s):.1f}" for s in figures.get("exit_share", []))))  # fmt: skip
    policy = report.get("policy", {})
    body = (f"<p>Criterion <code>{html.escape(str(policy.get('criterion')))}</code>, thresholds "
            f"<code>{html.escape(json.dumps(policy.get('thresholds')))}</code>, target "
            f"<code>{html.escape(json.dumps(report.get('target')))}</code>.</p>"
            + _table(("split", "accuracy", "mean FLOPs / backbone", "exit shares (%)"), rows))  # fmt: skip
    if evaluation is None:
        body += f'<p class="meta">Real early exit on the test split: <code>anytime evaluate {page.run}</code>.</p>'
    page.section("calibration", "Calibration: validation vs test", body)


def _latency(page: _Page) -> None:
    profiles = sorted(page.run.glob("profile-*.json"))
    if not profiles:
        page.section("latency", "Latency on the device", None, f"`anytime profile {page.run}`")
        return
    doc = _json(profiles[0]) or {}
    steps = [s.get("name") for s in doc.get("steps", [])]
    meter = doc.get("energy")
    rows = []
    for batch in doc.get("batches", []):
        energy = (batch.get("energy") or {}).get("steps") or [{}] * len(steps)
        for name, summary, joules in zip(steps, batch.get("steps", []), energy):
            row = [
                f"{name}",
                batch.get("batch_size"),
                *(f"{summary.get(k, float('nan')):.3f}" for k in ("p50_ms", "p90_ms", "p99_ms")),
            ]
            if meter:
                row += [
                    f"{1000 * joules.get('mean_j', float('nan')):.4g}",
                    f"{joules.get('power_w', float('nan')):.3g}",
                ]
            rows.append(tuple(row))
    device = doc.get("device", {})
    columns = ("step", "batch", "p50 ms", "p90 ms", "p99 ms") + (("mJ / inference", "power W") if meter else ())
    energy_note = (f" Energy by {html.escape(str(meter.get('reader')))} ({html.escape(str(meter.get('detail')))}), mean of "
                   f"{meter.get('windows')} windows." if meter else " Energy not measured (<code>--energy</code>).")  # fmt: skip
    body = (f"<p>{html.escape(str(device.get('label')))}: <code>{html.escape(profiles[0].name)}</code>, "
            f"{html.escape(str(doc.get('settings', {}).get('repeats')))} repetitions per batch size.{energy_note}</p>"
            + _table(columns, rows))  # fmt: skip
    body += page.figure("latency", "latency distributions") or (
        f'<p class="meta">Distributions: <code>anytime plot {page.run}</code>.</p>'
    )
    if meter:
        body += page.figure("energy", "accuracy vs latency and vs energy") or ""
    page.section("latency", "Latency on the device", body)


def _precision(page: _Page, summary: dict[str, Any] | None) -> None:
    record = precision_record(page.run)
    if record is None:
        page.section("precision", "Precision", '<p class="meta">A float run: <code>anytime quantize '
                     f"{html.escape(str(page.run))} --precision int8</code> makes its int8 form.</p>")  # fmt: skip
        return
    final = (summary or {}).get("final", {})
    rows = [("precision", record.get("precision")), ("backend", record.get("backend")), ("parent run", record.get("parent_run")),
            ("validation (parent)", f"{_pct(final.get('val_acc', float('nan')))} ({_pct(final.get('parent_val_acc', float('nan')))})"),
            ("test (parent)", f"{_pct(final.get('test_acc', float('nan')))} ({_pct(final.get('parent_test_acc', float('nan')))})")]  # fmt: skip
    page.section("precision", "Precision", _table(("", "value"), rows))


def _ensemble(page: _Page) -> None:
    record = ensemble_record(page.run)
    if record is None:
        page.section("ensemble", "Ensemble", '<p class="meta">Not an ensemble run (<code>anytime ensemble</code> '
                     "builds one from trained runs).</p>")  # fmt: skip
        return
    rows = [
        (m.get("name") or m.get("run"), m.get("precision", "fp32"), m.get("run")) for m in record.get("members", [])
    ]
    body = (
        f"<p>Order <code>{html.escape(str(record.get('order')))}</code>, fuser "
        f"<code>{html.escape(str(record.get('fuser')))}</code>.</p>" + _table(("member", "precision", "run"), rows)
    )
    page.section("ensemble", "Ensemble", body)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> ReportResult:
    """Write the run's page (default ``RUN/report.html``, replaced atomically) and return what it lacks."""
    run = Path(run_dir)
    config = require_run(run)
    summary = _json(run / "summary.json")
    target = Path(out) if out else run / REPORT
    if target.suffix != ".html":
        raise AnytimeError(f"the report is an HTML page: give --out a .html file name (got {target})")
    # The run's own page is replaced whatever wrote it (earlier versions did not tag it); a page elsewhere only if tagged.
    target = check_output_file(target, what="report", format_tag=REPORT_TAG if out else None,
                               flag="--out" if out else "", create_parents=False, example=REPORT)  # fmt: skip
    title = run_title(run)
    page = _Page(run)
    _recipe(page, config)
    _training(page, title)
    _steps(page, summary)
    steps = len((summary or {}).get("exits") or [None])
    single = '<p class="meta">One step: this run has no exits to sweep or calibrate.</p>'
    collect = "" if (run / "outputs" / "val.npz").is_file() else f"`anytime collect {run} --split val`, then "
    calibrate = "" if (run / "calibration.json").is_file() else f"`anytime calibrate {run} --max-drop 1`, then "
    profile = "" if any(run.glob("profile-*.json")) else f"`anytime profile {run}`, then "
    if steps > 1:
        page.section("pareto", "Accuracy vs cost (Pareto front)", page.figure("pareto", "Pareto front"),
                     f"{collect}`anytime plot {run}`")  # fmt: skip
        page.section(
            "reliability",
            "Calibration error of each exit (reliability)",
            page.figure("reliability", "reliability diagrams"),
            f"{collect}`anytime plot {run}`",
        )
        page.section("classes", "Accuracy per class and exit", page.figure("class_accuracy", "accuracy per class"),
                     f"{collect}`anytime plot {run}`")  # fmt: skip
        _calibration(page)
        page.section("exits", "Where samples leave (exit histogram)", page.figure("exit_histogram", "exit histogram"),
                     f"{collect}{calibrate}`anytime plot {run}`")  # fmt: skip
    else:
        for key, name in (("pareto", "Accuracy vs cost (Pareto front)"), ("reliability", "Calibration error of each exit"),
                          ("classes", "Accuracy per class and exit"), ("calibration", "Calibration: validation vs test"),
                          ("exits", "Where samples leave (exit histogram)")):  # fmt: skip
            page.section(key, name, single)
    _latency(page)
    page.section("deadlines", "Accuracy vs deadline", page.figure("deadline_accuracy", "accuracy vs deadline"),
                 f"{collect}{profile}`anytime plot {run}`")  # fmt: skip
    _precision(page, summary)
    _ensemble(page)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    document = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="generator" content="{REPORT_TAG}"><title>{html.escape(title)}: anytime '
                f"report</title><style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
                f'<p class="meta">Run <code>{html.escape(str(run))}</code>, page written {now} by <code>anytime report'
                f"</code>.</p>{''.join(page.parts)}</body></html>\n")  # fmt: skip
    write_text(target, document)
    return ReportResult(target, tuple(page.missing))
