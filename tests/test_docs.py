"""The documentation site: the command reference generated from the parsers is current, and the README's links into
docs/ lead to pages that exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STALE = "docs/reference/cli.md is stale: run `python docs/gen_cli_reference.py` and commit the page"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_reference", REPO / "docs" / "gen_cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_reference_is_current():
    assert (REPO / "docs" / "reference" / "cli.md").read_text() == _generator().render(), STALE


def test_the_command_reference_has_every_command_and_does_not_follow_the_terminal(monkeypatch):
    import argparse

    from anytime.cli import build_parser

    generator = _generator()
    wide = generator.render()
    monkeypatch.setenv("COLUMNS", "40")
    assert generator.render() == wide
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name in commands.choices:
        assert f"\n## anytime {name}\n" in wide


def test_the_readmes_links_into_docs_lead_to_pages():
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert targets
    missing = sorted({t for t in targets if not (REPO / t).is_file()})
    assert not missing, f"README.md links to pages that do not exist: {missing}"
