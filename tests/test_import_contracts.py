"""The import contracts (import-linter, run by ``make lint``) catch the imports they forbid.

Each case copies the code, plants one bad import and runs ``lint-imports`` on the copy:
the contract that forbids it must be reported broken (and the unplanted copy keeps every
contract). In the bake: an upward import across its layers. In worker_runtime: an upward
import across the layers, a middleware importing another, layout's keys importing its
scripts, the layout importing the service, the runtime importing the benchmark, the
supervisor importing the consumer, the contract importing anything. In worker_infra: a spec
importing a component, a guard importing Secrets, the Redis names importing a component.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bakery import TEMPLATE, bake_project, package_of

LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command as l; l()"]


def verdict(stdout: str, contract: str) -> str:
    """``KEPT`` or ``BROKEN``: what lint-imports says of the contract named ``contract...``
    (its report wraps long names over lines)."""
    joined = " ".join(stdout.split())
    found = re.search(r"\b(KEPT|BROKEN)\b", joined[joined.index(contract) :])
    assert found, stdout[-2000:]
    return found.group(1)


def lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports in ``cwd`` with ``pythonpath`` first, then the caller's PYTHONPATH (a
    checkout run against another's venv: its own worker_runtime, not the venv's)."""
    inherited = os.environ.get("PYTHONPATH", "")
    return subprocess.run(
        [*LINT, "--no-cache"],
        cwd=cwd,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(pythonpath), inherited])),
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def bake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bake_project(tmp_path_factory.mktemp("contracts"))


def test_the_bake_keeps_every_contract(bake: Path) -> None:
    result = lint(bake, bake / "src")
    assert result.returncode == 0 and " 0 broken" in result.stdout, result.stdout[-2000:]


def test_a_planted_import_breaks_the_bakes_layers(bake: Path, tmp_path: Path) -> None:
    copy = tmp_path / bake.name
    shutil.copytree(bake, copy, ignore=shutil.ignore_patterns("__pycache__", ".*_cache"))
    path = copy / "src" / package_of(bake) / "settings.py"
    path.write_text(path.read_text() + "\nfrom . import broker\n")
    result = lint(copy, copy / "src")
    assert result.returncode != 0, result.stdout[-2000:]
    assert verdict(result.stdout, "layers: commands") == "BROKEN", result.stdout[-3000:]


#: (module of worker_runtime, the import planted in it, words of the contract it breaks).
RUNTIME = [
    ("settings.py", "from . import broker", "layers: commands"),
    ("middleware/retries.py", "from . import metrics", "the middleware are independent"),
    ("layout/keys.py", "from . import delivery", "layout's concepts"),
    ("layout/clock.py", "from .. import service", "the Redis layout imports nothing"),
    ("pools.py", "from . import capacity", "the commands (cli.main)"),
    ("supervisor.py", "from . import consumer", "the supervisor and its exporter"),
    ("contract.py", "from . import pools", "layers: commands"),
]


def _runtime_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "runtime"
    copy.mkdir()
    shutil.copy(TEMPLATE / "runtime" / "pyproject.toml", copy)
    shutil.copytree(
        TEMPLATE / "runtime" / "worker_runtime",
        copy / "worker_runtime",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return copy


def test_worker_runtime_keeps_every_contract(tmp_path: Path) -> None:
    copy = _runtime_copy(tmp_path)
    result = lint(copy, copy)
    assert result.returncode == 0 and " 0 broken" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize(("module", "planted", "contract"), RUNTIME)
def test_a_planted_import_breaks_worker_runtimes_contract(
    tmp_path: Path, module: str, planted: str, contract: str
) -> None:
    copy = _runtime_copy(tmp_path)
    path = copy / "worker_runtime" / module
    path.write_text(path.read_text() + "\n" + planted + "\n")
    result = lint(copy, copy)
    assert result.returncode != 0, result.stdout[-2000:]
    assert verdict(result.stdout, contract) == "BROKEN", result.stdout[-3000:]


WORKER_INFRA = [
    ("args.py", "from . import service", "layers: service"),
    ("guards.py", "from . import secrets", "layers: service"),
    ("keys.py", "from . import scaler", "layers: service"),
    ("secrets.py", "from . import pool", "layers: service"),
]
#: worker_runtime through a module other than its contract modules.
WORKER_INFRA_TO_RUNTIME = [
    ("guards.py", "from worker_runtime import settings", "worker_runtime.settings"),
    ("alerts.py", "from worker_runtime.exporter import POOL_SERIES_LABEL", "worker_runtime.exporter"),
    ("keys.py", "from worker_runtime.layout import delivery", "worker_runtime.layout.delivery"),
]


def _infra_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "infra"
    copy.mkdir()
    shutil.copy(TEMPLATE / "infra" / "pyproject.toml", copy)
    shutil.copytree(
        TEMPLATE / "infra" / "worker_infra",
        copy / "worker_infra",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return copy


def _planted_in_infra(tmp_path: Path, module: str, planted: str) -> subprocess.CompletedProcess[str]:
    """lint-imports on a copy of worker_infra whose ``module`` ends with ``planted``: failed."""
    copy = _infra_copy(tmp_path)
    path = copy / "worker_infra" / module
    path.write_text(path.read_text() + "\n" + planted + "\n")
    result = lint(copy, copy)
    assert result.returncode != 0, result.stdout[-2000:]
    return result


def test_worker_infra_keeps_every_contract(tmp_path: Path) -> None:
    copy = _infra_copy(tmp_path)
    result = lint(copy, copy)
    assert result.returncode == 0 and " 0 broken" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize(("module", "planted", "contract"), WORKER_INFRA)
def test_a_planted_import_breaks_worker_infras_layers(
    tmp_path: Path, module: str, planted: str, contract: str
) -> None:
    result = _planted_in_infra(tmp_path, module, planted)
    assert verdict(result.stdout, contract) == "BROKEN"
    assert f"is not allowed to import worker_infra.{planted.split()[-1]}" in result.stdout, (
        result.stdout[-3000:]
    )


@pytest.mark.parametrize(("module", "planted", "imported"), WORKER_INFRA_TO_RUNTIME)
def test_worker_infra_imports_worker_runtime_through_its_contract_modules_only(
    tmp_path: Path, module: str, planted: str, imported: str
) -> None:
    result = _planted_in_infra(tmp_path, module, planted)
    assert verdict(result.stdout, "worker_infra imports worker_runtime") == "BROKEN"
    assert f"is not allowed to import {imported}" in result.stdout, result.stdout[-3000:]
