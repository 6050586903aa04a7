"""Datasets, splits, the uint8 cache and the batched loader."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import anytime.data.imagefolder as imagefolder
from anytime.data import (
    DATASETS,
    Augment,
    DatasetInfo,
    Delivery,
    cache_path_for,
    default_augment,
    load_dataset,
    make_loader,
    normalize,
    random_crop_flip,
)
from anytime.data.augment import apply_augment
from anytime.errors import AnytimeError
from anytime.train import TrainConfig

REAL_CIFAR10 = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10"


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


# ----------------------------------------------------------------------------- digits and splits


def test_digits_shapes_and_info(digits) -> None:
    info = digits.info
    assert info.name == "digits" and info.num_classes == 10 and info.in_channels == 1
    assert info.image_size == (32, 32) and info.hflip is False and info.source == "sklearn:load_digits"
    for split in (digits.train, digits.val, digits.test):
        assert split.images.dtype == torch.uint8 and split.images.shape[1:] == (1, 32, 32)
        assert split.images.is_contiguous() and split.labels.dtype == torch.int64
        assert int(split.labels.min()) >= 0 and int(split.labels.max()) <= 9
    assert len(digits.train) + len(digits.val) + len(digits.test) == 1797
    assert len(digits.test) == round(0.2 * 1797)
    assert int(digits.train.images.max()) == 255
    assert digits.split("val") is digits.val
    with pytest.raises(AnytimeError):
        digits.split("validation")
    assert set(DATASETS) == {
        "digits",
        "cifar10",
        "cifar100",
        "folder",
        "synthetic",
        "shards",
        "folder-stream",
        "sst2",
        "textfolder",
    }
    assert info.to_dict()["classes"][0] == "0"


def test_digits_splits_disjoint_and_stratified(digits) -> None:
    ids = [set(s.indices.tolist()) for s in (digits.train, digits.val, digits.test)]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert len(ids[0] | ids[1] | ids[2]) == 1797
    # The stored indices really point at the source images.
    from sklearn.datasets import load_digits

    target = load_digits().target
    assert np.array_equal(target[digits.val.indices.numpy()], digits.val.labels.numpy())
    for split in (digits.train, digits.val, digits.test):
        share = np.bincount(split.labels.numpy(), minlength=10) / len(split)
        assert np.abs(share - 0.1).max() < 0.03


def test_the_digits_read_without_scikit_learn_equal_its_loaders(monkeypatch) -> None:
    import importlib.util
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    import anytime.data.digits as digits_module

    bunch = load_digits()
    pixels, labels = digits_module._digits_arrays()
    assert pixels.dtype == np.float64 and labels.dtype == np.int64
    assert np.array_equal(pixels, bunch.images) and np.array_equal(labels, bunch.target)
    with monkeypatch.context() as patched:
        patched.setattr(importlib.util, "find_spec", lambda name: None)  # scikit-learn's file not found: its loader
        fallback = digits_module._digits_arrays()
    assert np.array_equal(fallback[0], pixels) and np.array_equal(fallback[1], labels)
    code = "import sys; from anytime.data import load_dataset; load_dataset('digits'); print('sklearn' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr


def test_split_seeds(digits) -> None:
    same = load_dataset("digits", seed=0)
    other = load_dataset("digits", seed=1)
    assert torch.equal(same.val.indices, digits.val.indices)
    assert not torch.equal(other.val.indices, digits.val.indices)
    assert torch.equal(other.test.indices, digits.test.indices)  # the carved test split is fixed


def test_limit_train_and_val_fraction() -> None:
    splits = load_dataset("digits", val_fraction=0.2, limit_train=100)
    assert len(splits.train) == 100
    assert np.bincount(splits.train.labels.numpy(), minlength=10).min() >= 9
    assert not set(splits.train.indices.tolist()) & set(splits.val.indices.tolist())
    with pytest.raises(AnytimeError):
        load_dataset("digits", root="/tmp")
    with pytest.raises(AnytimeError, match="unknown dataset"):
        load_dataset("mnist")


def test_synthetic() -> None:
    a, b = load_dataset("synthetic", seed=3), load_dataset("synthetic", seed=3)
    assert len(a.train) + len(a.val) == 512 and len(a.test) == 128
    assert a.train.images.shape[1:] == (3, 32, 32) and a.info.num_classes == 10
    assert torch.equal(a.train.images, b.train.images) and a.info.fingerprint == b.info.fingerprint
    assert load_dataset("synthetic", seed=4).info.fingerprint != a.info.fingerprint
    # The class signal is there: class mean colours differ clearly.
    means = torch.stack([a.train.images[a.train.labels == k].float().mean((0, 2, 3)) for k in range(10)])
    assert (means.max(0).values - means.min(0).values).max() > 30


# ----------------------------------------------------------------------------- augmentation and loader


def test_random_crop_flip_content() -> None:
    x = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(random_crop_flip(x, padding=0, hflip=False, generator=g), x)
    flipped = random_crop_flip(x, padding=0, hflip=True, generator=torch.Generator().manual_seed(1))
    n_flipped = 0
    for i in range(16):
        if torch.equal(flipped[i], x[i]):
            continue
        assert torch.equal(flipped[i], torch.flip(x[i], dims=[2]))
        n_flipped += 1
    assert 0 < n_flipped < 16
    # A padded crop is a shifted window of the zero-padded image.
    out = random_crop_flip(x, padding=2, hflip=False, generator=torch.Generator().manual_seed(2))
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(16):
        assert any(torch.equal(out[i], padded[i, :, dy : dy + 8, dx : dx + 8]) for dy in range(5) for dx in range(5))
    assert out.dtype == torch.uint8


def test_normalize() -> None:
    x = torch.tensor([[[[0, 255]]]], dtype=torch.uint8)
    y = normalize(x, (0.5,), (0.25,))
    assert y.dtype == torch.float32 and torch.allclose(y, torch.tensor([[[[-2.0, 2.0]]]]))


def _collect(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]


def test_loader_batches(digits) -> None:
    loader = make_loader(digits.train, digits.info, batch_size=100, train=True, seed=0)
    assert len(loader) == -(-len(digits.train) // 100) and loader.num_samples == len(digits.train)
    batches = _collect(loader)
    assert len(batches) == len(loader)
    x, y = batches[0]
    assert x.shape == (100, 1, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert sum(len(b[1]) for b in batches) == len(digits.train)
    assert (
        make_loader(digits.train, digits.info, batch_size=100, train=True, drop_last=True).__len__()
        == len(digits.train) // 100
    )
    plain = torch.cat([x for x, _ in make_loader(digits.train, digits.info, batch_size=256, train=False)])
    assert abs(plain.mean().item()) < 0.01 and abs(plain.std().item() - 1) < 0.01


def test_loader_epochs_are_reproducible(digits) -> None:
    loader = make_loader(digits.train, digits.info, batch_size=64, train=True, seed=5)
    loader.set_epoch(0)
    first = _collect(loader)
    again = _collect(loader)  # iterating again without set_epoch repeats the epoch
    loader.set_epoch(1)
    second = _collect(loader)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    assert not torch.equal(first[0][1], second[0][1])
    fresh = make_loader(digits.train, digits.info, batch_size=64, train=True, seed=5)
    fresh.set_epoch(1)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(second, _collect(fresh)))


def test_loader_workers_match_in_process() -> None:
    splits = load_dataset("synthetic", seed=0)
    kw = {"batch_size": 48, "train": True, "seed": 2}
    serial = make_loader(splits.train, splits.info, delivery=Delivery(workers=0), **kw)
    parallel = make_loader(splits.train, splits.info, delivery=Delivery(workers=2, prefetch_factor=2), **kw)
    serial.set_epoch(3)
    parallel.set_epoch(3)
    a, b = _collect(serial), _collect(parallel)
    assert len(a) == len(b) == len(serial)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_eval_loader_fixed_order(digits) -> None:
    loader = make_loader(digits.val, digits.info, batch_size=32, train=False)
    loader.set_epoch(7)
    labels = torch.cat([y for _, y in loader])
    assert torch.equal(labels, digits.val.labels)
    images = torch.cat([x for x, _ in loader])
    assert torch.equal(images, normalize(digits.val.images, digits.info.mean, digits.info.std))


def test_augment_policies_do_what_they_name(digits) -> None:
    x = torch.arange(2 * 1 * 4 * 4, dtype=torch.uint8).reshape(2, 1, 4, 4)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(apply_augment(x, Augment("none"), g), x)
    flips = [apply_augment(x, Augment("flip"), torch.Generator().manual_seed(s)) for s in range(8)]
    assert all(torch.equal(f[i], x[i]) or torch.equal(f[i], x[i].flip(2)) for f in flips for i in range(2))
    assert any(torch.equal(f[0], x[0].flip(2)) for f in flips)  # some draw flips
    crops = [apply_augment(x, Augment("crop", 1), torch.Generator().manual_seed(s)) for s in range(8)]
    assert all(not torch.equal(c[0], x[0].flip(2)) for c in crops)  # a crop never mirrors
    assert any(not torch.equal(c, x) for c in crops)
    assert Augment("crop+flip", 0).crop is False and Augment("crop", 2).describe() == "crop (padding 2)"
    assert default_augment(False).policy == "crop" and default_augment(True).policy == "crop+flip"
    with pytest.raises(AnytimeError, match="unknown augmentation 'rotate'"):
        Augment("rotate")
    with pytest.raises(AnytimeError, match="padding"):
        Augment("crop", -1)
    loader = make_loader(digits.train, digits.info, batch_size=8, train=True, augment=Augment("none"))
    first, _ = next(iter(loader))
    assert loader.augment == Augment("none") and first.shape[0] == 8


def test_cutout_hides_one_clipped_square_per_image_in_the_fill_colour() -> None:
    from anytime.data.augment import random_cutout

    x = torch.randint(1, 200, (64, 3, 10, 12), dtype=torch.uint8)
    out = random_cutout(x, 4, generator=torch.Generator().manual_seed(0), fill=(201, 202, 203))
    hidden = out.ne(x)
    assert hidden.any(1).eq(hidden.all(1)).all()  # a pixel is hidden in every channel or in none
    for image, original, mask in zip(out, x, hidden[:, 0]):
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        assert 1 <= len(rows) <= 4 and 1 <= len(cols) <= 4  # a square, clipped at the borders
        assert rows.diff().eq(1).all() and cols.diff().eq(1).all()
        assert int(mask.sum()) == len(rows) * len(cols)
        assert all(torch.equal(image[c][mask], torch.full((int(mask.sum()),), 201 + c, dtype=torch.uint8))
                   for c in range(3))  # fmt: skip
        assert torch.equal(image[:, ~mask], original[:, ~mask])
    whole = hidden[:, 0].sum((1, 2))
    assert int(whole.max()) == 16 and int(whole.min()) < 16  # squares inside the image, and clipped ones
    part = random_cutout(x[5:9], 4, generator=torch.Generator().manual_seed(0), within=(5, 64))
    assert torch.equal(part.ne(x[5:9]), hidden[5:9])  # processes sharing a batch hide what one process would
    assert torch.equal(random_cutout(x, 0, generator=torch.Generator()), x)
    with pytest.raises(ValueError, match="2 values for images of 3 channels"):
        random_cutout(x, 4, generator=torch.Generator(), fill=(1, 2))


def test_the_loader_cuts_out_in_the_dataset_s_mean_colour_after_the_crops(digits) -> None:
    info = DatasetInfo(**{**digits.info.__dict__, "mean": (0.5,), "std": (1 / 255,)})
    augment = Augment("none", 0, 3)
    assert augment.describe() == "none, cutout 3" and Augment("crop+flip", 2, 12).describe() == (
        "crop+flip (padding 2), cutout 12"
    )
    with pytest.raises(AnytimeError, match="cutout"):
        Augment("crop", 2, -4)
    loader = make_loader(digits.train, info, batch_size=len(digits.train), train=True, augment=augment)
    x, y = next(iter(loader))
    images, labels = digits.train.images.to(torch.float32) - 127.5, digits.train.labels
    originals = {int(label): images[labels == label] for label in labels.unique()}
    gray = torch.tensor(128 - 127.5)  # the mean colour 0.5 as a uint8 value, normalised
    for served, label in zip(x, y):
        shown = served.ne(gray)
        matches = originals[int(label)][:, shown].eq(served[shown]).all(dim=1)
        assert bool(matches.any()) and int(served.eq(gray).sum()) >= 1  # an original, a gray square, nothing else


def test_digits_are_never_flipped(digits) -> None:
    assert digits.info.hflip is False
    assert make_loader(digits.train, digits.info, batch_size=8, train=True).augment == Augment("crop", 4)
    info = DatasetInfo(**{**digits.info.__dict__, "mean": (0.0,), "std": (1 / 255,)})
    loader = make_loader(digits.train, info, batch_size=len(digits.train), train=True, augment=Augment("crop", 0))
    x, y = next(iter(loader))
    # With no padding and no flip, a training batch is the originals in shuffled order, never mirrored.
    originals = {
        tuple(img.flatten().tolist()): int(label) for img, label in zip(digits.train.images, digits.train.labels)
    }
    served = [tuple(img.round().to(torch.uint8).flatten().tolist()) for img in x]
    assert all(originals.get(img) == int(label) for img, label in zip(served, y))
    assert not torch.equal(y, digits.train.labels)


# ----------------------------------------------------------------------------- image folders and the cache


def _write_tree(
    root: Path,
    classes: tuple[str, ...] = ("cat", "dog", "owl"),
    per_class: int = 4,
    size: tuple[int, int] = (12, 10),
    mode: str = "RGB",
) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls in classes:
            folder = root / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
                pixels = rng.integers(0, 256, size=shape, dtype=np.uint8)
                ext = ".png" if i % 2 else ".jpg"
                Image.fromarray(pixels, mode=mode).save(folder / f"{i}{ext}")
    (root / "train" / classes[0] / "notes.txt").write_text("not an image")
    (root / "train" / classes[0] / ".hidden.png").write_bytes(b"junk")


def test_folder_loads_colour(tmp_path: Path) -> None:
    _write_tree(tmp_path / "tree")
    splits = load_dataset("folder", tmp_path / "tree", cache_dir=tmp_path / "cache", val_fraction=0.25)
    info = splits.info
    assert info.classes == ("cat", "dog", "owl") and info.in_channels == 3 and info.image_size == (10, 12)
    assert len(splits.train) + len(splits.val) == 12 and len(splits.test) == 12 and len(splits.val) == 3
    assert info.source == str((tmp_path / "tree").resolve()) and len(info.fingerprint) == 40
    # PNG is lossless: a decoded sample equals the file's pixels.
    png = tmp_path / "tree" / "test" / "cat" / "1.png"
    assert np.array_equal(splits.test.images[1].permute(1, 2, 0).numpy(), np.asarray(Image.open(png)))


def test_folder_grey_and_sizes(tmp_path: Path) -> None:
    _write_tree(tmp_path / "grey", mode="L")
    grey = load_dataset("folder", tmp_path / "grey", cache_dir=tmp_path / "cache")
    assert grey.info.in_channels == 1 and len(grey.info.mean) == 1
    _write_tree(tmp_path / "mixed")
    Image.new("RGB", (20, 20)).save(tmp_path / "mixed" / "train" / "dog" / "big.png")
    with pytest.raises(AnytimeError, match="image size") as caught:
        load_dataset("folder", tmp_path / "mixed", cache_dir=tmp_path / "cache")
    assert "--image-size" in str(caught.value)
    resized = load_dataset("folder", tmp_path / "mixed", cache_dir=tmp_path / "cache", image_size=16)
    assert resized.info.image_size == (16, 16) and resized.train.images.shape[2:] == (16, 16)


def test_grey_pictures_saved_as_rgb_or_palette_stay_one_channel(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for split in ("train", "test"):
        for cls in ("a", "b"):
            folder = tmp_path / "digits" / split / cls
            folder.mkdir(parents=True)
            for i in range(3):
                grey = rng.integers(0, 256, size=(8, 8), dtype=np.uint8)
                picture = Image.fromarray(grey, mode="L")
                (picture.convert("RGB") if i % 2 else picture.convert("P")).save(folder / f"{i}.png")
    splits = load_dataset("folder", tmp_path / "digits", cache_dir=tmp_path / "cache")
    assert splits.info.in_channels == 1 and splits.train.images.shape[1] == 1 and len(splits.info.mean) == 1
    Image.fromarray(rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)).save(tmp_path / "digits/test/a/colour.png")
    assert load_dataset("folder", tmp_path / "digits", cache_dir=tmp_path / "cache").info.in_channels == 3


def test_an_unknown_folder_is_never_mirrored_by_default(tmp_path: Path) -> None:
    _write_tree(tmp_path / "tree")
    info = load_dataset("folder", tmp_path / "tree", cache_dir=tmp_path / "cache").info
    assert info.hflip is False and TrainConfig().augmentation(info.hflip).policy == "crop"
    assert TrainConfig(augment="crop+flip").augmentation(info.hflip).hflip  # declared by the recipe: kept
    assert load_dataset("folder-stream", tmp_path / "tree", image_size=8).info.hflip is False


def test_folder_cache_reuse_and_rebuild(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree, cache = tmp_path / "tree", tmp_path / "cache"
    _write_tree(tree)
    calls = []
    real_decode = imagefolder.decode_folder

    def counting(*args, **kwargs):
        calls.append(1)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(imagefolder, "decode_folder", counting)
    first = load_dataset("folder", tree, cache_dir=cache)
    path = cache_path_for("folder", tree, None, cache)
    assert path.is_file() and len(calls) == 1
    second = load_dataset("folder", tree, cache_dir=cache)
    assert len(calls) == 1 and torch.equal(first.test.images, second.test.images)
    assert first.info.fingerprint == second.info.fingerprint
    assert cache_path_for("folder", tree, 16, cache) != path

    Image.new("RGB", (12, 10), (255, 0, 0)).save(tree / "test" / "owl" / "new.png")
    added = load_dataset("folder", tree, cache_dir=cache)
    assert len(calls) == 2 and len(added.test) == len(first.test) + 1
    assert added.info.fingerprint != first.info.fingerprint

    target = tree / "test" / "cat" / "1.png"
    Image.new("RGB", (12, 10), (0, 0, 255)).save(target)
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = load_dataset("folder", tree, cache_dir=cache)
    assert len(calls) == 3 and int(changed.test.images[1, 2].min()) == 255

    for image in tree.rglob("*.png"):  # a copy that did not keep modification times: the same data
        st = image.stat()
        os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))
    touched = load_dataset("folder", tree, cache_dir=cache)
    assert len(calls) == 4 and touched.info.fingerprint == changed.info.fingerprint

    (tree / "test" / "owl" / "new.png").unlink()
    load_dataset("folder", tree, cache_dir=cache)
    assert len(calls) == 5


def test_default_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_tree(tmp_path / "tree", per_class=2)
    monkeypatch.setenv("ANYTIME_CACHE", str(tmp_path / "envcache"))
    load_dataset("folder", tmp_path / "tree")
    assert cache_path_for("folder", tmp_path / "tree").parent == tmp_path / "envcache"
    assert cache_path_for("folder", tmp_path / "tree").is_file()


def test_folder_errors(tmp_path: Path) -> None:
    _write_tree(tmp_path / "odd")
    (tmp_path / "odd" / "test" / "owl").rename(tmp_path / "odd" / "test" / "bat")
    with pytest.raises(AnytimeError, match="same class"):
        load_dataset("folder", tmp_path / "odd", cache_dir=tmp_path / "cache")
    _write_tree(tmp_path / "bad")
    broken = tmp_path / "bad" / "train" / "dog" / "broken.jpg"
    broken.write_bytes(b"this is not a jpeg")
    with pytest.raises(AnytimeError, match="broken.jpg"):
        load_dataset("folder", tmp_path / "bad", cache_dir=tmp_path / "cache")
    with pytest.raises(AnytimeError, match="data-root"):
        load_dataset("folder")


# ----------------------------------------------------------------------------- cifar10


def _write_batches(folder: Path, rows: int = 6) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"batch_label": name.encode(),
            b"labels": [int(v) for v in rng.integers(0, 10, rows)],
            b"data": rng.integers(0, 256, (rows, 3072), dtype=np.uint8),
            b"filenames": [f"{i}.png".encode() for i in range(rows)],
        }
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": names, b"num_vis": 3072}))


def test_cifar10_python_batches(tmp_path: Path) -> None:
    _write_batches(tmp_path / "cifar-10-batches-py")
    for root in (tmp_path, tmp_path / "cifar-10-batches-py"):
        splits = load_dataset("cifar10", root, cache_dir=tmp_path / "cache", val_fraction=0.2)
        assert len(splits.train) + len(splits.val) == 30 and len(splits.test) == 6
        assert splits.train.images.shape[1:] == (3, 32, 32) and splits.info.classes[-1] == "truck"
        assert splits.info.hflip and splits.info.num_classes == 10
    raw = pickle.loads((tmp_path / "cifar-10-batches-py" / "test_batch").read_bytes())
    assert np.array_equal(splits.test.images.reshape(6, -1).numpy(), raw[b"data"])


def _write_cifar100(folder: Path, rows: int = 300) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for name, count in (("train", rows), ("test", rows // 3)):
        labels = [i % 100 for i in range(count)]  # every class present, so a stratified split works
        batch = {b"fine_labels": labels, b"coarse_labels": [v // 5 for v in labels],
                 b"data": rng.integers(0, 256, (count, 3072), dtype=np.uint8)}  # fmt: skip
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    (folder / "meta").write_bytes(pickle.dumps({b"fine_label_names": [f"c{i}".encode() for i in range(100)]}))


def test_cifar100_python_folder(tmp_path: Path) -> None:
    _write_cifar100(tmp_path / "cifar-100-python")
    for root in (tmp_path, tmp_path / "cifar-100-python"):
        splits = load_dataset("cifar100", root, cache_dir=tmp_path / "cache", val_fraction=0.2)
        assert len(splits.train) + len(splits.val) == 300 and len(splits.test) == 100
        assert splits.info.num_classes == 100 and splits.info.classes[7] == "c7" and splits.info.hflip
    raw = pickle.loads((tmp_path / "cifar-100-python" / "test").read_bytes())
    assert np.array_equal(splits.test.labels.numpy(), np.asarray(raw[b"fine_labels"]))


def test_cifar100_absent_or_wrong_says_where_to_put_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ANYTIME_CIFAR100", raising=False)
    with pytest.raises(AnytimeError, match=r"no CIFAR-100 found .*shared/data/cifar100.*--data-root"):
        load_dataset("cifar100", cache_dir=tmp_path / "cache")
    _write_batches(tmp_path / "c10" / "cifar-10-batches-py")  # CIFAR-10 where CIFAR-100 was asked for
    with pytest.raises(AnytimeError, match="no CIFAR-100 found"):
        load_dataset("cifar100", tmp_path / "c10", cache_dir=tmp_path / "cache")
    bad = tmp_path / "bad" / "cifar-100-python"
    _write_cifar100(bad)
    batch = pickle.loads((bad / "train").read_bytes())
    batch[b"fine_labels"][0] = 100
    (bad / "train").write_bytes(pickle.dumps(batch))
    with pytest.raises(AnytimeError, match="labels outside 0..99"):
        load_dataset("cifar100", bad, cache_dir=tmp_path / "cache")


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cifar10_refuses_malicious_pickle(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    _write_batches(folder)
    marker = tmp_path / "pwned"
    (folder / "data_batch_3").write_bytes(pickle.dumps({b"data": _Exploit(marker), b"labels": []}))
    with pytest.raises(AnytimeError, match="forbidden global"):
        load_dataset("cifar10", tmp_path, cache_dir=tmp_path / "cache")
    assert not marker.exists()


def test_cifar10_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AnytimeError) as caught:
        load_dataset("cifar10", tmp_path / "nowhere", cache_dir=tmp_path / "cache")
    message = str(caught.value)
    assert "\n" not in message and str(tmp_path / "nowhere") in message
    assert "cifar-10-batches-py" in message and "train/<class>" in message
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ANYTIME_CIFAR10", str(tmp_path / "env"))
    with pytest.raises(AnytimeError) as caught:
        load_dataset("cifar10", cache_dir=tmp_path / "cache")
    message = str(caught.value)
    assert "\n" not in message
    for tried in (tmp_path / "env", tmp_path / "data" / "cifar10", tmp_path.parent / "shared" / "data" / "cifar10"):
        assert str(tried.resolve()) in message


@pytest.mark.needs_data
def test_real_cifar10(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    if not (REAL_CIFAR10 / "train").is_dir():
        pytest.skip(f"real CIFAR-10 images not found at {REAL_CIFAR10}")
    cache = tmp_path_factory.mktemp("cifar_cache")
    splits = load_dataset("cifar10", REAL_CIFAR10, cache_dir=cache, val_fraction=0.1)

    def no_decoding(*_args: object) -> None:
        raise AssertionError("the second load decoded the images again instead of reading the cache")

    monkeypatch.setattr(imagefolder, "decode_folder", no_decoding)
    warm = load_dataset("cifar10", REAL_CIFAR10, cache_dir=cache, val_fraction=0.1)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (45000, 5000, 10000)
    assert splits.train.images.shape[1:] == (3, 32, 32) and splits.info.num_classes == 10
    assert splits.info.classes[0] == "airplane" and splits.info.hflip
    assert torch.equal(warm.val.images, splits.val.images)
    assert np.bincount(splits.val.labels.numpy()).tolist() == [500] * 10


def test_a_sample_of_a_class_ordered_split_covers_every_class():
    from anytime.data.base import Split

    labels = torch.arange(10).repeat_interleave(100)  # stored class by class, as an image folder's test split
    split = Split("test", torch.zeros(1000, 1, 2, 2, dtype=torch.uint8), labels, torch.arange(1000))
    a, b = split.sample(200, seed=3), split.sample(200, seed=3)
    assert (
        len(a) == 200
        and torch.equal(a.labels, b.labels)
        and not torch.equal(a.labels, split.sample(200, seed=4).labels)
    )
    assert set(a.labels[:50].tolist()) == set(range(10))  # even a prefix is spread over the classes
    assert torch.equal(labels[a.indices], a.labels) and len(set(a.indices.tolist())) == 200
    assert split.sample(None) is split and split.sample(5000) is split
