"""The exit-code table: one module, the README shows it, the sandbox child agrees."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from worker_runtime import exitcodes

PACKAGE = Path(exitcodes.__file__).resolve().parent
#: The bake's README (in the template) shows the table to the teams.
README = Path(__file__).resolve().parents[2] / "{{cookiecutter.project}}" / "README.md"


def table() -> dict[str, int]:
    return {
        name: value
        for name, value in vars(exitcodes).items()
        if name.startswith("EX_") and isinstance(value, int)
    }


def test_codes_are_distinct_and_include_the_contract() -> None:
    codes = table()
    assert len(set(codes.values())) == len(codes)
    assert {"EX_OK": 0, "EX_FAILURE": 1, "EX_USAGE": 2, "EX_CONFIG": 78}.items() <= codes.items()


def test_the_readme_shows_every_code() -> None:
    readme = README.read_text()
    rows = re.findall(r"^\| (\d+) \| `(EX_\w+)` \|", readme, re.MULTILINE)
    shown = {name: int(value) for value, name in rows}
    assert shown == table()


def bare_exits(tree: ast.AST) -> list[str]:
    """``return <code>`` and ``sys.exit(<code>)`` with a literal exit code, read from the
    code (a Lua script's ``return 1`` inside a string is not Python's)."""
    codes = {0, 1, 2, 70, 75, 78, 130}
    found = []
    for node in ast.walk(tree):
        value = None
        if isinstance(node, ast.Return):
            value = node.value
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "sys.exit" and node.args:
            value = node.args[0]
        if isinstance(value, ast.Constant) and type(value.value) is int and value.value in codes:
            found.append(ast.unparse(node))
    return found


def test_no_command_returns_a_bare_number() -> None:
    offenders = [
        f"{path.name}: {line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_child.py"  # standard library only; checked below
        for line in bare_exits(ast.parse(path.read_text()))
    ]
    assert offenders == []


def test_a_bare_exit_is_found_in_code_and_not_in_a_script() -> None:
    code = 'def main() -> int:\n    return 78\n\n\nLUA = """\n    return 1\n"""\n'
    assert bare_exits(ast.parse(code)) == ["return 78"]


def test_the_sandbox_child_repeats_ex_software_and_ex_config() -> None:
    path = PACKAGE / "sandbox" / "_child.py"
    if not path.exists():
        pytest.skip("baked without the sandbox pool")
    spec = importlib.util.spec_from_file_location("_sandbox_child_for_test", path)
    assert spec is not None and spec.loader is not None
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    assert child.SETUP_FAILED == exitcodes.EX_SOFTWARE
    assert child.UNCONTAINED == exitcodes.EX_CONFIG
