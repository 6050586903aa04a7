"""The trainer: learning, instrumentation, checkpoints, exact resume, and refusals."""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from anytime.backbones import create_model
from anytime.data import load_dataset, make_loader
from anytime.errors import AnytimeError
from anytime.train import EpochEnd, TrainConfig, Trainer, load_checkpoint, load_weights, lr_factor, save_checkpoint
from anytime.train.recipe import weight_average
from anytime.train.timing import PhaseLog


def _metrics(run_dir):
    with open(run_dir / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_loss_falls_on_digits_within_a_few_dozen_steps():
    splits = load_dataset("digits", seed=0)
    torch.manual_seed(0)
    model = create_model("resnet20", num_classes=10, in_channels=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = make_loader(splits.train, splits.info, batch_size=32, train=True, seed=0)
    losses = []
    for step, (images, labels) in enumerate(loader):
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == 35:
            break
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5


def test_run_directory_holds_every_record(tmp_path, tiny_config):
    summary = Trainer(tiny_config, tmp_path).fit()
    for name in ("config.json", "metrics.csv", "iterations.csv", "checkpoint.pt", "model.safetensors", "summary.json"):
        assert (tmp_path / name).is_file(), name
    rows = _metrics(tmp_path)
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    assert summary.val_acc > 0.5 and summary.to_dict() == json.loads((tmp_path / "summary.json").read_text())
    for r in rows:
        phases = sum(float(r[f"{p}_s"]) for p in ("data", "forward", "backward", "step"))
        assert 0 < phases <= float(r["train_s"]) * 1.01
        assert float(r["peak_rss_mb"]) > 50
    steps = -(-len(load_dataset("digits").train) // 32)
    with open(tmp_path / "iterations.csv", newline="") as handle:
        iterations = list(csv.DictReader(handle))
    assert len(iterations) == 3 * steps
    assert summary.record["timing"]["epoch0"]["iterations"] == steps
    assert summary.record["timing"]["steady"]["iterations"] == 2 * steps


FAST_RECIPE = {"schedule": "onecycle", "warmup": 0.3, "ema": 0.9, "label_smoothing": 0.1, "augment": "none",
               "nesterov": True}  # fmt: skip


NORM_BIAS_RECIPE = {"model": "resnet8", "limit_train": 512, "batch_size": 128, "norm_bias_lr_scale": 8.0,
                    "schedule": "onecycle"}  # fmt: skip


@pytest.mark.parametrize("recipe", [{}, FAST_RECIPE, NORM_BIAS_RECIPE], ids=["plain", "fast", "norm-bias-lr"])
def test_resume_ends_where_an_uninterrupted_run_ends(tmp_path, tiny_config, recipe):
    tiny_config = tiny_config.replace(**recipe)
    whole = tmp_path / "whole"
    Trainer(tiny_config, whole).fit()

    class Interrupt(Exception):
        pass

    def stop_after_second_epoch(end: EpochEnd) -> None:
        if end.epoch == 1:
            raise Interrupt

    broken = tmp_path / "broken"
    with pytest.raises(Interrupt):
        Trainer(tiny_config, broken, on_epoch_end=stop_after_second_epoch).fit()
    assert len(_metrics(broken)) == 2
    assert not (broken / "summary.json").exists()
    summary = Trainer(tiny_config, broken).fit(resume=True)

    for a, b in zip(_metrics(whole), _metrics(broken), strict=True):
        for column in ("epoch", "lr", "train_loss", "train_acc", "val_loss", "val_acc"):
            assert a[column] == b[column], column
    weights_a = load_file(str(whole / "model.safetensors"))
    weights_b = load_file(str(broken / "model.safetensors"))
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        assert torch.equal(weights_a[key], weights_b[key]), key
    assert summary.test_acc == Trainer(tiny_config, whole).fit(resume=True).test_acc


def test_resume_refuses_a_different_recipe(tmp_path, tiny_config):
    Trainer(tiny_config, tmp_path).fit()
    with pytest.raises(AnytimeError, match="lr"):
        Trainer(tiny_config.replace(lr=0.1), tmp_path).fit(resume=True)


def test_a_finished_run_is_not_overwritten(tmp_path, tiny_config):
    Trainer(tiny_config.replace(epochs=1), tmp_path).fit()
    with pytest.raises(AnytimeError, match="--resume"):
        Trainer(tiny_config.replace(epochs=1), tmp_path).fit()


def test_checkpoint_loads_weights_only(tmp_path, tiny_config):
    Trainer(tiny_config.replace(epochs=1), tmp_path).fit()
    raw = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert raw["epoch"] == 0
    model = create_model("lenet", num_classes=10, in_channels=1)
    load_weights(model, tmp_path / "checkpoint.pt")
    load_weights(model, tmp_path / "model.safetensors")


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    evil = _Evil()
    evil.marker = marker
    path = tmp_path / "evil.pt"
    torch.save({"format": "anytime-checkpoint-v1", "model": evil}, path)
    with pytest.raises(AnytimeError, match="holds code, not only weights .* unless you trust its source"):
        load_checkpoint(path)
    assert not marker.exists()


def test_not_a_checkpoint(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a checkpoint")
    with pytest.raises(AnytimeError, match="junk.pt"):
        load_checkpoint(junk)
    with pytest.raises(AnytimeError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(2)}, other)
    with pytest.raises(AnytimeError, match="not an anytime checkpoint"):
        load_checkpoint(other)


def test_weights_of_another_model_are_refused(tmp_path, tiny_config):
    Trainer(tiny_config.replace(epochs=1), tmp_path).fit()
    with pytest.raises(AnytimeError, match="do not fit"):
        load_weights(create_model("resnet20", num_classes=10, in_channels=1), tmp_path / "model.safetensors")


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"epoch": 1})

    def failing_save(obj, f, *args, **kwargs):
        with open(f, "wb") as handle:
            handle.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(AnytimeError, match=f"could not write {path} "):
        save_checkpoint(path, {"epoch": 2})
    monkeypatch.undo()
    assert load_checkpoint(path)["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lr": float("nan")}, "learning rate"),
        ({"lr": -1.0}, "learning rate"),
        ({"epochs": 0}, "epochs"),
        ({"schedule": "linear"}, "schedule"),
        ({"val_fraction": 1.5}, "validation"),
        ({"exit_mode": "frozen", "exits": "auto"}, "unknown exit mode"),
        ({"exit_head": "mlp", "exits": "auto"}, "unknown exit head"),
        ({"exit_head": "conv2,mlp", "exits": "auto"}, "unknown exit head 'conv2,mlp'.*one per early exit"),
        ({"exit_weights": (1.0, float("nan")), "exits": "auto"}, "exit weights"),
        ({"exit_weights": (1.0, 1.0)}, "exit weights need --exits"),
        ({"distill": -1.0, "exits": "auto"}, "distillation weight"),
        ({"distill_temperature": 0.0, "exits": "auto"}, "temperature"),
        ({"distill_teacher": "first", "exits": "auto", "distill": 1.0}, "unknown distillation teacher 'first'"),
        ({"distill_teacher": "later", "exits": "auto"}, "--distill-teacher later .* needs a weight"),
        ({"augment": "rotate"}, "unknown augmentation 'rotate'"),
        ({"padding": -2}, "padding"),
        ({"cutout": -1}, "cutout is the side of a square"),
        ({"label_smoothing": 1.0}, "label smoothing"),
        ({"warmup": 1.0}, "warm-up"),
        ({"ema": 1.0}, "--ema is a decay per step"),
        ({"amp": "fp8"}, "unknown --amp"),
        ({"norm_bias_lr_scale": 0.0}, "--norm-bias-lr-scale"),
        ({"gradient_equilibrium": True}, "--gradient-equilibrium .* needs --exits"),
    ],
)
def test_config_refuses_bad_values(changes, message):
    with pytest.raises(AnytimeError, match=message):
        TrainConfig(**changes)


