"""Shared fixtures: the real CIFAR-10 folder (skipped cleanly when absent) and a small digits recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CIFAR10_ROOT = REPO.parent / "shared" / "data" / "cifar10"


@pytest.fixture(scope="session", autouse=True)
def _own_dataset_cache(tmp_path_factory):
    """Every test session decodes datasets into a cache of its own (not ``~/.cache/anytime``), so two suites running
    at once, or a user's own runs, never share its files with the tests."""
    patch = pytest.MonkeyPatch()
    patch.setenv("ANYTIME_CACHE", str(tmp_path_factory.mktemp("dataset-cache")))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def cifar_root() -> Path:
    """The CIFAR-10 image folder beside the repository, or a skip."""
    if not (CIFAR10_ROOT / "train").is_dir():
        pytest.skip(f"real CIFAR-10 images not found at {CIFAR10_ROOT}")
    return CIFAR10_ROOT


@pytest.fixture
def tiny_config():
    """LeNet on the digits for 3 epochs: seconds on a CPU, enough to check behaviour."""
    from anytime.train import TrainConfig

    return TrainConfig(model="lenet", data="digits", epochs=3, batch_size=32, lr=0.05, device="cpu")


@pytest.fixture(scope="session")
def exit_run(tmp_path_factory) -> Path:
    """A trained multi-exit ResNet-8 on the digits (exits after stages 0 and 1, 3 epochs; about 5 s)."""
    from anytime.train import TrainConfig, Trainer

    run_dir = tmp_path_factory.mktemp("exit-run") / "run"
    config = TrainConfig(model="resnet8", data="digits", epochs=3, batch_size=64, lr=0.05, exits="auto", device="cpu")
    Trainer(config, run_dir).fit()
    return run_dir


@pytest.fixture
def cli_error(capsys):
    """``cli_error(argv, *words)``: run ``anytime ARGV``; it must exit with status 2 and one line of error,
    no traceback, naming every word given."""
    from anytime.cli import main

    def check(argv: list[str], *words: str) -> None:
        assert main(argv) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err
        for word in words:
            assert word in lines[0], lines[0]

    return check


@pytest.fixture
def resumes_exactly(tmp_path):
    """``resumes_exactly(config)``: train ``config`` whole, and again stopped after its first epoch and resumed;
    both runs must end with the very same weights."""
    import torch
    from safetensors.torch import load_file

    from anytime.train import Trainer

    def check(config) -> None:
        Trainer(config, tmp_path / "whole").fit()

        def stop(_end):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            Trainer(config, tmp_path / "broken", on_epoch_end=stop).fit()
        Trainer(config, tmp_path / "broken").fit(resume=True)
        a, b = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("whole", "broken"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    return check
