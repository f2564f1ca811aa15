"""The contract across the service / worker_infra boundary has one owner: worker_runtime.

worker_infra and the bake's Pulumi program (``{{cookiecutter.project}}/infra/*.py``) import
the names and numbers of ``worker_runtime.contract``, the pool model of
``worker_runtime.pools`` and the Redis names of ``worker_runtime.layout.keys``; none of
them is restated. The scan reads every module's syntax tree (docstrings aside): a metric
name, the pool series label, an outcome, the metrics port, the uid, the memory base, the
leader TTL's bounds or a ``per_process`` value written as a literal fails here, and so does
loading a module by file path or the pool model through importlib.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_runtime import contract, pools

import worker_infra

TEMPLATE = Path(__file__).resolve().parents[2]
SOURCES = sorted(Path(worker_infra.__file__).parent.glob("*.py")) + sorted(
    (TEMPLATE / "{{cookiecutter.project}}" / "infra").glob("*.py")
)
#: Names of the contract a literal may not spell (a counter also without ``_total``).
NAMES = {
    *contract.METRICS,
    *(m.removesuffix("_total") for m in contract.METRICS),
    contract.POOL_SERIES_LABEL,
}
WORD = re.compile(r"\b(" + "|".join(sorted(map(re.escape, NAMES), key=len, reverse=True)) + r")\b")
OUTCOME = re.compile(r'outcome\s*[!=]~?\s*"[^"]*\b(' + "|".join(contract.OUTCOMES) + r")\b")
NUMBERS = {
    contract.METRICS_PORT,
    contract.RUN_AS_USER,
    contract.MEMORY_BASE_PER_PROCESS,
    contract.SCHEDULER_LEADER_TTL_MAX_MS,
}
PER_PROCESS = {contract.PER_PROCESS_DB_POOL, contract.PER_PROCESS_CONCURRENCY}


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (prose about the names is allowed)."""
    kinds = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    return {
        id(node.body[0].value)  # type: ignore[attr-defined]
        for node in ast.walk(tree)
        if isinstance(node, kinds) and ast.get_docstring(node, clean=False) is not None
    }


def field_names(tree: ast.AST) -> set[int]:
    """ids of the pools.toml field names read from a rendered file (``derived_value(pool,
    "db_pool_size")``: the pool's field, spelled as the metric is)."""
    return {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "derived_value"
        for arg in node.args[1:]
        if isinstance(arg, ast.Constant) and arg.value in pools.Pool.model_fields
    }


def restated(path: Path) -> Iterator[str]:
    """Each literal of ``path`` that restates the contract, as ``file:line: what``."""
    tree = ast.parse(path.read_text(), str(path))
    skip = docstrings(tree) | field_names(tree)
    where = f"{path.relative_to(TEMPLATE)}"
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and id(node) not in skip:
            value = node.value
            if isinstance(value, str):
                if match := WORD.search(value):
                    yield f"{where}:{line}: {match.group(1)!r}"
                if match := OUTCOME.search(value):
                    yield f"{where}:{line}: outcome {match.group(1)!r}"
                if value.rstrip("Mi") == "96" and value.endswith("Mi"):
                    yield f"{where}:{line}: the memory base {value!r}"
            elif isinstance(value, int) and not isinstance(value, bool) and value in NUMBERS:
                yield f"{where}:{line}: {value}"
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "per_process" for s in sides):
                for side in sides:
                    if isinstance(side, ast.Constant) and side.value in PER_PROCESS:
                        yield f"{where}:{line}: per_process {side.value!r}"
        if isinstance(node, ast.Attribute) and node.attr == "spec_from_file_location":
            yield f"{where}:{line}: a module loaded by file path"
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "import_module"
            and any(
                isinstance(a, ast.Constant) and str(a.value).startswith("worker_runtime")
                for a in node.args
            )
        ):
            yield f"{where}:{line}: worker_runtime through importlib"