def test_config_from_dict_refuses_unknown_and_mistyped_keys():
    with pytest.raises(AnytimeError, match="unknown setting"):
        TrainConfig.from_dict({"learning_rate": 0.1})
    with pytest.raises(AnytimeError, match="epochs must be int"):
        TrainConfig.from_dict({"epochs": "ten"})
    assert TrainConfig.from_dict(TrainConfig().to_dict()) == TrainConfig()


def test_lr_schedules():
    cosine = TrainConfig(epochs=4, schedule="cosine")
    assert [lr_factor(cosine, e) for e in range(4)] == pytest.approx([1.0, 0.853553, 0.5, 0.146447], rel=1e-5)
    step = TrainConfig(epochs=4, schedule="step")
    assert [lr_factor(step, e) for e in range(4)] == pytest.approx([1.0, 1.0, 0.1, 0.01])
    assert lr_factor(TrainConfig(schedule="constant"), 7) == 1.0
    onecycle = TrainConfig(epochs=10, schedule="onecycle", warmup=0.2)
    assert [lr_factor(onecycle, e, f) for e, f in [(0, 0.0), (1, 0.0), (2, 0.0), (6, 0.0), (9, 1.0)]] == pytest.approx(
        [0.0, 0.5, 1.0, 0.5, 0.0]
    )
    warm_cosine = TrainConfig(epochs=10, schedule="cosine", warmup=0.1)
    assert lr_factor(warm_cosine, 0, 0.5) == pytest.approx(0.5)  # half-way up the ramp, cosine still at 1
    assert lr_factor(warm_cosine, 1, 0.5) == lr_factor(cosine.replace(epochs=10), 1)


