"""Shards (`anytime prepare-data`): packing, resuming, refusing, and training batches read through them."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import anytime.data.shard_writer as writer_module
from anytime.cli import main
from anytime.data import DATASETS, Delivery, load_dataset, make_loader
from anytime.data.base import Split, channel_stats
from anytime.data.shard_reader import ShardImages
from anytime.data.shard_writer import prepare_shards
from anytime.data.shards import MANIFEST, open_shards, verify_shards
from anytime.errors import AnytimeError

REPO = Path(__file__).resolve().parents[1]
CLASSES = ("ant", "bee", "cat")


def _write_tree(root: Path, per_class: int = 7, test_per_class: int = 3) -> Path:
    """A small image folder: PNG and JPEG files of mixed sizes, one grey image, and files that are not images."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("test", test_per_class)):
        for k, cls in enumerate(CLASSES):
            folder = root / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                size = (12, 10) if i % 3 else (9, 14)
                pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
                pixels[..., k] //= 2  # the classes differ a little
                Image.fromarray(pixels).save(folder / f"{i}.{'png' if i % 2 else 'jpg'}")
    grey = rng.integers(0, 256, size=(10, 12), dtype=np.uint8)
    Image.fromarray(grey, mode="L").save(root / "train" / CLASSES[1] / "grey.png")
    (root / "train" / CLASSES[0] / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return _write_tree(tmp_path_factory.mktemp("shards") / "tree")


@pytest.fixture(scope="module")
def packed(tree: Path) -> Path:
    """The tree packed at 8x8 in shards of 5 images (train: 22 images in 5 shards; test: 9 in 2)."""
    out = tree.parent / "packed"
    prepare_shards(tree, out, image_size=8, shard_size=5, workers=1)
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".bin", ".npy")}


# ----------------------------------------------------------------------------- packing


def test_shards_hold_the_folder_decoded_at_that_size(tree, packed, tmp_path) -> None:
    manifest = open_shards(packed)
    assert manifest.complete and manifest.image_size == 8 and manifest.channels == 3 and manifest.classes == CLASSES
    assert (manifest.train.count, manifest.test.count) == (22, 9) and [
        len(manifest.train.shards),
        len(manifest.test.shards),
    ] == [5, 2]
    doc = json.loads((packed / MANIFEST).read_text())
    assert doc["format"] == "anytime-shards" and doc["version"] == 1 and doc["source"]["files"] == 31
    assert doc["source"]["bytes"] == sum(p.stat().st_size for p in tree.rglob("*") if p.suffix in (".png", ".jpg"))
    verify_shards(packed)

    folder = load_dataset("folder", tree, image_size=8, val_fraction=0.0, cache_dir=tmp_path / "cache")
    shards = load_dataset("shards", packed, val_fraction=0.0)
    for name in ("train", "test"):
        ours, theirs = shards.split(name), folder.split(name)
        assert isinstance(ours.images, ShardImages) and ours.images.shape == theirs.images.shape
        assert torch.equal(ours.images[:], theirs.images) and torch.equal(ours.labels, theirs.labels)
    # The mean and std recorded while packing are the exact statistics of every training image.
    mean, std = channel_stats(folder.train.images.numpy())
    assert np.allclose(shards.info.mean, mean, atol=1e-12) and np.allclose(shards.info.std, std, atol=1e-12)
    assert shards.info.name == "shards" and shards.info.in_channels == 3 and shards.info.image_size == (8, 8)
    assert shards.info.fingerprint == folder.info.fingerprint and "shards" in DATASETS


def test_parallel_workers_write_the_same_shards(tree, packed, tmp_path) -> None:
    out = tmp_path / "parallel"
    lines: list[str] = []
    result = prepare_shards(tree, out, image_size=8, shard_size=5, workers=2, on_progress=lines.append)
    assert result.written == 7 and result.reused == 0 and len(lines) == 7 and lines[-1].startswith("7/7 shards")
    assert _files(out) == _files(packed)
    assert json.loads((out / MANIFEST).read_text())["splits"] == json.loads((packed / MANIFEST).read_text())["splits"]


def test_store_indexing_views_and_pickling(packed) -> None:
    images = load_dataset("shards", packed, val_fraction=0.0).train.images
    whole = images[:]
    assert images.dtype == torch.uint8 and images.dim() == 4 and len(images) == 22
    picked = torch.tensor([21, 0, 5, 5, 13])  # across shards, repeated, out of order
    assert torch.equal(images.index_select(0, picked), whole[picked]) and torch.equal(images[picked], whole[picked])
    assert (
        torch.equal(images[3], whole[3])
        and torch.equal(images[-1], whole[-1])
        and torch.equal(images[4:12], whole[4:12])
    )
    assert torch.equal(images[2, 1], whole[2, 1]) and images[5:5].shape == (0, 3, 8, 8)
    view = images.subset(np.array([7, 2, 19]))
    assert isinstance(view, ShardImages) and torch.equal(view[:], whole[[7, 2, 19]])
    assert torch.equal(view.subset(np.array([2, 0]))[:], whole[[19, 7]])
    assert torch.equal(pickle.loads(pickle.dumps(view))[:], view[:])
    with pytest.raises(IndexError):
        images[22]
    with pytest.raises(IndexError):
        images.index_select(0, torch.tensor([0, 30]))


