"""Ensembles as anytime ladders: fusers on hand-made answers, the step contract, cross-fitting, and an ensemble
run of trained members (one of them int8) through the pipeline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import anytime.tasks.ensemble as ensemble_module
from anytime.calibrate import ExitPolicy
from anytime.cli import main
from anytime.errors import AnytimeError
from anytime.families import EnsembleModel, FitSettings, FuserBank, MemberInfo, cross_fit, fit_fuser, make_fuser
from anytime.families.fusers import fold_assignment
from anytime.outputs.cache import OutputCache, cache_path
from anytime.tasks.ensemble import EnsembleSettings, build_ensemble
from anytime.train import TrainConfig, Trainer
from anytime.train.runs import load_run

FAST = FitSettings(hidden=16, epochs=60)


def _logps(*rows: list[list[float]]) -> torch.Tensor:
    """Members' probabilities (one list of rows per member) as log-probabilities [k, B, C]."""
    return torch.tensor(rows, dtype=torch.float32).log()


def test_vote_takes_the_majority_and_breaks_ties_by_mean_probability():
    vote = make_fuser("vote", 3, 3)
    # sample 0: two members say class 1 though the third is very sure of class 0
    # sample 1: one vote each; class 2 has the highest mean probability
    answers = _logps([[0.1, 0.8, 0.1], [0.5, 0.2, 0.3]], [[0.2, 0.7, 0.1], [0.1, 0.6, 0.3]],
                     [[0.98, 0.01, 0.01], [0.05, 0.05, 0.9]])  # fmt: skip
    fused = vote(answers)
    assert fused.argmax(1).tolist() == [1, 2]
    assert torch.allclose(fused.exp().sum(1), torch.ones(2))
    two = make_fuser("vote", 2, 2)(_logps([[0.9, 0.1]], [[0.4, 0.6]]))  # 1 vote each: 0 has the higher mean (0.65)
    assert two.argmax(1).tolist() == [0]


def test_mean_and_weighted_fusers_average_probabilities():
    answers = _logps([[0.6, 0.4]], [[0.2, 0.8]])
    assert torch.allclose(make_fuser("mean", 2, 2)(answers).exp(), torch.tensor([[0.4, 0.6]]))
    weighted = make_fuser("weighted", 2, 2)
    assert torch.allclose(weighted.weights.sum(), torch.tensor(1.0))
    # member 1 is right on every sample, member 0 is noise: the fit weights move to member 1 and still sum to one
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (400,), generator=generator)
    good = torch.nn.functional.one_hot(labels, 4).float() * 0.7 + 0.075
    noise = torch.rand(400, 4, generator=generator).softmax(1)
    fit_fuser(weighted := make_fuser("weighted", 2, 4), torch.stack([noise, good]).log(), labels, FAST)
    w = weighted.weights.detach()
    assert torch.allclose(w.sum(), torch.tensor(1.0)) and w[1] > 0.8


def test_an_unfitted_mlp_fuser_is_the_geometric_mean():
    answers = torch.randn(3, 5, 10).log_softmax(-1)
    assert torch.allclose(make_fuser("mlp", 3, 10)(answers), answers.mean(dim=0), atol=1e-6)


