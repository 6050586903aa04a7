"""The package as its users install it: the wheel's contents, the core without the extras, declared = used."""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What each distribution is imported as, where the names differ.
MODULE_OF = {"scikit-learn": "sklearn", "pillow": "PIL", "python-multipart": "multipart", "nvidia-ml-py": "pynvml"}
EXTRAS_ONLY = ("torchvision", "sklearn", "PIL", "tqdm", "torchensemble", "matplotlib", "fastapi", "uvicorn", "torchao",
               "onnx", "onnxruntime", "onnxscript", "scipy", "torch_pruning", "pynvml")  # fmt: skip
# Declared because a library we call imports them, not our code.
INDIRECT = {"onnxscript": "torch.onnx.export (the dynamo exporter) imports it"}
TOOLS = {"test", "lint", "docs"}  # extras of tools that make runs (pytest, ruff, mypy, mkdocs), never imported


def _core_site(folder: Path) -> Path:
    """A site-packages folder holding only what the core install would (torch, numpy, safetensors and what
    they require), as links into this environment's."""
    from importlib import metadata

    def base(requirement: str) -> str:
        return re.split(r"[<>=;!~\[ (]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")

    wanted, todo = set(), ["torch", "numpy", "safetensors"]
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:  # a requirement for other Pythons (a marker), not installed here
            continue
        wanted.add(name)
        todo += [base(r) for r in requires if "extra ==" not in r]
    folder.mkdir()
    for dist in metadata.distributions():
        if dist.metadata["Name"].lower().replace("_", "-") not in wanted:
            continue
        root = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or ()}:
            if not (folder / top).exists() and (root / top).exists() and not top.startswith(".."):
                (folder / top).symlink_to(root / top)
    return folder


def _requirements() -> dict[str, list[str]]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    groups = {"core": cfg["options"]["install_requires"]}
    groups.update(cfg["options.extras_require"])
    return {
        group: [line.strip() for line in text.strip().splitlines() if line.strip()] for group, text in groups.items()
    }


def _name(requirement: str) -> str:
    return re.split(r"[<>=;!~\[ ]", requirement, maxsplit=1)[0].strip().lower()


def test_every_declared_dependency_is_imported_and_none_is_pinned():
    sources = "\n".join(p.read_text() for p in (REPO / "anytime").rglob("*.py"))
    for group, requirements in _requirements().items():
        for requirement in requirements:
            name = _name(requirement)
            if name in ("anytime", "pytest"):
                continue
            assert "==" not in requirement, f"{requirement} in [{group}] is pinned; pins belong in constraints.txt"
            if name in INDIRECT or group in TOOLS:
                continue
            module = MODULE_OF.get(name, name.replace("-", "_"))
            assert re.search(rf"^\s*(import|from) {module}\b", sources, re.M), f"{name} ([{group}]) is never imported"
    core = {_name(r) for r in _requirements()["core"]}
    assert core == {"torch", "numpy", "safetensors", "tomli"}


def test_the_wheel_ships_the_cards_the_license_and_py_typed_and_trains_from_a_card_name(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "dist")], capture_output=True, text=True)  # fmt: skip
    assert built.returncode == 0, built.stderr
    wheel = next((tmp_path / "dist").glob("anytime-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    cards = {Path(n).stem for n in names if n.startswith("anytime/cards/") and n.endswith(".toml")}
    assert cards == {p.stem for p in (REPO / "models").glob("*.toml")}
    assert "anytime/py.typed" in names and any(n.endswith("licenses/LICENSE") for n in names)
    # From the installed files alone (run outside the checkout): a shipped card by its name, and --version.
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    work = tmp_path / "work"
    work.mkdir()
    cli = [sys.executable, "-m", "anytime"]
    version = subprocess.run([*cli, "--version"], capture_output=True, text=True, env=env, cwd=work)
    assert version.returncode == 0 and re.fullmatch(r"anytime \d+\.\d+\.\d+\S*", version.stdout.strip())
    train = subprocess.run([*cli, "train", "--card", "digits-lenet", "--epochs", "1", "--limit-train", "200",
                            "--out", "r", "--no-progress"], capture_output=True, text=True, env=env, cwd=work)  # fmt: skip
    assert train.returncode == 0, train.stderr
    assert (work / "r" / "model.safetensors").is_file()
    assert str(tmp_path / "site") in (work / "r" / "config.json").read_text()  # the card it came from is recorded
    refused = subprocess.run([*cli, "train", "--card", "digits-lenet", "--update-card", "--out", "r2"],
                             capture_output=True, text=True, env=env, cwd=work)  # fmt: skip
    assert refused.returncode == 2 and "installed package's copy" in refused.stderr
    assert "Traceback" not in refused.stderr and not (work / "r2").exists()


def test_the_core_install_loads_profiles_schedules_and_runs_a_run_without_the_extras(exit_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(exit_run, run)
    site = _core_site(tmp_path / "site-packages")
    script = f"""
import sys
import torch
from anytime.tasks.profiling import ProfileSettings, profile_run
from anytime.scheduler.runs import runner_for_run
from anytime.scheduler.query import scheduler_for_run
from anytime.train.runs import load_run
run = {str(run)!r}
loaded = load_run(run)
profile_run(run, ProfileSettings(batch_sizes=(1,), repeats=5, warmup=1, memory=False))
scheduler, _ = scheduler_for_run(run)
choice = scheduler.select(1000.0, 0.5, 1)
runner, _ = runner_for_run(run, quantile=0.5)
answer = runner.predict(torch.zeros(1, 1, 8, 8), 1000.0)
leaked = sorted({{m.split(".")[0] for m in sys.modules}} & {set(EXTRAS_ONLY)!r})
print("OK", choice.option, int(answer.step), leaked)
"""
    # -S: no site-packages but the core's; a missing extra is then really missing, as on a core install.
    done = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{site}"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("OK") and done.stdout.strip().endswith("[]"), done.stdout


@pytest.mark.parametrize("command", [["--help"], ["schedule", "--help"], ["serve", "--help"], ["--version"]])
def test_quick_commands_start_without_torch(command):
    code = ("import sys\nfrom anytime.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'fastapi', 'uvicorn', 'matplotlib'})\n"
            "sys.stderr.write(f'HEAVY {heavy}')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert "HEAVY []" in done.stderr, done.stderr[-500:]
