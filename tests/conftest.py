"""Fixtures for the template's tests: bake projects, run them, give them a real Redis.

Every baked project runs from its ``src/`` through ``PYTHONPATH`` in this one venv
(``sys.executable``), so no test pays for a pip install per bake.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import importlib.util

import pytest
from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def _baked_fixtures() -> object:
    """The baked projects' own conftest (no Jinja in it), loaded under another name."""
    path = TEMPLATE / "{{cookiecutter.project}}" / "tests" / "conftest.py"
    spec = importlib.util.spec_from_file_location("baked_conftest", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RedisServer = _baked_fixtures().RedisServer  # type: ignore[attr-defined]


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


@pytest.fixture(scope="session")
def bake(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``bake(**context)`` bakes once per distinct context in this session and returns the dir."""
    cache: dict[str, Path] = {}

    def _bake(**context: str) -> Path:
        key = json.dumps(context, sort_keys=True)
        if key not in cache:
            cache[key] = bake_project(tmp_path_factory.mktemp("bake"), **context)
        return cache[key]

    return _bake


@pytest.fixture(scope="session")
def default_project(bake: Callable[..., Path]) -> Path:
    """The template baked with its defaults (orders-worker, postgres, sandbox pool)."""
    return bake()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's redis-server (restarted if a test stopped it), emptied for this test."""
    import redis

    if redis_server.process is None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