def test_the_mlp_fuser_gives_a_right_but_soft_member_its_say():
    """A member right on 90% of samples that never says more than 0.4 (as after label smoothing), beside one right
    on 60% at 0.97: a mean of probabilities follows the confident one; the fitted pool follows the right one."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (2000,), generator=generator)

    def member(right: float, top: float) -> torch.Tensor:
        wrong = torch.rand(2000, generator=generator) > right
        said = torch.where(wrong, (labels + torch.randint(1, 4, (2000,), generator=generator)) % 4, labels)
        probs = torch.full((2000, 4), (1 - top) / 3)
        probs[torch.arange(2000), said] = top
        return probs.log()

    logps = torch.stack([member(0.9, 0.4), member(0.6, 0.97)])
    fit, test = slice(0, 1000), slice(1000, 2000)
    fused = fit_fuser(make_fuser("mlp", 2, 4), logps[:, fit], labels[fit], FAST)

    def accuracy(logits: torch.Tensor) -> float:
        return float((logits.argmax(1) == labels[test]).float().mean())

    soft_alone = accuracy(logps[0, test])
    with torch.no_grad():
        assert accuracy(make_fuser("mean", 2, 4)(logps[:, test])) < soft_alone - 0.2
        assert accuracy(fused(logps[:, test])) >= soft_alone - 0.01
    assert fused.weights[0] > 5 * fused.weights[1]
    import warnings

    from anytime.tasks.ensemble import stacking_check

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converged, and nothing for the user's terminal
        val, test_acc = stacking_check(logps[:, fit], labels[fit], logps[:, test], labels[test], folds=5, seed=0)
    assert test_acc >= soft_alone - 0.02 and abs(val - soft_alone) < 0.05  # scikit-learn's stacking agrees


def test_the_mlp_pool_is_solved_on_members_near_chance():
    """Members barely better than chance (briefly trained LeNets on the digits): the solver's line search once tried
    an exponent of e^1212, got a NaN loss and stepped on to infinity."""
    generator = torch.Generator().manual_seed(14)
    labels = torch.randint(0, 10, (115,), generator=generator)
    logits = torch.randn(3, 115, 10, generator=generator) * 0.08
    logits[0, torch.arange(115), labels] += 0.05
    fused = fit_fuser(make_fuser("mlp", 3, 10), logits.log_softmax(-1), labels, FitSettings(epochs=1))
    weights = fused.weights.detach()
    assert bool(torch.isfinite(weights).all()) and float(weights.max()) <= float(np.exp(10)) + 1e-3


def test_cross_fitting_answers_each_sample_with_the_fuser_that_did_not_see_it():
    generator = torch.Generator().manual_seed(0)
    logps = torch.randn(2, 60, 3, generator=generator).log_softmax(-1)
    labels = torch.randint(0, 3, (60,), generator=generator)
    fit = cross_fit("mlp", logps, labels, folds=3, settings=FAST)
    assert np.bincount(fit.folds).tolist() == [20, 20, 20]
    assert len(fit.fusers) == 2 and len(fit.fold_fusers) == 3
    with torch.no_grad():
        for sample in (0, 17, 59):
            fold = int(fit.folds[sample])
            mine = fit.fold_fusers[fold][1](logps[:, sample : sample + 1])
            assert torch.allclose(torch.from_numpy(fit.heldout[1, sample]), mine[0], atol=1e-5)
            others = [f for f in range(3) if f != fold]
            assert not torch.allclose(fit.fold_fusers[others[0]][1](logps[:, sample : sample + 1]), mine)
    with pytest.raises(AnytimeError, match="folds"):
        fold_assignment(10, 1, 0)


def test_cross_fitted_fusers_never_train_on_their_own_fold(monkeypatch):
    seen: list[int] = []
    real = fit_fuser

    def spy(fuser, logps, labels, settings=FitSettings()):
        seen.append(int(labels.numel()))
        return real(fuser, logps, labels, settings)

    monkeypatch.setattr("anytime.families.fusers.fit_fuser", spy)
    logps = torch.randn(2, 50, 3).log_softmax(-1)
    cross_fit("weighted", logps, torch.randint(0, 3, (50,)), folds=5, settings=FAST)
    assert seen == [50, 50] + [40] * 10  # the deployed fusers see all; every fold fuser 4 folds of 5


class _Member(nn.Module):
    """A fixed linear classifier that counts its calls."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(12, 4))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.net(x)


