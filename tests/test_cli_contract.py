"""The command line's contract, frozen: every command's options and positionals as tests/cli_contract.json records
them (option strings, dest, type, default, nargs, const, choices, required, action, metavar, and the mutually
exclusive groups). A change to the command line shows here as a readable diff; when the change is meant, write the
file again with ``python tests/test_cli_contract.py --write`` and commit it with the change. The test never writes it.

A type is named by its function's name without leading underscores (whether a helper is private is not part of the
command line), and a type made by a factory (``int_at_least(2)``) by the factory's name and the values it closed over.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

CONTRACT = Path(__file__).with_name("cli_contract.json")


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: tuples as lists, anything else that JSON cannot hold as its repr."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return repr(value)


def _type_name(kind: Any) -> str | None:
    if kind is None:
        return None
    qualname = getattr(kind, "__qualname__", None) or type(kind).__qualname__
    if "<locals>" in qualname:  # made by a factory: its name and what the function closed over
        cells = [_plain(c.cell_contents) for c in getattr(kind, "__closure__", None) or ()]
        return f"{qualname.split('.<locals>')[0].lstrip('_')}({', '.join(json.dumps(c) for c in cells)})"
    return str(getattr(kind, "__name__", qualname)).lstrip("_")


def _action(action: argparse.Action) -> dict[str, Any]:
    return {
        "option_strings": list(action.option_strings),
        "dest": action.dest,
        "action": type(action).__name__,
        "type": _type_name(action.type),
        "default": _plain(action.default),
        "nargs": _plain(action.nargs),
        "const": _plain(action.const),
        "choices": _plain(list(action.choices)) if action.choices is not None else None,
        "required": action.required,
        "metavar": _plain(action.metavar),
    }


def _command(parser: argparse.ArgumentParser) -> dict[str, Any]:
    groups = parser._mutually_exclusive_groups  # argparse offers no public view of them
    return {
        "arguments": [_action(a) for a in parser._actions if not isinstance(a, argparse._SubParsersAction)],
        "mutually_exclusive": [{"required": g.required, "dests": [a.dest for a in g._group_actions]} for g in groups],
    }


def contract() -> dict[str, Any]:
    """What ``anytime.cli.build_parser()`` declares today, in the form of tests/cli_contract.json."""
    from anytime.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        "anytime": _command(parser),
        "commands": {name: _command(sub.choices[name]) for name in sorted(sub.choices)},
    }


def _text(value: dict[str, Any]) -> str:
    """The contract as JSON with one line per argument, so that a diff names the arguments that changed."""

    def command(name: str, spec: dict[str, Any], indent: str) -> list[str]:
        rows = [json.dumps(a) for a in spec["arguments"]]
        return [
            f"{indent}{json.dumps(name)}: {{",
            f'{indent}  "arguments": [',
            *(f"{indent}    {row}{',' if k < len(rows) - 1 else ''}" for k, row in enumerate(rows)),
            f"{indent}  ],",
            f'{indent}  "mutually_exclusive": {json.dumps(spec["mutually_exclusive"])}',
            f"{indent}}}",
        ]

    lines = ["{", *command("anytime", value["anytime"], "  ")]
    lines[-1] += ","
    lines.append('  "commands": {')
    for name, spec in value["commands"].items():
        lines += command(name, spec, "    ")
        lines[-1] += ","
    lines[-1] = lines[-1].removesuffix(",")
    return "\n".join([*lines, "  }", "}"]) + "\n"


def test_the_command_line_matches_its_frozen_contract():
    frozen = json.loads(CONTRACT.read_text())
    now = contract()
    if now != frozen:
        before, after = _text(frozen).splitlines(), _text(now).splitlines()
        diff = difflib.unified_diff(before, after, str(CONTRACT), "build_parser()", lineterm="", n=6)
        raise AssertionError(
            "the command line differs from tests/cli_contract.json (if that is meant: python "
            "tests/test_cli_contract.py --write)\n" + "\n".join(diff)
        )


def test_every_command_of_the_contract_is_listed_in_the_help():
    from anytime.cli import COMMANDS

    assert sorted(COMMANDS) == sorted(json.loads(CONTRACT.read_text())["commands"])


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_cli_contract.py --write  (writes tests/cli_contract.json)")
    CONTRACT.write_text(_text(contract()))
    print(f"wrote {CONTRACT}")
