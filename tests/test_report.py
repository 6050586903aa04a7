"""`anytime report RUN`: the page of a run with nothing yet, and of a run through the pipeline, opened in headless
Chromium (skipped with the reason where Chromium is not installed; `.ci/run` installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from anytime.cli import main
from anytime.tasks.report import SECTIONS

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# No background traffic: the machine's network is closed, and every refused connection would be logged.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0"]  # fmt: skip


def test_a_run_with_nothing_yet_gets_a_page_that_names_the_command_for_each_section(exit_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(exit_run, run)
    assert main(["report", str(run), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    page = (run / "report.html").read_text()
    assert answer["report"] == str(run / "report.html")
    for key in SECTIONS:
        assert f'id="{key}"' in page
    missing = " ".join(answer["missing"])
    for command in (
        f"anytime collect {run}",
        f"anytime calibrate {run}",
        f"anytime profile {run}",
        f"anytime plot {run}",
    ):
        assert command in missing and command in page
    assert "http://" not in page and "https://" not in page  # self-contained
    assert "<td>baseline</td>" in page and "logistic regression on the pixels" in page
    from anytime.utils.outputs import RUN, check_replaceable

    check_replaceable(run, RUN, overwrite=True)  # the page is the run's own: `anytime train --overwrite` may replace it


def test_report_refuses_bad_input_in_one_line(tmp_path, cli_error, exit_run):
    cli_error(["report", str(tmp_path)], "not a run")
    cli_error(["report", str(exit_run), "--out", str(tmp_path / "page.txt")], ".html")


def test_report_never_replaces_a_users_page_and_writes_through_a_link(exit_run, tmp_path, cli_error):
    mine = tmp_path / "my.html"
    mine.write_text("<!DOCTYPE html><p>my own notes</p>")
    cli_error(["report", str(exit_run), "--out", str(mine)], "not an anytime report", "never overwrites")
    assert mine.read_text() == "<!DOCTYPE html><p>my own notes</p>"
    page = tmp_path / "page.html"
    assert main(["report", str(exit_run), "--out", str(page)]) == 0
    assert main(["report", str(exit_run), "--out", str(page)]) == 0  # its own page, replaced
    link = tmp_path / "link.html"
    link.symlink_to(page)
    assert main(["report", str(exit_run), "--out", str(link)]) == 0
    assert link.is_symlink() and link.resolve() == page.resolve()  # the link kept, the page it names rewritten


@pytest.mark.parametrize("damage", ["truncated", "object array"])
def test_report_on_a_damaged_outputs_cache_says_so_without_a_traceback(exit_run, tmp_path, capsys, damage):
    import numpy as np

    from anytime.tasks.collect import collect_run

    run = tmp_path / "run"
    shutil.copytree(exit_run, run)
    cache = collect_run(run, "val")
    path = run / "outputs" / "val.npz"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    else:
        np.savez(path, logits=np.array([{"a": 1}], dtype=object), labels=np.zeros(3))
    assert main(["report", str(run)]) == 0, cache
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert "collect it again" in (run / "report.html").read_text() or "collect it again" in captured.out


def test_the_page_of_a_profiled_run_opens_in_chromium_with_every_section(exit_run, tmp_path):
    from anytime.tasks.calibration import CalibrationSettings, calibrate_run
    from anytime.tasks.collect import collect_run
    from anytime.tasks.evaluation import EvaluationSettings, evaluate_run
    from anytime.tasks.plots import plot_run
    from anytime.tasks.profiling import ProfileSettings, profile_run

    run = tmp_path / "run"
    shutil.copytree(exit_run, run)
    for split in ("val", "test"):
        collect_run(run, split)
    calibrate_run(run, CalibrationSettings(max_drop=1.0))
    evaluate_run(run, EvaluationSettings(split="test", latency_samples=0))
    profile_run(run, ProfileSettings(batch_sizes=(1,), repeats=100, warmup=2, memory=False))
    plot_run(run)
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert (
        page.count("data:image/png;base64,") == 7
    )  # training, Pareto, reliability, classes, histogram, latency, deadlines and "Not in this run yet" not in page
    assert re.search(r"\d+\.\d\d% \[\d+\.\d, \d+\.\d\]", page)  # accuracies with their intervals
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install chromium; .ci/run installs it)")
    profile = ["--user-data-dir=" + str(tmp_path / "chromium")]
    dom = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, *profile, "--dump-dom", (run / "report.html").as_uri()],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert dom.returncode == 0, dom.stderr[-1000:]
    for key in SECTIONS:
        assert f'id="{key}"' in dom.stdout, key
    assert "CONSOLE" not in dom.stderr, [line for line in dom.stderr.splitlines() if "CONSOLE" in line]
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, *profile, "--window-size=1100,3000", f"--screenshot={shot}",
                    (run / "report.html").as_uri()], capture_output=True, timeout=120, check=True)  # fmt: skip
    assert shot.stat().st_size > 50_000  # a page with figures, not a blank one
