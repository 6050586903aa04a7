"""The package stays in small units: no file over 500 lines, no function over 80, no public function over 8
parameters (group options in a frozen dataclass), no private name imported from another module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "anytime"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_PUBLIC_PARAMETERS = 8


def _modules() -> list[tuple[Path, str, ast.Module]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found.append((path.relative_to(PACKAGE.parent), text, ast.parse(text)))
    return found


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_file_is_over_500_lines():
    long = [f"{path}: {text.count(chr(10))}" for path, text, _ in _modules() if text.count("\n") > MAX_FILE_LINES]
    assert not long, f"split these by what they do: {long}"


def test_no_function_is_over_80_lines():
    long = [f"{path}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1})" for path, _, tree in _modules()
            for f in _functions(tree) if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]  # fmt: skip
    assert not long, f"split these into named steps: {long}"


def test_no_public_function_takes_over_8_parameters():
    def count(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
        args = f.args
        names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
        return len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)

    wide = [f"{path}:{f.lineno} {f.name} ({count(f)})" for path, _, tree in _modules() for f in _functions(tree)
            if not f.name.startswith("_") and count(f) > MAX_PUBLIC_PARAMETERS]  # fmt: skip
    assert not wide, f"group their options in a frozen dataclass: {wide}"


def test_no_private_name_is_imported_from_another_module():
    private = [f"{path}:{node.lineno} {alias.name}" for path, _, tree in _modules() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("anytime"))
               for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]  # fmt: skip
    assert not private, f"make these public where they are defined, or move them: {private}"