# ----------------------------------------------------------------------------- training reads through the shards


def test_loader_batches_equal_the_same_data_in_memory(tree, packed, tmp_path) -> None:
    splits = load_dataset("shards", packed, val_fraction=0.25, seed=3)
    folder = load_dataset("folder", tree, image_size=8, val_fraction=0.25, seed=3, cache_dir=tmp_path / "cache")
    for name in ("train", "val", "test"):  # the same carve as every dataset's
        assert torch.equal(splits.split(name).indices, folder.split(name).indices)
        assert torch.equal(splits.split(name).images[:], folder.split(name).images)
    memory = {name: Split(name, s.images[:], s.labels, s.indices) for name in ("train", "val", "test")
              for s in [splits.split(name)]}  # fmt: skip
    assert len(splits.val) == 6 and len(splits.train) == 16  # 22 * 0.25, stratified, without reading an image
    for name, train in (("train", True), ("val", False), ("test", False)):
        ours = make_loader(splits.split(name), splits.info, batch_size=4, train=train, seed=5)
        theirs = make_loader(memory[name], splits.info, batch_size=4, train=train, seed=5)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            pairs = list(zip(ours, theirs, strict=True))
            assert pairs and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in pairs)
    sample = splits.test.sample(4, seed=1)
    assert isinstance(sample.images, ShardImages) and torch.equal(
        sample.images[:], memory["test"].sample(4, seed=1).images
    )
    limited = load_dataset("shards", packed, val_fraction=0.25, seed=3, limit_train=9)
    assert len(limited.train) == 9 and set(limited.train.indices.tolist()) <= set(splits.train.indices.tolist())


def test_dataloader_workers_read_the_shards(packed, tmp_path) -> None:
    splits = load_dataset("shards", packed, val_fraction=0.0)
    serial = list(make_loader(splits.train, splits.info, batch_size=8, train=True, seed=2))
    parallel = list(make_loader(splits.train, splits.info, batch_size=8, train=True, seed=2,
                                delivery=Delivery(workers=2)))  # fmt: skip
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(serial, parallel, strict=True))

    # A shard that disappears under a running job: one line, also from a worker process.
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in packed.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    broken = load_dataset("shards", copy, val_fraction=0.0)
    (copy / "train-00002.bin").unlink()
    for workers in (0, 1):
        with pytest.raises(AnytimeError, match=r"^shard .*train-00002.bin is missing; run the same") as caught:
            list(make_loader(broken.train, broken.info, batch_size=8, train=True, delivery=Delivery(workers=workers)))
        assert "\n" not in str(caught.value)


def test_train_on_shards_from_the_cli(packed, tmp_path, capsys) -> None:
    assert main(["train", "--data", "shards", "--data-root", str(packed), "--model", "lenet", "--epochs", "1",
                 "--batch-size", "8", "--device", "cpu", "--out", str(tmp_path / "run")]) == 0  # fmt: skip
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["dataset"]["name"] == "shards" and summary["dataset"]["image_size"] == [8, 8]


def test_folder_stream_decodes_per_batch(tree, tmp_path) -> None:
    stream = load_dataset("folder-stream", tree, image_size=8, val_fraction=0.25)
    folder = load_dataset("folder", tree, image_size=8, val_fraction=0.25, cache_dir=tmp_path / "cache")
    for name in ("train", "val", "test"):
        assert torch.equal(stream.split(name).images[:], folder.split(name).images)
        assert torch.equal(stream.split(name).labels, folder.split(name).labels)
    batches = list(make_loader(stream.train, stream.info, batch_size=8, train=True, seed=1))
    expected = list(make_loader(folder.train, stream.info, batch_size=8, train=True, seed=1))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, expected, strict=True))
    with pytest.raises(AnytimeError, match="needs --image-size"):
        load_dataset("folder-stream", tree)


# ----------------------------------------------------------------------------- resuming