def _ensemble(kind: str = "mlp") -> tuple[EnsembleModel, list[_Member]]:
    members = [_Member(i) for i in range(3)]
    infos = [MemberInfo(f"m{i}", None, 100 * (i + 1), 52) for i in range(3)]
    x = torch.randn(90, 3, 2, 2, generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, 4, (90,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logps = torch.stack([m(x).log_softmax(-1) for m in members])
    fit = cross_fit(kind, logps, labels, folds=3, settings=FAST)
    model = EnsembleModel(members, infos, FuserBank.of(fit.fusers, fit.fold_fusers, torch.from_numpy(fit.folds)))
    return model.eval(), members


def test_step_k_fuses_the_first_k_members_as_by_hand():
    model, members = _ensemble()
    x = torch.randn(7, 3, 2, 2)
    with torch.no_grad():
        all_steps = model(x)
        assert all_steps.shape == (3, 7, 4) and model.num_steps == 3 and model.incremental
        for k in range(3):
            by_hand = model.bank.fusers[k](torch.stack([m(x).log_softmax(-1) for m in members[: k + 1]]))
            assert torch.allclose(model.forward_until(x, k), by_hand, atol=1e-6)
            assert torch.allclose(all_steps[k], by_hand, atol=1e-6)
    assert [e.flops for e in model.exit_info][:2] == [
        100 + model.bank.fusers[0].flops(),
        300 + model.bank.fusers[1].flops(),
    ]
    assert model.exit_info[2].cost_flops == 600 + sum(f.flops() for f in model.bank.fusers)
    with pytest.raises(AnytimeError, match="out of range"):
        model.forward_until(x, 3)


def test_member_k_runs_only_when_step_k_is_asked_for():
    model, members = _ensemble()
    for m in members:
        m.calls = 0
    with torch.no_grad():
        model.forward_until(torch.randn(2, 3, 2, 2), 0)
        assert [m.calls for m in members] == [1, 0, 0]
        steps = model.steps(torch.randn(2, 3, 2, 2))
        next(steps)
        next(steps)
    assert [m.calls for m in members] == [2, 1, 0]


def test_early_exit_over_members_matches_the_fused_steps():
    model, members = _ensemble("weighted")
    x = torch.randn(40, 3, 2, 2, generator=torch.Generator().manual_seed(9))
    policy = ExitPolicy("confidence", (-0.5, -0.5))  # leave when the fused top probability is at least 0.5
    with torch.no_grad():
        steps = model(x)
        out = policy.run(model, x)
        for i in range(len(x)):
            k = int(out.exits[i])
            assert torch.allclose(out.logits[i], steps[k, i], atol=1e-5)
            one = policy.run(model, x[i : i + 1])
            assert int(one.exits[0]) == k
    assert set(out.exits.tolist()) != {2}, "the test needs samples that leave early"


# --- ensemble runs of trained members --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def members(exit_run, tmp_path_factory) -> list[Path]:
    """Three digits runs of different architectures and precisions: a multi-exit ResNet-8, a LeNet and the
    LeNet's int8 form (reference graphs, to keep it fast)."""
    folder = tmp_path_factory.mktemp("members")
    lenet = folder / "lenet"
    Trainer(TrainConfig(model="lenet", data="digits", epochs=3, batch_size=32, lr=0.05, device="cpu"), lenet).fit()
    assert main(["quantize", str(lenet), "--precision", "int8", "--no-compile", "--calibration-images", "64",
                 "--out", str(folder / "lenet-int8")]) == 0  # fmt: skip
    return [exit_run, lenet, folder / "lenet-int8"]


@pytest.fixture(scope="module")
def ensemble_run(members, tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("ensemble") / "E"
    return out, build_ensemble(members, out, EnsembleSettings(order="cost", fuser="mlp", folds=3, fit=FAST))


def test_an_ensemble_run_records_members_fusers_and_caches(ensemble_run, members):
    out, report = ensemble_run
    assert len(report.members) == 3 and {m.precision for m in report.members} == {"fp32", "int8"}
    costs = [m.cost_ms for m in report.members]
    assert costs == sorted(costs)
    assert set(report.test_acc) == {"mlp", "mean", "vote", "weighted"}
    assert report.stacking is not None and all(0 <= a <= 1 for a in report.stacking)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stacking_check"]["test_acc"] == report.stacking[1]
    record = json.loads((out / "config.json").read_text())["ensemble"]
    assert [m["name"] for m in record["members"]] == [m.name for m in report.members]
    resnet = next(m for m in record["members"] if m["name"] == "resnet8")
    assert resnet["step"] == 2  # a multi-exit member answers with its last exit
    run = load_run(out)
    val = OutputCache.load(cache_path(out, "val"))
    assert val.num_steps == 3 and val.meta["cross_fitted"]
    assert np.allclose(val.step_accuracy(), report.val_acc["mlp"])
    assert run.name.startswith("ensemble mlp(")


def test_fusers_are_fit_on_validation_labels_only(members, tmp_path, monkeypatch):
    from anytime.train.splits import run_splits

    fitted_on: list[np.ndarray] = []
    real = ensemble_module.cross_fit

    def spy(kind, logps, labels, **kw):
        fitted_on.append(labels.numpy().copy())
        return real(kind, logps, labels, **kw)

    monkeypatch.setattr(ensemble_module, "cross_fit", spy)
    build_ensemble(members[:2], tmp_path / "E", EnsembleSettings(fuser="weighted", folds=2, fit=FAST, order="given"))
    splits = run_splits(load_run(members[0]))
    assert fitted_on and all(len(f) == len(splits.val) != len(splits.test) for f in fitted_on)


def test_an_ensemble_run_goes_through_the_pipeline(ensemble_run, capsys):
    out, report = ensemble_run
    before = OutputCache.load(cache_path(out, "val")).logits
    assert main(["collect", str(out), "--split", "val"]) == 0
    assert np.allclose(OutputCache.load(cache_path(out, "val")).logits, before, atol=1e-5)  # cross-fitted again
    assert main(["calibrate", str(out), "--max-drop", "2"]) == 0
    assert main(["profile", str(out), "--batch-sizes", "1", "--repeats", "100", "--warmup", "2", "--no-memory"]) == 0
    capsys.readouterr()
    profile = json.loads(next(out.glob("profile-*.json")).read_text())
    assert profile["settings"]["precision"]["members"] == [m.precision for m in report.members]
    assert main(["schedule", str(out), "--deadline-ms", "1000"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"]
    assert main(["evaluate", str(out), "--split", "test", "--latency-samples", "5"]) == 0
    evaluation = json.loads((out / "evaluation-test.json").read_text())
    assert evaluation["agreement_with_cache"]["predictions"] == 1.0 or not (out / "outputs" / "test.npz").exists()


def test_ensemble_refuses_bad_requests_in_one_line(members, ensemble_run, tmp_path, cli_error):
    out, _ = ensemble_run
    a, b, q = (str(m) for m in members)
    cli_error(["ensemble", "--members", a, "--out", str(tmp_path / "E")], "at least two")
    cli_error(["ensemble", "--members", f"{a},{a}", "--out", str(tmp_path / "E")], "twice")
    cli_error(["ensemble", "--members", f"{a},{b}", "--fit-split", "test", "--out", str(tmp_path / "E")], "test split")
    cli_error(["ensemble", "--members", f"{a},{out}", "--out", str(tmp_path / "E")], "itself an ensemble")
    cli_error(["ensemble", "--members", f"{a},{tmp_path / 'none'}", "--out", str(tmp_path / "E")], "no run directory")
    untrained = tmp_path / "untrained"
    shutil.copytree(b, untrained)
    (untrained / "model.safetensors").unlink()
    cli_error(["ensemble", "--members", f"{a},{untrained}", "--out", str(tmp_path / "E")], "has not finished")
    for key, value, words in (("seed", 1, "split their data differently"), ("num_classes", 3, "label sets")):
        other = tmp_path / f"other-{key}"
        shutil.copytree(b, other)
        config = json.loads((other / "config.json").read_text())
        (config["train"] if key == "seed" else config["dataset"])[key] = value
        (other / "config.json").write_text(json.dumps(config))
        cli_error(["ensemble", "--members", f"{a},{other}", "--out", str(tmp_path / "E")], words, str(other))
    assert not (tmp_path / "E").exists()
    with pytest.raises(AnytimeError, match="unknown fuser"):
        build_ensemble([a, b], tmp_path / "E", EnsembleSettings(fuser="stacking"))
    with pytest.raises(AnytimeError, match="unknown order"):
        build_ensemble([a, b], tmp_path / "E", EnsembleSettings(order="random"))
    cli_error(["quantize", str(out), "--precision", "int8", "--out", str(tmp_path / "Q")], "ensemble")


def test_a_member_changed_after_the_build_is_refused(members, tmp_path, cli_error):
    from safetensors.torch import save_file

    from anytime.train.checkpoint import read_weights

    lenet = tmp_path / "lenet"
    shutil.copytree(members[1], lenet)
    build_ensemble([members[0], lenet], tmp_path / "E", EnsembleSettings(fuser="mean", folds=2, order="given"))
    weights = read_weights(lenet / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    save_file(weights, str(lenet / "model.safetensors"))
    cli_error(["collect", str(tmp_path / "E"), "--split", "test"], "changed after the ensemble", str(lenet))


# --- torchensemble baselines -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fusion", "voting", "bagging", "gradient-boosting", "snapshot"])
def test_torchensemble_methods_train_on_the_cpu_and_become_a_ladder_run(method, tmp_path):
    from anytime.tasks.baseline import train_baseline

    config = TrainConfig(model="lenet", data="digits", epochs=2, batch_size=32, lr=0.05, limit_train=300, device="cpu")
    out = tmp_path / method
    report = train_baseline(method, config, estimators=2, out=out, shrinkage=0.5)
    assert report.train_time_s > 0 and report.eval_time_s > 0 and len(report.step_test_acc) == 2
    # the run's last step fuses as torchensemble's own forward does: the same test accuracy
    assert report.step_test_acc[-1] == pytest.approx(report.test_acc, abs=1e-9)
    record = json.loads((out / "config.json").read_text())
    assert record["baseline"]["method"] == method and record["device"] == "cpu"
    run = load_run(out)
    assert run.num_steps == 2 and run.name.startswith(method)
    first, second = (dict(m.named_parameters()) for m in run.model.members)
    assert any(not torch.equal(first[k], second[k]) for k in first), "members must be trained copies of their own"
    with torch.no_grad():
        x = torch.randn(4, 1, 8, 8)
        assert torch.allclose(run.model.forward_until(x, 1), run.model(x)[1], atol=1e-6)


def test_ensemble_baseline_refuses_bad_requests_in_one_line(tmp_path, cli_error):
    base = ["ensemble-baseline", "--model", "lenet", "--out", str(tmp_path / "B")]
    cli_error([*base, "--method", "snapshot", "--estimators", "2", "--epochs", "3"], "multiple of --estimators")
    cli_error([*base, "--method", "voting", "--estimators", "1", "--epochs", "2"], "at least 2 estimators")
    cli_error(
        [*base, "--method", "gradient-boosting", "--estimators", "2", "--epochs", "1", "--shrinkage", "0"],
        "--shrinkage",
    )
    assert not (tmp_path / "B").exists()
    from anytime.tasks.baseline import train_baseline

    with pytest.raises(AnytimeError, match="unknown method"):
        train_baseline("stacking", TrainConfig(), estimators=2, out=tmp_path / "B")


def test_an_ensemble_moved_with_its_members_still_loads(members, tmp_path):
    tree = tmp_path / "tree"
    for member in members[:2]:
        shutil.copytree(member, tree / "members" / member.name)
    build_ensemble([tree / "members" / m.name for m in members[:2]], tree / "E",
                   EnsembleSettings(fuser="mean", folds=2, order="given"))  # fmt: skip
    moved = shutil.move(str(tree), str(tmp_path / "moved"))
    run = load_run(Path(moved) / "E")
    assert run.num_steps == 2


def test_an_mlp_ensemble_from_before_the_pool_is_refused_in_one_line(ensemble_run, tmp_path, cli_error):
    from safetensors.torch import save_file

    from anytime.train.checkpoint import read_weights

    old = tmp_path / "old"
    shutil.copytree(ensemble_run[0], old)
    weights = {k: v for k, v in read_weights(old / "model.safetensors").items() if not k.endswith("log_weights")}
    save_file(weights, str(old / "model.safetensors"))
    cli_error(["collect", str(old), "--split", "test"], "build the ensemble again", "pool")


def test_the_ensemble_command_prints_every_fuser_and_the_scikit_learn_cross_check(members, tmp_path, capsys):
    out = tmp_path / "E"
    assert main(["ensemble", "--members", f"{members[0]},{members[1]}", "--order", "given", "--fuser", "mean",
                 "--folds", "2", "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert all(f"\n{kind}" in printed for kind in ("mlp", "vote", "weighted")) and "mean *" in printed
    assert "scikit-learn cross-check, LogisticRegression on all members: test" in printed
