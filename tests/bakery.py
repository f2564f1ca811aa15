"""Helpers for the template's tests: bake projects and run them in this venv.

Every baked project runs from its ``src/`` through ``PYTHONPATH`` in this one venv
(``sys.executable``), so no test pays for a pip install per bake.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
#: The PostgreSQL the database option is tested against (.ci/run makes the socket login work).
TEST_DATABASE_URL = os.environ.get(
    "TEST_DATABASE_URL", "postgresql:///postgres?host=/var/run/postgresql"
)


def _baked_fixtures() -> Any:
    """The baked projects' own conftest (no Jinja in it), loaded under another name."""
    path = TEMPLATE / "{{cookiecutter.project}}" / "tests" / "conftest.py"
    spec = importlib.util.spec_from_file_location("baked_conftest", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BAKED_FIXTURES = _baked_fixtures()
RedisServer = BAKED_FIXTURES.RedisServer
free_port = BAKED_FIXTURES.free_port


def bake_project(output_dir: Path, **context: str) -> Path:
    """Bake the template into ``output_dir`` without prompts; return the project dir."""
    return Path(
        cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(output_dir), extra_context=context)
    )


def package_of(project: Path) -> str:
    return project.name.replace("-", "_")


def project_env(project: Path, **overrides: str) -> dict[str, str]:
    """Environment that runs ``project`` from its src/ in this venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "REDIS_", "DATABASE_"))}
    env["PYTHONPATH"] = str(project / "src")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    return env


def run_cli(project: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 60,
            ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m <package> *args`` in ``project`` and capture its output."""
    return subprocess.run(
        [PYTHON, "-m", package_of(project), *args],
        cwd=project, env=env or project_env(project), capture_output=True, text=True,
        timeout=timeout,
    )


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, step: float = 0.02) -> Any:
    """Poll ``predicate`` every ``step`` seconds (default 0.02) until it is truthy and return
    its value; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)