def test_the_fast_recipe_records_what_it_did(tmp_path, tiny_config):
    config = tiny_config.replace(epochs=2, augment="crop", padding=1, cutout=3, ema=0.5, amp="bf16",
                                 channels_last=True, tta=True, label_smoothing=0.1)  # fmt: skip
    summary = Trainer(config, tmp_path).fit()
    assert summary.record["augment"] == "crop (padding 1), cutout 3"
    assert 0.0 <= summary.record["final"]["test_acc_tta"] <= 1.0 and summary.val_acc > 0.3
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert recorded["augment"] == {"policy": "crop", "padding": 1, "cutout": 3}
    # what is validated and saved is the weight average, not the last weights
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(saved[k], state["ema"][f"module.{k}"].contiguous()) for k in saved)
    assert any(not torch.equal(saved[k], state["model"][k]) for k in saved if saved[k].is_floating_point())


def test_a_weight_average_is_not_its_random_start_after_a_few_steps():
    model = torch.nn.Linear(2, 1, bias=False)
    average = weight_average(model, 0.999)
    with torch.no_grad():
        for step in range(1, 6):
            model.weight.fill_(float(step))
            average.update_parameters(model)
    # a plain 0.999 average would still be 1.0 (the first copy); the warmed-up decay follows the weights
    assert torch.all((average.module.weight > 3.0) & (average.module.weight < 5.0))
    assert weight_average(model, 0.0) is None


def test_whitening_stem_whitens_the_patches_it_was_fit_on():
    from anytime.backbones.fastcnn import WhiteningStem

    generator = torch.Generator().manual_seed(0)
    mixing = torch.randn(3, 3, generator=generator)
    images = torch.einsum("dc,nchw->ndhw", mixing, torch.randn(200, 3, 16, 16, generator=generator))
    stem = WhiteningStem(3)
    stem.init_from_data(images)
    out = stem.conv(images) - stem.conv.bias[None, :, None, None]
    half = out[:, :12].permute(0, 2, 3, 1).reshape(-1, 12)
    assert torch.allclose(torch.cov(half.T), torch.eye(12), atol=0.05)
    assert torch.allclose(out[:, 12:], -out[:, :12], atol=1e-5)
    assert not stem.conv.weight.requires_grad


