"""The multi-exit pipeline on a trained run: collect, sweep, calibrate, real early exit, plots, and the CLI."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from anytime.calibrate import ExitPolicy
from anytime.cli import build_parser, main
from anytime.data import make_loader
from anytime.errors import AnytimeError
from anytime.outputs import OutputCache, cache_path, load_cache
from anytime.tasks.calibration import CalibrationSettings, calibrate_run
from anytime.tasks.collect import collect_run
from anytime.tasks.evaluation import Agreement, EvaluationSettings, evaluate_run
from anytime.tasks.plots import plot_run
from anytime.tasks.profiling import ProfileSettings, profile_run
from anytime.tasks.sweep import sweep_run
from anytime.train import TrainConfig, Trainer, load_splits
from anytime.train.runs import load_run


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_line_error(code, err, *words):
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture(scope="module")
def collected(exit_run, tmp_path_factory):
    """A copy of the trained multi-exit run with both splits collected."""
    run = tmp_path_factory.mktemp("collected") / "run"
    shutil.copytree(exit_run, run)
    for split in ("val", "test"):
        collect_run(run, split)
    return run


def test_collect_caches_every_exit(collected):
    summary = json.loads((collected / "summary.json").read_text())
    for split, key in (("val", "val_acc"), ("test", "test_acc")):
        cache = load_cache(collected, split)
        assert cache.num_steps == 3 and cache.split == split
        assert cache.step_names == ("stages.0", "stages.1", "output")
        assert np.all(np.diff(cache.cost_flops) > 0)
        # the cache agrees with the trainer's own per-exit evaluation
        assert cache.step_accuracy().tolist() == pytest.approx([e[key] for e in summary["exits"]])


def _threshold_splitting(cache: OutputCache) -> ExitPolicy:
    # midway between observed entropies, so that some samples leave at each exit
    from anytime.calibrate import get_criterion

    scores = get_criterion("entropy").score(torch.from_numpy(cache.logits[:-1])).numpy()
    thresholds = []
    for row in scores:
        values = np.unique(row)
        i = len(values) // 3
        thresholds.append(float((values[i] + values[i + 1]) / 2))
    return ExitPolicy("entropy", tuple(thresholds))


def _early_exit_on_test(run_dir: Path, policy: ExitPolicy, batch_size: int) -> tuple[np.ndarray, ...]:
    """Real early exit on the test split (the first 120 images at batch 1): exits, predictions, logits."""
    run = load_run(run_dir)
    splits = load_splits(run.config)
    loader = make_loader(splits.test, splits.info, batch_size=batch_size, train=False, seed=0)
    outs = []
    for x, _ in loader:
        outs.append(policy.run(run.model, x))
        if batch_size == 1 and len(outs) == 120:
            break
    return tuple(torch.cat([getattr(o, name) for o in outs]).numpy() for name in ("exits", "predictions", "logits"))


@pytest.mark.parametrize("batch_size", [1, 7, 128])
def test_real_early_exit_equals_the_cached_sweep(collected, batch_size):
    cache = load_cache(collected, "test")
    policy = _threshold_splitting(cache)
    expected_exits = policy.assign(cache)
    assert len(set(expected_exits.tolist())) == 3  # every exit is used
    expected_pred = cache.logits[expected_exits, np.arange(cache.num_samples)].argmax(axis=1)
    exits_t, preds_t, _ = _early_exit_on_test(collected, policy, batch_size)
    assert np.array_equal(exits_t, expected_exits[: len(exits_t)])
    assert np.array_equal(preds_t, expected_pred[: len(preds_t)])


def test_early_exit_skips_the_rest_of_the_network(collected):
    run = load_run(collected)
    calls = []
    handles = [s.register_forward_hook(lambda m, i, o, k=k: calls.append((k, i[0].shape[0])))
               for k, s in enumerate(run.model.segments)]  # fmt: skip
    x = torch.randn(5, 1, 32, 32)
    try:
        everyone_leaves = ExitPolicy("entropy", (float(np.log(10)), 0.0))
        out = everyone_leaves.run(run.model, x)
    finally:
        for h in handles:
            h.remove()
    assert out.exits.tolist() == [0] * 5
    assert calls == [(0, 5)]  # segments 1 and 2 never ran
    nobody_leaves = ExitPolicy("entropy", (0.0, 0.0)).run(run.model, x)
    with torch.inference_mode():  # a batch that leaves all at one exit is answered by that exit as it is
        for answer, k in ((out, 0), (nobody_leaves, 2)):
            logits = run.model.forward_until(x, k)
            assert answer.exits.tolist() == [k] * 5 and torch.equal(answer.logits, logits)
            assert torch.equal(answer.predictions, logits.argmax(dim=1))


def test_calibration_never_reads_the_test_split(collected, tmp_path):
    first = calibrate_run(collected, CalibrationSettings(max_drop=1.0), out=tmp_path / "a.json")
    test = load_cache(collected, "test")
    rng = np.random.default_rng(0)
    scrambled = OutputCache(rng.normal(size=test.logits.shape).astype(np.float32), test.labels, test.step_names,
                            test.step_flops, test.cost_flops, test.base_flops, "test", test.model_fingerprint)  # fmt: skip
    saved = cache_path(collected, "test").read_bytes()
    try:
        scrambled.save(cache_path(collected, "test"))
        second = calibrate_run(collected, CalibrationSettings(max_drop=1.0), out=tmp_path / "b.json")
        cache_path(collected, "test").unlink()
        third = calibrate_run(collected, CalibrationSettings(max_drop=1.0), out=tmp_path / "c.json")
    finally:
        cache_path(collected, "test").write_bytes(saved)
    assert first.policy.to_dict() == second.policy.to_dict() == third.policy.to_dict()
    assert first.validation == second.validation == third.validation
    assert first.test != second.test and third.test is None
    assert first.validation.accuracy >= first.validation.last_exit_accuracy - 0.01 - 1e-12
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads(json.dumps(first.to_dict()))


def test_a_cache_from_another_model_or_split_is_refused(collected, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(collected, other)
    (other / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes() + b" ")
    with pytest.raises(AnytimeError, match="collected from another model"):
        sweep_run(other, ["entropy"])
    shutil.copy(cache_path(collected, "val"), cache_path(other, "test"))
    with pytest.raises(AnytimeError, match="holds the val split, not test"):
        load_cache(other, "test")
    cache_path(other, "val").write_bytes(b"not a cache")
    with pytest.raises(AnytimeError, match="not a readable outputs cache"):
        load_cache(other, "val")


def test_evaluate_reports_accuracy_agreement_and_latency(collected, capsys):
    calibrate_run(collected, CalibrationSettings(max_drop=1.0))
    # latency timed in chunks of 100
    report = evaluate_run(collected, EvaluationSettings(latency_samples=230), progress=True)
    assert "evaluate test" in capsys.readouterr().err  # the progress bar, on stderr
    assert report.agreement_with_cache == Agreement(exits=1.0, predictions=1.0)
    assert report.samples == 359 and sum(report.exit_share) == pytest.approx(1)
    lat = report.latency
    assert lat is not None and lat.early_exit.count == 230 and lat.backbone.count == 230
    assert lat.early_exit.p99_ms >= lat.early_exit.p50_ms > 0
    assert json.loads((collected / "evaluation-test.json").read_text()) == json.loads(json.dumps(report.to_dict()))


def test_evaluate_an_onnx_export_runs_the_policy_compiled_into_its_graphs(collected, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from anytime.deploy.manifest import EXPORT
    from anytime.tasks.export import ParitySettings, export_run
    from anytime.utils.outputs import DirState, check_replaceable

    calibrate_run(collected, CalibrationSettings(max_drop=1.0))
    export = tmp_path / "onnx"
    export_run(collected, "onnx", ParitySettings(images=100, latency_images=5), out=export)
    code, out, err = _run(capsys, "evaluate", collected, "--export", export, "--latency-samples", 60)
    assert code == 0, err
    assert "the policy compiled into its graphs" in out and "segments" in out and str(export) in out.splitlines()[-1]
    report = json.loads((export / "evaluation-test.json").read_text())
    assert report["compiled_policy"] and report["form"].startswith("export: onnx fp32 (onnxruntime")
    # ONNX Runtime's logits differ from PyTorch's in the last bits: a sample on a threshold may tip
    assert report["agreement_with_cache"]["exits"] >= 0.99 and report["samples"] == 359
    assert report["accuracy"] == pytest.approx(
        evaluate_run(collected, EvaluationSettings(latency_samples=0)).accuracy, abs=0.01
    )
    assert report["latency"]["turn"] == 50 and report["latency"]["early_exit"]["count"] == 60
    # the export keeps counting the evaluation as its own: replacing the export is not refused over it
    assert check_replaceable(export, EXPORT, overwrite=True) is DirState.OURS
    code, _, err = _run(capsys, "evaluate", collected, "--export", export, "--form", "fold")
    _one_line_error(code, err, "--form")
    other = tmp_path / "other"
    shutil.copytree(export, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "parent_fingerprint": "0" * 16}))
    code, _, err = _run(capsys, "evaluate", collected, "--export", other)
    _one_line_error(code, err, "was not exported from", "anytime export")


def test_plots(collected):
    calibrate_run(collected, CalibrationSettings(max_drop=1.0))
    report = plot_run(collected)
    names = {p.name for p in report.paths}
    assert {"pareto.png", "pareto.svg", "threshold.png", "exit_histogram.png", "exit_accuracy.png"} <= names
    assert all(p.stat().st_size > 1000 for p in report.paths)
    assert report.skipped == [
        f"deadline plots: {collected} has no device profile; measure one with `anytime profile {collected}`"
    ]


def test_plots_at_a_papers_column_width_go_beside_the_screen_ones(collected, tmp_path, capsys):
    from PIL import Image

    from anytime.utils.outputs import DirState, check_output_dir

    run = tmp_path / "run"
    shutil.copytree(collected, run)
    calibrate_run(run, CalibrationSettings(max_drop=1.0))
    screen = {p.name for p in plot_run(run).paths}
    code, out, _ = _run(capsys, "plot", run, "--figure-size", "column", "--json")
    assert code == 0
    column = [Path(p) for p in json.loads(out)["paths"]]
    assert {p.name for p in column} == screen and all(p.parent == run / "plots" / "column" for p in column)
    assert all((run / "plots" / name).is_file() for name in screen)  # the screen figures stay
    for path in column:
        if path.suffix == ".png":  # 3.4 in at 150 dpi, give or take what a tight bounding box trims or adds
            assert 430 <= Image.open(path).size[0] <= 580, path.name
    assert check_output_dir(run, "run") is DirState.OURS  # train --overwrite still recognises the whole run
    with pytest.raises(SystemExit) as refused:
        main(["plot", str(run), "--figure-size", "poster"])
    assert refused.value.code == 2 and "invalid choice: 'poster'" in capsys.readouterr().err


def test_the_cli_pipeline(collected, capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(collected, run)
    code, out, _ = _run(capsys, "sweep", run, "--criterion", "entropy", "--criterion", "margin", "--settings", "50")
    assert code == 0 and "oracle" in out and "margin" in out
    rows = (run / "sweep-val.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 50
    code, out, _ = _run(capsys, "calibrate", run, "--budget-flops", "0.6", "--criterion", "confidence")
    assert code == 0 and "validation" in out and "test" in out and "msdnet would give" in out
    report = json.loads((run / "calibration.json").read_text())
    assert report["validation"]["flops_ratio"] <= 0.6 + 1e-9 and report["policy"]["criterion"] == "confidence"
    code, out, _ = _run(capsys, "evaluate", run, "--latency-samples", "10")
    assert code == 0 and "speed-up" in out and "agreement with the cached sweep: exits 100.00%" in out
    code, out, _ = _run(capsys, "plot", run)
    assert code == 0 and "pareto.png" in out


def test_exits_command(capsys):
    code, out, _ = _run(capsys, "exits", "resnet20")
    assert code == 0 and "stages.0.2" in out and "100.0%" in out
    code, out, _ = _run(capsys, "exits", "tv:resnet18", "--exits", "layer2", "--json")
    exits = json.loads(out)["exits"]
    assert [e["name"] for e in exits] == ["layer2", "output"]
    code, out, _ = _run(capsys, "exits", "resnet20", "--points")
    assert code == 0 and "stages.2.1" in out


def test_heads_only_training_keeps_the_backbone(tmp_path, capsys):
    plain = tmp_path / "plain"
    base = TrainConfig(model="lenet", data="digits", epochs=2, batch_size=64, lr=0.05, device="cpu")
    Trainer(base, plain).fit()
    heads = tmp_path / "heads"
    code, out, err = _run(capsys, "train", "--model", "lenet", "--epochs", "2", "--lr", "0.05", "--device", "cpu",
                          "--exits", "auto", "--exit-mode", "heads-only", "--init", plain, "--out", heads,
                          "--no-progress")  # fmt: skip
    assert code == 0, err
    assert "exit 0" in out
    from safetensors.torch import load_file

    before, after = load_file(str(plain / "model.safetensors")), load_file(str(heads / "model.safetensors"))
    for key, value in before.items():
        assert torch.equal(after[f"backbone.{key}"], value), key
    assert "val_acc_exit0" in (heads / "metrics.csv").read_text().splitlines()[0]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["train", "--exits", "stages.9", "--epochs", "1"], ["no exit point named 'stages.9'"]),
        (["train", "--exits", "auto", "--exit-mode", "heads-only", "--epochs", "1"], ["--init"]),
        (["train", "--exit-weights", "1,x", "--exits", "auto"], ["--exit-weights"]),
        (
            ["train", "--model", "resnet20", "--exits", "auto", "--exit-weights", "1,1", "--epochs", "1"],
            ["2 exit weights given for 3 exits"],
        ),
        (["train", "--distill", "0.5", "--epochs", "1"], ["needs --exits"]),
        (["exits", "resnet21"], ["unknown model 'resnet21'", "resnet20"]),
        (["exits", "resnet20", "--exits", "1.5"], ["fractions"]),
    ],
)
def test_bad_input_is_one_line(capsys, tmp_path, argv, words):
    code, _, err = _run(capsys, *argv, *(["--out", tmp_path / "r"] if argv[0] == "train" else []))
    _one_line_error(code, err, *words)


def test_bad_init_is_one_line(capsys, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"junk")
    code, _, err = _run(capsys, "train", "--exits", "auto", "--init", junk, "--out", tmp_path / "r", "--epochs", "1")
    _one_line_error(code, err, "--init", "junk.pt")


def test_pipeline_errors_are_one_line(capsys, tmp_path, exit_run, collected):
    code, _, err = _run(capsys, "sweep", tmp_path / "nowhere")
    _one_line_error(code, err, "no run directory")
    fresh = tmp_path / "fresh"
    shutil.copytree(exit_run, fresh, ignore=shutil.ignore_patterns("outputs", "calibration.json"))
    code, _, err = _run(capsys, "calibrate", fresh, "--max-drop", "1")
    _one_line_error(code, err, "anytime collect")
    with pytest.raises(SystemExit) as refused:  # refused by the argument parser
        _run(capsys, "calibrate", collected, "--max-drop", "nan")
    assert refused.value.code == 2 and "finite" in capsys.readouterr().err
    code, _, err = _run(capsys, "evaluate", fresh)
    _one_line_error(code, err, "no calibration")
    other = tmp_path / "other.json"
    calibrate_run(collected, CalibrationSettings(max_drop=1.0), out=other)
    report = json.loads(other.read_text())
    report["model_fingerprint"] = "0" * 16
    other.write_text(json.dumps(report))
    code, _, err = _run(capsys, "evaluate", collected, "--calibration", other)
    _one_line_error(code, err, "fit on another model")
    calibrate_run(collected, CalibrationSettings(max_drop=1.0), out=other)
    for bad, words in (
        ([float("nan"), 0.5], ["finite"]),
        ([0.5, 7.0], ["outside", "entropy"]),
        ([0.5], ["thresholds"]),
    ):
        report = json.loads(other.read_text())
        report["policy"]["thresholds"] = bad
        other.write_text(json.dumps(report))
        code, _, err = _run(capsys, "evaluate", collected, "--calibration", other, "--latency-samples", "0")
        _one_line_error(code, err, *words)
    with pytest.raises(SystemExit) as refused:
        _run(capsys, "sweep", collected, "--criterion", "perplexity")
    assert refused.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_a_plain_run_has_no_exits_to_collect(tmp_path, capsys):
    plain = tmp_path / "plain"
    Trainer(TrainConfig(model="lenet", data="digits", epochs=1, device="cpu"), plain).fit()
    code, _, err = _run(capsys, "collect", plain)
    _one_line_error(code, err, "plain model", "--exits")


def test_cli_choices_match_the_library():
    from anytime.calibrate import CRITERIA, RULES
    from anytime.commands.options import CRITERIA as _CRITERIA
    from anytime.families import GRADED, HEADS
    from anytime.train.config import EXIT_MODES

    assert tuple(_CRITERIA) == CRITERIA
    parsers = [p for sub in build_parser()._subparsers._group_actions for p in sub.choices.values()]  # noqa: SLF001
    actions = {a.dest: a for p in parsers for a in p._actions}
    assert tuple(actions["exit_mode"].choices) == EXIT_MODES
    head_helps = [a.help for p in parsers for a in p._actions if a.dest == "exit_head"]
    assert len(head_helps) == 2  # train and exits: heads are lists, so their help names every kind
    assert all(re.search(rf"\b{kind}\b", text) for text in head_helps for kind in (*HEADS, GRADED))
    assert tuple(actions["rule"].choices) == RULES


def test_calibrate_selects_exits_costed_by_the_profile(collected, tmp_path, capsys):
    from anytime.tasks.profiling import ProfileSettings, profile_run

    profile_path = tmp_path / "profile.json"
    profile_run(collected, ProfileSettings(batch_sizes=(1,), repeats=20, warmup=2, memory=False), out=profile_path)
    out = tmp_path / "calibration-selected.json"
    report = calibrate_run(collected, CalibrationSettings(max_drop=1.0, select=True), profile=profile_path, out=out)
    selection = report.selection
    assert selection is not None and {s.exits for s in selection.subsets} == {(), (0,), (1,), (0, 1)}
    best = min(selection.subsets, key=lambda s: s.mean_ms)
    assert selection.exits == best.exits and best.reaches_target
    assert tuple(k for k, t in enumerate(report.policy.thresholds) if t is not None) == selection.exits
    assert selection.test_speedup is not None and selection.test_speedup > 0
    assert report.calibration.rule == "max-drop-select" and len(selection.subsets) == 4
    code, stdout, _ = _run(capsys, "calibrate", collected, "--max-drop", "1", "--select-exits", "--profile", profile_path,
                           "--out", tmp_path / "c2.json")  # fmt: skip
    assert code == 0 and "kept exits" in stdout and "exit subsets" in stdout
    code, _, err = _run(capsys, "calibrate", collected, "--budget-flops", "0.5", "--select-exits", "--out",
                        tmp_path / "c3.json")  # fmt: skip
    _one_line_error(code, err, "--select-exits", "--max-drop")


def _combining(val: OutputCache, test: OutputCache, members=None) -> ExitPolicy:
    from anytime.calibrate.combine import fit_weights

    weights = fit_weights(torch.from_numpy(val.logits), torch.from_numpy(val.labels), members=members)
    thresholds = _threshold_splitting(ExitPolicy("entropy", (None, None), combine=weights).seen_by(test)).thresholds
    return ExitPolicy("entropy", thresholds, combine=weights)


@pytest.mark.parametrize("batch_size", [1, 7, 128])
def test_real_early_exit_with_combined_exits_equals_the_cached_sweep(collected, batch_size):
    cache = load_cache(collected, "test")
    policy = _combining(load_cache(collected, "val"), cache)
    assert policy.combine[1][0] > 0 and policy.combine[2][1] > 0  # the fit did weigh earlier exits
    expected_exits = policy.assign(cache)
    assert len(set(expected_exits.tolist())) == 3
    seen = policy.seen_by(cache)
    expected_pred = seen.logits[expected_exits, np.arange(cache.num_samples)].argmax(axis=1)
    assert not np.array_equal(expected_pred, cache.logits[expected_exits, np.arange(cache.num_samples)].argmax(axis=1))
    exits_t, preds_t, logits_t = _early_exit_on_test(collected, policy, batch_size)
    assert np.array_equal(exits_t, expected_exits[: len(exits_t)])
    assert np.array_equal(preds_t, expected_pred[: len(preds_t)])
    answered = seen.logits[expected_exits, np.arange(cache.num_samples)][: len(exits_t)]
    assert np.allclose(logits_t, answered, atol=1e-4)  # the combined answer, not the exit's own


def _head_calls(model, policy, x):
    calls = []
    handles = [h.register_forward_hook(lambda m, i, o, k=k: calls.append(k)) for k, h in enumerate(model.heads)]
    try:
        policy.run(model, x)
    finally:
        for h in handles:
            h.remove()
    return calls


def test_a_combined_head_runs_where_nobody_leaves_and_an_unweighted_one_does_not(collected):
    run = load_run(collected)
    x = torch.randn(4, 1, 32, 32)
    weighed = ExitPolicy("entropy", (None, None), combine=((1.0,), (0.5, 1.0), (0.3, 0.2, 1.0)))
    assert weighed.runs_head(0) and _head_calls(run.model, weighed, x) == [0, 1]
    assert _head_calls(run.model, weighed, x[:1]) == [0, 1]
    unweighed = ExitPolicy("entropy", (None, None), combine=((0.0,), (0.0, 0.0), (0.0, 0.0, 1.0)))
    assert not unweighed.runs_head(0) and _head_calls(run.model, unweighed, x) == []
    step, cost = torch.tensor([10.0, 20.0, 30.0]), torch.tensor([10.0, 22.0, 35.0])  # heads 2 and 3
    assert weighed.leave_costs(step, cost).tolist() == [10.0, 22.0, 35.0]
    assert unweighed.leave_costs(step, cost).tolist() == [8.0, 17.0, 30.0]  # the backbone alone


def test_calibrate_combine_exits_from_the_cli_then_evaluate(collected, capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(collected, run)
    code, out, err = _run(capsys, "calibrate", run, "--max-drop", "1", "--combine-exits")
    assert code == 0, err
    assert "combining exits with weights" in out
    report = json.loads((run / "calibration.json").read_text())
    assert report["policy"]["combine"] is not None and len(report["combined_steps"]) == 3
    assert report["validation"]["accuracy"] >= report["validation"]["last_exit_accuracy"] - 0.01 - 1e-12
    evaluation = evaluate_run(run, EvaluationSettings(latency_samples=0))
    assert evaluation.agreement_with_cache == Agreement(exits=1.0, predictions=1.0)
    assert evaluation.accuracy == pytest.approx(report["test"]["accuracy"])
    code, out, err = _run(capsys, "calibrate", run, "--max-drop", "1", "--combine-exits", "--temperature")
    _one_line_error(code, err, "--combine-exits", "--temperature")


def test_a_learned_policy_from_the_cli_through_evaluation_sweeps_and_the_runtime(collected, capsys, tmp_path):
    from anytime.calibrate.gates import GATE_FEATURES
    from anytime.data.augment import normalize
    from anytime.scheduler.runs import runner_for_run
    from anytime.train.splits import run_splits

    run = tmp_path / "run"
    shutil.copytree(collected, run)
    code, out, err = _run(capsys, "calibrate", run, "--max-drop", "1", "--criterion", "learned")
    assert code == 0, err
    report = json.loads((run / "calibration.json").read_text())
    assert report["policy"]["criterion"] == "learned" and report["policy"]["gates"]["features"] == list(GATE_FEATURES)
    evaluation = evaluate_run(run, EvaluationSettings(latency_samples=0))
    assert evaluation.agreement_with_cache == Agreement(exits=1.0, predictions=1.0)
    assert evaluation.accuracy == pytest.approx(report["test"]["accuracy"])
    code, out, err = _run(capsys, "sweep", run, "--split", "test", "--criterion", "learned", "--json")
    assert code == 0, err
    profile_run(run, ProfileSettings(batch_sizes=(1, 4), repeats=5, warmup=1, memory=False))
    runner, loaded = runner_for_run(run, quantile=0.5)
    assert runner.policy is not None and runner.policy.criterion == "learned"
    test = load_cache(run, "test")
    assigned = runner.policy.assign(test)
    images = run_splits(loaded).test.images[:24]
    x = normalize(images, loaded.dataset["mean"], loaded.dataset["std"])
    for i in range(24):  # a deadline nothing misses: the policy answers, as offline
        out = runner.predict(x[i : i + 1], 1e6)
        assert out.option == "policy" and out.exits.tolist() == [int(assigned[i])]
    assert runner.predict(x[:4], 1e6).exits.tolist() == assigned[:4].tolist()
