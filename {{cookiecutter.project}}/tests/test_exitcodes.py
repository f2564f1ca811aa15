"""The exit-code table: one module, the README shows it, the sandbox child agrees."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from {{ cookiecutter.package }} import exitcodes

PROJECT = Path(__file__).resolve().parents[1]
PACKAGE = PROJECT / "src" / "{{ cookiecutter.package }}"


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
    readme = (PROJECT / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(EX_\w+)` \|", readme, re.MULTILINE)
    shown = {name: int(value) for value, name in rows}
    assert shown == table()


def test_no_command_returns_a_bare_number() -> None:
    # Python's indentation (Lua scripts inside strings are indented by two)
    bare = re.compile(r"^( {4})+(return|sys\.exit\()\s*(0|1|2|70|78|130)\)?$")
    offenders = [
        f"{path.name}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_sandbox_child.py"  # standard library only; checked below
        for line in path.read_text().splitlines()
        if bare.match(line)
    ]
    assert offenders == []


def test_the_sandbox_child_repeats_ex_software_and_ex_config() -> None:
    path = PACKAGE / "_sandbox_child.py"
    if not path.exists():
        pytest.skip("baked without the sandbox pool")
    spec = importlib.util.spec_from_file_location("_sandbox_child_for_test", path)
    assert spec is not None and spec.loader is not None
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    assert child.SETUP_FAILED == exitcodes.EX_SOFTWARE
    assert child.UNCONTAINED == exitcodes.EX_CONFIG