def test_normalisation_biases_get_their_own_learning_rate_and_the_same_decay_per_step(tmp_path, tiny_config):
    from anytime.backbones import create_model
    from anytime.train.recipe import parameter_groups

    model = create_model("fastcnn")
    config = tiny_config.replace(lr=0.5, weight_decay=1e-3, norm_bias_lr_scale=64.0)
    biases, rest = parameter_groups(model, config)
    norm_biases = {id(m.bias) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert {id(p) for p in biases["params"]} == norm_biases
    assert biases["lr"] == 32.0 and biases["lr"] * biases["weight_decay"] == pytest.approx(0.5 * 1e-3)
    assert all(id(p) not in norm_biases and p.requires_grad for p in rest["params"])
    assert (rest["lr"], rest["weight_decay"]) == (0.5, 1e-3)
    assert len(parameter_groups(model, config.replace(norm_bias_lr_scale=1.0))) == 1  # old checkpoints resume
    assert len(parameter_groups(create_model("lenet"), config)) == 1  # no norms: one group


def test_fastcnn_convolutions_start_as_identities_where_they_can():
    from anytime.backbones.fastcnn import _conv

    x = torch.randn(1, 24, 8, 8)
    with torch.no_grad():
        assert torch.allclose(_conv(24, 64)(x)[:, :24], x, atol=1e-6)
        assert not torch.allclose(_conv(24, 64)(x)[:, 24:48], x, atol=1e-2)  # the rest stay random


def test_diverging_run_stops_with_advice(tmp_path, tiny_config):
    with pytest.raises(AnytimeError, match="diverged.*lower --lr"):
        Trainer(tiny_config.replace(lr=1e12, epochs=1), tmp_path).fit()


def test_phase_log_summary():
    log = PhaseLog()
    log.add(0.1, 0.2, 0.3, 0.4, 10)
    log.add(0.1, 0.2, 0.3, 0.4, 10)
    summary = log.summary()
    assert summary["iteration_mean_s"] == pytest.approx(1.0)
    assert summary["images_per_s"] == pytest.approx(10.0)
    assert log.totals()["step"] == pytest.approx(0.8)


def test_checkpoint_round_trips_plain_values(tmp_path):
    path = save_checkpoint(tmp_path / "c.pt", {"epoch": 3, "values": [1.0, None], "name": "x"})
    state = load_checkpoint(path)
    assert (state["epoch"], state["values"], state["name"]) == (3, [1.0, None], "x")


def test_resume_refuses_changed_data(tmp_path, tiny_config):
    Trainer(tiny_config.replace(epochs=1), tmp_path).fit()
    other = load_dataset("digits")
    changed = type(other)(info=other.info.__class__(**{**other.info.__dict__, "fingerprint": "0" * 40}),
                          train=other.train, val=other.val, test=other.test)  # fmt: skip
    with pytest.raises(AnytimeError, match="changed since"):
        Trainer(tiny_config.replace(epochs=1), tmp_path).fit(resume=True, splits=changed)


def test_multi_exit_loss_weights_and_distillation():
    from anytime.train.multi_exit import multi_exit_loss

    torch.manual_seed(0)
    logits = torch.randn(3, 8, 10)
    labels = torch.randint(0, 10, (8,))
    only_last = multi_exit_loss(logits, labels, torch.tensor([0.0, 0.0, 1.0]))
    assert torch.allclose(only_last, F.cross_entropy(logits[-1], labels))
    weighted = multi_exit_loss(logits, labels, torch.tensor([0.5, 1.0, 2.0]))
    expected = sum(w * F.cross_entropy(logits[k], labels) for k, w in enumerate((0.5, 1.0, 2.0)))
    assert torch.allclose(weighted, expected)
    distilled = multi_exit_loss(logits, labels, torch.ones(3), distill=1.0)
    assert distilled > multi_exit_loss(logits, labels, torch.ones(3))
    same = logits[-1].expand(3, 8, 10)
    assert torch.allclose(multi_exit_loss(same, labels, torch.ones(3), distill=1.0),
                          multi_exit_loss(same, labels, torch.ones(3)))  # fmt: skip


def test_distillation_from_an_ensemble_of_the_later_exits():
    from anytime.train.multi_exit import multi_exit_loss

    torch.manual_seed(1)
    logits, labels, weights, t = torch.randn(4, 6, 5), torch.randint(0, 5, (6,)), torch.ones(4), 2.0
    soft = F.softmax(logits / t, dim=2)
    expected = multi_exit_loss(logits, labels, weights)
    for k in range(3):  # exit k learns from the mean of exits k+1..3
        teacher = soft[k + 1 :].mean(dim=0)
        expected = expected + t**2 * F.kl_div(F.log_softmax(logits[k] / t, dim=1), teacher, reduction="batchmean")
    got = multi_exit_loss(logits, labels, weights, distill=1.0, temperature=t, teacher="later")
    assert torch.allclose(got, expected, atol=1e-6)
    last = multi_exit_loss(logits, labels, weights, distill=1.0, temperature=t, teacher="last")
    assert not torch.allclose(got, last)
    two = logits[2:]  # with two exits both teachers are the last exit
    assert torch.allclose(multi_exit_loss(two, labels, weights[:2], distill=1.0, teacher="later"),
                          multi_exit_loss(two, labels, weights[:2], distill=1.0, teacher="last"))  # fmt: skip


def test_default_exit_weights_follow_sdn():
    from anytime import attach_exits, create_model
    from anytime.train.multi_exit import exit_weights

    model = attach_exits(create_model("resnet20"), "auto")
    weights = exit_weights(TrainConfig(model="resnet20", exits="auto"), model)
    assert weights.tolist() == pytest.approx([e.flops / model.backbone_flops for e in model.exit_info[:-1]] + [1.0])


def test_init_from_another_model_is_refused(tmp_path, tiny_config):
    Trainer(tiny_config.replace(epochs=1), tmp_path / "lenet").fit()
    with pytest.raises(AnytimeError, match="does not hold weights of CifarResNet"):
        Trainer(TrainConfig(model="resnet20", exits="auto", init=str(tmp_path / "lenet"), epochs=1, device="cpu"),
                tmp_path / "r").fit()  # fmt: skip


def test_init_loads_the_backbone(tmp_path, tiny_config):
    from anytime.train.multi_exit import build_model

    Trainer(tiny_config.replace(epochs=1), tmp_path / "lenet").fit()
    config = tiny_config.replace(exits="auto", init=str(tmp_path / "lenet" / "checkpoint.pt"))
    model = build_model(config, num_classes=10, in_channels=1, image_size=(32, 32))
    saved = load_checkpoint(tmp_path / "lenet" / "checkpoint.pt")["model"]
    assert all(torch.equal(model.backbone.state_dict()[k], v) for k, v in saved.items())