def test_an_interrupted_preparation_resumes(tree, packed, tmp_path, monkeypatch) -> None:
    out = tmp_path / "resumed"
    real = writer_module._write_shard
    written: list[str] = []

    def stop_at_the_third(job):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(job.target)
        return real(job)

    monkeypatch.setattr(writer_module, "_write_shard", stop_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        prepare_shards(tree, out, image_size=8, shard_size=5, workers=1)
    monkeypatch.setattr(writer_module, "_write_shard", real)
    doc = json.loads((out / MANIFEST).read_text())
    assert doc["complete"] is False and len(doc["splits"]["train"]["shards"]) == 2
    with pytest.raises(AnytimeError, match="unfinished .* run the same `anytime prepare-data"):
        load_dataset("shards", out)

    # A temporary file a killed process left behind, a finished shard lost since, and shards finished out of order
    # (workers): the lost one is written again, the others are kept.
    stale = out / f".train-00003.bin.{shards_module_host()}.{2**22 + 7}.abc123.tmp"
    stale.write_bytes(b"half a shard")
    (out / "train-00000.bin").unlink()
    doc["splits"]["train"]["shards"] = doc["splits"]["train"]["shards"][::-1]
    (out / MANIFEST).write_text(json.dumps(doc))
    result = prepare_shards(tree, out, image_size=8, shard_size=5, workers=1)
    assert (result.reused, result.written) == (1, 6) and result.manifest.complete
    assert not stale.exists() and _files(out) == _files(packed)
    again = prepare_shards(tree, out, image_size=8, shard_size=5, workers=1)
    assert (again.reused, again.written) == (7, 0)

    # --verify finds a shard whose bytes changed (same size) and rewrites it.
    shard = out / "test-00000.bin"
    shard.write_bytes(bytes(len(shard.read_bytes())))
    with pytest.raises(AnytimeError, match="does not match its checksum"):
        verify_shards(out)
    fixed = prepare_shards(tree, out, image_size=8, shard_size=5, workers=1, verify=True)
    assert fixed.written == 1 and _files(out) == _files(packed)


def shards_module_host() -> str:
    from anytime.utils.tempnames import host_tag

    return host_tag()


# ----------------------------------------------------------------------------- refusals


def test_other_arguments_or_a_changed_source_are_refused(tree, packed, tmp_path) -> None:
    before = _files(packed)
    with pytest.raises(AnytimeError, match=r"holds shards of .* at 8x8, 5 images per shard, not --image-size 16"):
        prepare_shards(tree, packed, image_size=16, shard_size=5)
    with pytest.raises(AnytimeError, match="not --shard-size 6"):
        prepare_shards(tree, packed, image_size=8, shard_size=6)
    changed = tmp_path / "changed"
    _write_tree(changed)
    prepare_shards(changed, tmp_path / "out", image_size=8, shard_size=5, workers=1)
    Image.new("RGB", (12, 10)).save(changed / "test" / "ant" / "new.png")
    with pytest.raises(AnytimeError, match="a source that differs"):
        prepare_shards(changed, tmp_path / "out", image_size=8, shard_size=5, workers=1)
    assert _files(packed) == before


def test_user_files_are_never_overwritten(tree, tmp_path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(AnytimeError, match="files anytime did not write"):
        prepare_shards(tree, mine, image_size=8)
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    afile = tmp_path / "a-file"
    afile.write_text("x")
    with pytest.raises(AnytimeError, match="is a file, not a folder"):
        prepare_shards(tree, afile, image_size=8)
    # A folder of shards holding something else too is not ours to fill.
    out = tmp_path / "shards"
    prepare_shards(tree, out, image_size=4, shard_size=50, workers=1)
    (out / "extra.txt").write_text("mine")
    with pytest.raises(AnytimeError, match="files anytime did not write"):
        prepare_shards(tree, out, image_size=4, shard_size=50, workers=1)


def test_a_bad_image_stops_with_its_name(tree, tmp_path) -> None:
    bad = tmp_path / "bad"
    _write_tree(bad, per_class=2, test_per_class=1)
    (bad / "train" / "bee" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(AnytimeError, match=r"cannot decode image .*broken.png .* run the same command again"):
        prepare_shards(bad, tmp_path / "out", image_size=8, shard_size=2, workers=2)
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["complete"] is False


def _copy(packed: Path, target: Path) -> Path:
    target.mkdir()
    for p in packed.iterdir():
        (target / p.name).write_bytes(p.read_bytes())
    return target


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("no-manifest", "holds no manifest.json, so it is not a shard folder; make them with `anytime prepare-data"),
        ("not-json", "cannot be read as JSON"),
        ("other-format", "is not an anytime shard manifest"),
        ("version", "shard format version 99"),
        ("missing-field", "lacks the field 'classes'"),
        ("truncated", r"train-00001.bin has 180 bytes but its manifest says 960"),
        ("missing-shard", r"test-00001.bin is missing; run `anytime prepare-data"),
        ("labels", "the labels file .*train-labels.npy holds int64 \\(3,\\), not 22"),
        ("counts", "do not add up to its 22 train images"),
        ("order", "lists 'train-00004.bin' where 'train-00000.bin' belongs"),
    ],
)
def test_a_damaged_shard_folder_is_one_line(packed, tmp_path, damage, message) -> None:
    folder = _copy(packed, tmp_path / "copy")
    manifest = folder / MANIFEST
    doc = json.loads(manifest.read_text())
    if damage == "no-manifest":
        manifest.unlink()
    elif damage == "not-json":
        manifest.write_text("{")
    elif damage == "other-format":
        manifest.write_text(json.dumps({**doc, "format": "something-else"}))
    elif damage == "version":
        manifest.write_text(json.dumps({**doc, "version": 99}))
    elif damage == "missing-field":
        manifest.write_text(json.dumps({k: v for k, v in doc.items() if k != "classes"}))
    elif damage == "truncated":
        (folder / "train-00001.bin").write_bytes((folder / "train-00001.bin").read_bytes()[:180])
    elif damage == "missing-shard":
        (folder / "test-00001.bin").unlink()
    elif damage == "labels":
        np.save(folder / "train-labels.npy", np.zeros(3, dtype=np.int64))
    elif damage == "counts":
        doc["splits"]["train"]["shards"].pop()
        manifest.write_text(json.dumps(doc))
    elif damage == "order":
        doc["splits"]["train"]["shards"].reverse()
        manifest.write_text(json.dumps(doc))
    with pytest.raises(AnytimeError, match=message) as caught:
        load_dataset("shards", folder)
    assert "\n" not in str(caught.value)


def test_load_errors(packed, tmp_path) -> None:
    with pytest.raises(AnytimeError, match="needs a root"):
        load_dataset("shards")
    with pytest.raises(AnytimeError, match="no shard folder at"):
        load_dataset("shards", tmp_path / "nowhere")
    with pytest.raises(AnytimeError, match="hold 8x8 images, not 16x16"):
        load_dataset("shards", packed, image_size=16)
    assert load_dataset("shards", packed, image_size=8).info.image_size == (8, 8)


# ----------------------------------------------------------------------------- the command


def test_prepare_data_command(tree, tmp_path, capsys) -> None:
    out = tmp_path / "cli"
    assert main(["prepare-data", str(tree), "--image-size", "6", "--out", str(out), "--workers", "1",
                 "--shard-size", "10"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "22 train + 9 test images at 6x6, 3 classes, 4 shards" in text and "4 written, 0 already done" in text
    assert f"next: anytime train --data shards --data-root {out}" in text
    assert (
        main(["prepare-data", str(tree), "--image-size", "6", "--out", str(out), "--shard-size", "10", "--json"]) == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["complete"] and doc["reused"] == 4 and doc["written"] == 0


def test_prepare_data_errors_are_one_line(tree, packed, tmp_path, cli_error, capsys) -> None:
    cli_error(["prepare-data", str(tmp_path / "nowhere"), "--image-size", "8", "--out", str(tmp_path / "o")],
              "no image folder at", "train/<class>")  # fmt: skip
    cli_error(["prepare-data", str(tree / "train"), "--image-size", "8", "--out", str(tmp_path / "o")],
              "is not an image folder")  # fmt: skip
    cli_error(["prepare-data", str(tree / "train" / "ant" / "1.png"), "--image-size", "8", "--out", str(tmp_path / "o")],
              "is a file, not an image folder")  # fmt: skip
    for argv, words in (([str(tree), "--out", str(tmp_path / "o")], ("required: --image-size",)),
                        ([str(tree), "--image-size", "0", "--out", str(tmp_path / "o")], ("--image-size", ">= 1")),
                        ([str(tree), "--image-size", "8"], ("required: --out",))):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            main(["prepare-data", *argv])
        err = capsys.readouterr().err
        assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and all(w in err for w in words), err
    cli_error(["prepare-data", str(tree), "--image-size", "8", "--out", str(tree)], "files anytime did not write")
    cli_error(["prepare-data", str(tree), "--image-size", "9", "--out", str(packed)], "not --image-size 9",
              "choose another --out")  # fmt: skip
    cli_error(["train", "--data", "shards", "--data-root", str(tree), "--out", str(tmp_path / "run")],
              "not a shard folder", "anytime prepare-data")  # fmt: skip
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_shard_benchmark_quick(tmp_path) -> None:
    report = tmp_path / "shard_pipeline.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "shard_pipeline.py"), "--quick", "--json", str(report)],
                          capture_output=True, text=True, check=False, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(report.read_text())
    assert data["benchmark"] == "shard_pipeline" and data["verdict"] in ("pass", "fail") and data["ratio"] > 0
    rows = data["figures"]["rows"]
    assert [r["size"] for r in rows] == [300, 600]
    assert all(r[k]["images_per_s"] > 0 and r[k]["peak_pss_mib"] > 0 for r in rows for k in ("shards", "torchvision"))