def test_the_scan_reads_worker_infra_and_the_bakes_program() -> None:
    names = {p.name for p in SOURCES}
    assert {"alerts.py", "ruletests.py", "args.py", "guards.py", "__main__.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(TEMPLATE)))
def test_nothing_of_the_contract_is_restated(path: Path) -> None:
    problems = list(restated(path))
    # The bake's alerts.py loads its own Pulumi program (infra/__main__.py, a bake file, not
    # a service module): the one file-path load left.
    if path.name == "alerts.py" and path.parent.name == "infra":
        problems = [p for p in problems if "by file path" not in p]
    assert problems == []


def test_the_scan_finds_each_kind_of_restatement(tmp_path: Path) -> None:
    """The scan is not vacuous: a module restating each kind is refused on each line."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import importlib.util\n"
        'A = f"rate(jobs_processed_total{{x}}[5m])"\n'
        "B = 9191\n"
        'C = "worker_template_pool"\n'
        "D = r.per_process == 'db_pool_size'\n"
        "E = 'outcome=~\"retry|failure\"'\n"
        "F = importlib.util.spec_from_file_location('m', 'pools.py')\n"
        'G = "96Mi"\n'
        "H = 600_000\n"
    )
    global TEMPLATE
    saved, TEMPLATE = TEMPLATE, tmp_path
    try:
        lines = {int(p.split(":")[1]) for p in restated(planted)}
    finally:
        TEMPLATE = saved
    assert lines == set(range(2, 10))


def test_the_bakes_files_that_cannot_import_agree_with_the_contract() -> None:
    """The Dockerfile, compose.yaml and the Makefile cannot import the contract; each number
    they spell is the contract's (a change to either side fails here)."""
    bake = TEMPLATE / "{{cookiecutter.project}}"
    dockerfile = (bake / "Dockerfile").read_text()
    ids = re.findall(r"--[ug]id (\d+)|^USER (\d+):(\d+)", dockerfile, re.MULTILINE)
    assert {int(n) for found in ids for n in found if n} == {contract.RUN_AS_USER}
    assert len(ids) == 4  # groupadd --gid, useradd --uid --gid, USER uid:gid
    assert re.findall(r"^EXPOSE (\d+)", dockerfile, re.MULTILINE) == [str(contract.METRICS_PORT)]
    compose = (bake / "compose.yaml").read_text()
    exporters = re.findall(r'ports: \["127\.0\.0\.1:9\d+:(\d+)"\]', compose)  # one per pool
    assert len(exporters) >= 4 and set(exporters) == {str(contract.METRICS_PORT)}
    makefile = (bake / "Makefile").read_text()
    assert re.findall(r"^DEV_METRICS_PORT \?= (\d+)", makefile, re.MULTILINE) == [
        str(contract.METRICS_PORT)
    ]


#: The modules of worker_runtime that worker_infra may import (docs/runtime-module-map.md).
CONTRACT_MODULES = {
    "worker_runtime.contract",
    "worker_runtime.pools",
    "worker_runtime.timing",
    "worker_runtime.layout.keys",
}


def test_the_import_contract_forbids_every_other_module_of_worker_runtime() -> None:
    """infra/pyproject.toml's import-linter contract lists what worker_infra may not import:
    every module of worker_runtime but the contract modules (and the packages holding them)
    is in it, itself or through a package, so a module added to the runtime is too."""
    import tomllib

    import worker_runtime

    config = tomllib.loads((TEMPLATE / "infra" / "pyproject.toml").read_text())
    (through,) = (
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["name"].startswith("worker_infra imports worker_runtime")
    )
    assert through["source_modules"] == ["worker_infra"]
    forbidden = set(through["forbidden_modules"])
    root = Path(worker_runtime.__file__).parent
    modules = {
        ".".join(("worker_runtime", *p.relative_to(root).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for p in root.rglob("*.py")
    }
    holders = {m.rpartition(".")[0] for m in CONTRACT_MODULES} | {"worker_runtime"}
    uncovered = [
        m
        for m in sorted(modules - CONTRACT_MODULES - holders)
        if not any(m == f or m.startswith(f + ".") for f in forbidden)
    ]
    assert uncovered == []
    assert not any(m == f or m.startswith(f + ".") for m in CONTRACT_MODULES for f in forbidden)
